// Fuzzes the disk backend's object parsing through its own entry points: the input becomes the
// file of one object in the backend's directory, then the backend is opened (the index rebuild
// decodes and checks the header: check_object_file), asked whether the key exists and asked to
// get it (the read path decodes the header again and verifies the object).
//
// Input: one control byte, then the file's bytes.
//   bit 0  copy the expected identity (namespace, layout, key, rank) into the header
//   bit 1  recompute both checksums (fuzz_util.h reseal)
//   bit 2  verify_payload_on_open (the rebuild reads and checks the payload)
//   bit 3  runtime overwrite: the backend opens over a valid object (indexed with its sizes),
//          then the file is replaced by the input before the get
//   bit 4  O_DIRECT where the filesystem takes it (else buffered: opening probes O_DIRECT with a
//          real write, which costs most of an input's time)
//   bits 5-6 destination capacity: the header's payload size (at most 1 MiB), 0, 4096, 1 MiB
//
// Invariants (abort, so libFuzzer keeps the input): opening never fails and nothing waits past
// its deadline; a get reported OK returned exactly the payload bytes of the file.
//
// KVTIER_FUZZ_WRITE_SEEDS=<dir>: writes valid objects as seed inputs there, then fuzzes as usual.
#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "fuzz/fuzz_util.h"
#include "kvtier/core/log.h"
#include "kvtier/storage/disk_backend.h"

namespace kvtier::fuzz {
namespace {

using namespace kvtier::storage;

constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;
constexpr std::chrono::seconds kDeadline{10};

StorageOptions fuzz_options() {
  StorageOptions o;
  o.ns = "fuzz-disk";
  o.layout_fingerprint = 0x6b76746965720001ULL;
  o.roles = {{0, 0, 1, 0, 64}, {0, 1, 1, 64, 64}};
  return o;
}

struct State {
  storage::testing::TempDir dir;
  StorageKey key = StorageKey::from_u64(0x0123456789abcdefULL, 0xfedcba9876543210ULL, 3);
  std::string path;                  // the object's file
  std::vector<std::byte> reference;  // a valid object of `key` (the file the backend wrote)
};

storage::DiskBackendConfig config_for(const State& s, bool verify, bool direct) {
  storage::DiskBackendConfig c;
  c.root = s.dir.path();
  c.durability = storage::Durability::kProcessCrash;
  c.direct_io = direct ? storage::DirectIo::kAuto : storage::DirectIo::kOff;
  c.queue_depth = 4;
  c.verify_payload_on_open = verify;
  c.max_free_files = 0;        // replaced files are unlinked: the directory holds one object
  c.max_quarantine_files = 0;  // quarantined files are unlinked
  return c;
}

Status put(storage::StorageBackend& b, const StorageKey& key, const std::vector<std::byte>& payload) {
  storage::testing::AlignedBuffer buf(payload.size());
  if (!payload.empty()) std::memcpy(buf.data(), payload.data(), payload.size());
  StorageBatch batch{StorageOp::kPut, {{key, buf.data(), payload.size()}}};
  KVTIER_ASSIGN_OR_RETURN(StorageTicket t, b.post(std::move(batch)));
  KVTIER_RETURN_IF_ERROR(t.wait(kDeadline));
  return t.item(0).status;
}

State* init_state() {
  auto* s = new State();
  set_log_level(LogLevel::kOff);  // every rejected input is logged as a quarantine otherwise
  auto b = storage::create_disk_backend(config_for(*s, false, true), fuzz_options());
  KVTIER_FUZZ_CHECK(b.ok());
  const char* seeds = std::getenv("KVTIER_FUZZ_WRITE_SEEDS");
  int n = 0;
  // Seeds: valid objects of several payload sizes (the last one, aligned, stays the reference).
  for (std::size_t bytes : {128u, 5000u, 4096u}) {
    std::vector<std::byte> payload(bytes);
    for (std::size_t i = 0; i < bytes; ++i) payload[i] = static_cast<std::byte>(i * 131 + 7);
    KVTIER_FUZZ_CHECK(put(**b, s->key, payload).ok());
    if (s->path.empty()) s->path = find_file(s->dir.path(), s->key.to_string() + ".kvo");
    KVTIER_FUZZ_CHECK(!s->path.empty());
    s->reference = read_file(s->path);
    if (seeds != nullptr)
      for (std::uint8_t ctl : {0x00, 0x1c}) {
        std::vector<std::byte> seed{static_cast<std::byte>(ctl)};
        seed.insert(seed.end(), s->reference.begin(), s->reference.end());
        KVTIER_FUZZ_CHECK(write_file(fmt::format("{}/object-{}", seeds, n++), seed.data(), seed.size()));
      }
  }
  b->reset();
  return s;
}

std::uint64_t capacity_for(std::uint8_t sel, const std::vector<std::byte>& obj) {
  switch (sel) {
    case 0: return obj.size() >= kFixedHeader ? std::min(load_le(obj.data() + kOffPayload, 8), kMiB) : 0;
    case 1: return 0;
    case 2: return 4096;
    default: return kMiB;
  }
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
  std::vector<std::byte> obj(reinterpret_cast<const std::byte*>(data + 1),
                             reinterpret_cast<const std::byte*>(data + size));
  if (ctl & 1) copy_identity(obj, s->reference);
  if (ctl & 2) reseal(obj);
  const bool overwrite_at_run_time = ctl & 8;

  const std::vector<std::byte>& on_open = overwrite_at_run_time ? s->reference : obj;
  KVTIER_FUZZ_CHECK(write_file(s->path, on_open.data(), on_open.size()));
  auto opened = storage::create_disk_backend(config_for(*s, ctl & 4, ctl & 16), fuzz_options());
  // No file in the directory can stop the disk tier from opening.
  KVTIER_FUZZ_CHECK(opened.ok());
  std::unique_ptr<storage::StorageBackend> b = std::move(opened).value();
  if (overwrite_at_run_time) KVTIER_FUZZ_CHECK(write_file(s->path, obj.data(), obj.size()));

  {
    auto t = b->post(StorageBatch{StorageOp::kExists, {{s->key, nullptr, 0}}});
    KVTIER_FUZZ_CHECK(t.ok());
    KVTIER_FUZZ_CHECK(t->wait(kDeadline).ok());
    const ItemResult r = t->item(0);
    // An indexed object's size is one the file holds.
    if (r.status.ok()) KVTIER_FUZZ_CHECK(r.bytes <= on_open.size());
  }
  const std::uint64_t cap = capacity_for((ctl >> 5) & 3, obj);
  storage::testing::AlignedBuffer dst(cap);
  auto t = b->post(StorageBatch{StorageOp::kGet, {{s->key, dst.data(), cap}}});
  KVTIER_FUZZ_CHECK(t.ok());
  KVTIER_FUZZ_CHECK(t->wait(kDeadline).ok());
  const ItemResult r = t->item(0);
  if (r.status.ok()) {
    // Served: exactly the payload the file's header describes, byte for byte.
    KVTIER_FUZZ_CHECK(obj.size() >= kFixedHeader);
    const std::uint64_t hs = load_le(obj.data() + kOffHeaderSize, 4);
    KVTIER_FUZZ_CHECK(r.bytes == load_le(obj.data() + kOffPayload, 8));
    KVTIER_FUZZ_CHECK(r.bytes <= cap && hs <= obj.size() && r.bytes <= obj.size() - hs);
    KVTIER_FUZZ_CHECK(r.bytes == 0 || std::memcmp(dst.data(), obj.data() + hs, r.bytes) == 0);
  }
  return 0;
}
