// Fuzzes the Redis backend's value parsing through its own entry point: a get of one key from a
// backend connected to a small in-process server (loopback) that answers every GETRANGE (what a
// get sends) with the requested range of the input. The backend decodes the value as an object
// (header, identity, exact size, checksum) before it copies any byte into the destination.
//
// Input: one control byte, then the value.
//   bit 0  copy the expected identity (namespace, layout, key, rank) into the header
//   bit 1  recompute both checksums (fuzz_util.h reseal)
//   bits 2-3 destination capacity: the header's payload size (at most 1 MiB), 0, 128, 1 MiB
//
// Invariants: the get completes within its deadline; reported OK, it returned exactly the
// value's payload, and the value is exactly header + payload long; the server never had to send
// more than the backend's header + the destination's capacity + 1 bytes of the value (a value
// longer than that is refused without being read whole).
//
// KVTIER_FUZZ_WRITE_SEEDS=<dir>: writes the values the backend stores as seed inputs there.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fuzz/fuzz_util.h"
#include "kvtier/core/log.h"
#include "kvtier/storage/redis_backend.h"
#include "storage/fake_redis.h"

namespace kvtier::fuzz {
namespace {

using namespace kvtier::storage;

using storage::testing::parse_command;
using storage::testing::send_all;
using storage::testing::UniqueFd;
using storage::testing::wait_readable;

constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;

// Answers GETRANGE with that range of the current value whatever the key (STRLEN with its
// length); keeps the last SET value and the length of the last range sent. The harness lives for
// the whole process, so its threads are never joined.
class ValueServer {
 public:
  ValueServer() {
    listen_ = UniqueFd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    KVTIER_FUZZ_CHECK(listen_.get() >= 0 && ::bind(listen_.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                      ::listen(listen_.get(), 16) == 0 &&
                      ::getsockname(listen_.get(), reinterpret_cast<sockaddr*>(&a), &len) == 0);
    port_ = ntohs(a.sin_port);
    std::thread([this] { accept_loop(); }).detach();
  }
  std::string endpoint() const { return fmt::format("127.0.0.1:{}", port_); }
  void set_value(std::string v) {
    std::lock_guard<std::mutex> lk(mu_);
    value_ = std::move(v);
    last_range_bytes_ = 0;
  }
  std::string last_set() {
    std::lock_guard<std::mutex> lk(mu_);
    return last_set_;
  }
  std::size_t last_range_bytes() {
    std::lock_guard<std::mutex> lk(mu_);
    return last_range_bytes_;
  }

 private:
  void accept_loop() {
    for (;;) {
      const int fd = ::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) std::thread([this, fd] { serve(UniqueFd(fd)); }).detach();
    }
  }
  void serve(UniqueFd conn) {
    std::string in;
    std::vector<char> buf(std::size_t{1} << 16);
    std::vector<std::string> args;
    for (;;) {
      if (!wait_readable(conn.get(), std::chrono::milliseconds(100))) continue;
      const ssize_t n = ::recv(conn.get(), buf.data(), buf.size(), 0);
      if (n <= 0) return;
      in.append(buf.data(), static_cast<std::size_t>(n));
      for (long used; (used = parse_command(in, &args)) != 0;) {
        if (used < 0) return;
        in.erase(0, static_cast<std::size_t>(used));
        if (!send_all(conn.get(), reply(args))) return;
      }
    }
  }
  std::string reply(const std::vector<std::string>& a) {
    const std::string cmd = a.empty() ? "" : a[0];
    std::lock_guard<std::mutex> lk(mu_);
    if (cmd == "GETRANGE" && a.size() == 4) {
      // Redis's rule for non-negative bounds: [start, end] clamped to the value, end inclusive.
      const unsigned long long lo = std::strtoull(a[2].c_str(), nullptr, 10);
      const unsigned long long hi = std::strtoull(a[3].c_str(), nullptr, 10);
      std::string part;
      if (lo < value_.size() && lo <= hi)
        part = value_.substr(lo, hi - lo < value_.size() ? hi - lo + 1 : value_.size());
      last_range_bytes_ = part.size();
      return fmt::format("${}\r\n", part.size()) + part + "\r\n";
    }
    if (cmd == "SET" && a.size() >= 3) {
      last_set_ = a[2];
      return "+OK\r\n";
    }
    if (cmd == "PING") return "+PONG\r\n";
    if (cmd == "AUTH") return "+OK\r\n";
    if (cmd == "DEL") return ":1\r\n";
    if (cmd == "STRLEN") return fmt::format(":{}\r\n", value_.size());
    return fmt::format("-ERR unknown command '{}'\r\n", cmd);
  }

  UniqueFd listen_;
  int port_ = 0;
  std::mutex mu_;
  std::string value_;
  std::string last_set_;
  std::size_t last_range_bytes_ = 0;
};

struct State {
  ValueServer server;
  std::unique_ptr<storage::StorageBackend> backend;
  StorageKey key = StorageKey::from_u64(0x1111222233334444ULL, 0x5555666677778888ULL, 1);
  std::vector<std::byte> reference;  // the value the backend stored for `key`
  std::uint64_t header_bytes = 0;    // the backend's object header (the reference's)
};

State* init_state() {
  auto* s = new State();
  set_log_level(LogLevel::kOff);
  storage::RedisBackendConfig c;
  c.endpoints = {s->server.endpoint()};
  c.mode = storage::RedisMode::kSingle;
  c.workers = 1;
  c.max_retries = 0;
  c.command_timeout = std::chrono::milliseconds(5000);
  StorageOptions o;
  o.ns = "fuzz-redis";
  o.layout_fingerprint = 0x6b76746965720002ULL;
  o.roles = {{0, 0, 1, 0, 64}, {1, 0, 1, 64, 64}};
  auto b = storage::create_redis_backend(c, o);
  KVTIER_FUZZ_CHECK(b.ok());
  s->backend = std::move(b).value();
  const char* seeds = std::getenv("KVTIER_FUZZ_WRITE_SEEDS");
  int n = 0;
  for (std::size_t bytes : {128u, 1000u, 200u}) {
    std::vector<std::byte> payload(bytes);
    for (std::size_t i = 0; i < bytes; ++i) payload[i] = static_cast<std::byte>(i * 37 + 1);
    auto t = s->backend->post(StorageBatch{StorageOp::kPut, {{s->key, payload.data(), bytes}}});
    KVTIER_FUZZ_CHECK(t.ok() && t->wait(std::chrono::seconds(10)).ok() && t->item(0).status.ok());
    const std::string v = s->server.last_set();
    s->reference.assign(reinterpret_cast<const std::byte*>(v.data()),
                        reinterpret_cast<const std::byte*>(v.data()) + v.size());
    if (seeds != nullptr)
      for (std::uint8_t ctl : {0x00, 0x04, 0x08}) {
        std::string seed(1, static_cast<char>(ctl));
        seed += v;
        KVTIER_FUZZ_CHECK(write_file(fmt::format("{}/value-{}", seeds, n++), seed.data(), seed.size()));
      }
  }
  s->header_bytes = load_le(s->reference.data() + kOffHeaderSize, 4);
  return s;
}

}  // namespace
}  // namespace kvtier::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvtier;
  using namespace kvtier::fuzz;
  using namespace kvtier::storage;
  static State* s = init_state();
  if (size < 1) return 0;
  const std::uint8_t ctl = data[0];
  std::vector<std::byte> value(reinterpret_cast<const std::byte*>(data + 1),
                               reinterpret_cast<const std::byte*>(data + size));
  if (ctl & 1) copy_identity(value, s->reference);
  if (ctl & 2) reseal(value);
  s->server.set_value(std::string(reinterpret_cast<const char*>(value.data()), value.size()));
  std::uint64_t cap = kMiB;
  switch ((ctl >> 2) & 3) {
    case 0: cap = value.size() >= kFixedHeader ? std::min(load_le(value.data() + kOffPayload, 8), kMiB) : 0; break;
    case 1: cap = 0; break;
    case 2: cap = 128; break;
    default: break;
  }
  std::vector<std::byte> dst(cap);
  auto t = s->backend->post(StorageBatch{StorageOp::kGet, {{s->key, dst.data(), cap}}});
  KVTIER_FUZZ_CHECK(t.ok());
  KVTIER_FUZZ_CHECK(t->wait(std::chrono::seconds(20)).ok());
  const ItemResult r = t->item(0);
  KVTIER_FUZZ_CHECK(s->server.last_range_bytes() <= s->header_bytes + cap + 1);
  if (r.status.ok()) {
    KVTIER_FUZZ_CHECK(value.size() >= kFixedHeader);
    const std::uint64_t hs = load_le(value.data() + kOffHeaderSize, 4);
    KVTIER_FUZZ_CHECK(r.bytes == load_le(value.data() + kOffPayload, 8));
    KVTIER_FUZZ_CHECK(r.bytes <= cap && hs + r.bytes == value.size());
    KVTIER_FUZZ_CHECK(r.bytes == 0 || std::memcmp(dst.data(), value.data() + hs, r.bytes) == 0);
  }
  return 0;
}
