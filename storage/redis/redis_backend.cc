// Redis backend, single server and cluster (see include/kvtier/storage/redis_backend.h).
#include "kvtier/storage/redis_backend.h"

#include <fmt/format.h>
#include <hiredis/hiredis.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/uio.h>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstdarg>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "kvtier/core/log.h"
#include "storage/object_format.h"
#include "storage/region_set.h"

namespace kvtier::storage {
namespace {

// A write to a socket the server closed raises SIGPIPE, whose default action
// kills the process. A library must not change the process's handlers, so the
// threads that talk to Redis block SIGPIPE while they do: the write then fails
// with EPIPE (a connection error, retried or reported), and the pending signal
// is consumed before the mask is restored.
class ScopedSigpipeBlock {
 public:
  ScopedSigpipeBlock() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    blocked_ = pthread_sigmask(SIG_BLOCK, &pipe_, &old_) == 0;
  }
  ~ScopedSigpipeBlock() {
    if (!blocked_) return;
    const struct timespec zero = {0, 0};
    while (sigtimedwait(&pipe_, nullptr, &zero) > 0) {
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  ScopedSigpipeBlock(const ScopedSigpipeBlock&) = delete;
  ScopedSigpipeBlock& operator=(const ScopedSigpipeBlock&) = delete;

 private:
  sigset_t pipe_;
  sigset_t old_;
  bool blocked_ = false;
};

constexpr int kNumSlots = 16384;

// Replies that mean the credentials are missing, wrong or lack a right (not a transient state).
bool is_auth_error(std::string_view msg) {
  return msg.starts_with("NOAUTH") || msg.starts_with("WRONGPASS") || msg.starts_with("NOPERM");
}

// Every line is a warning: a Redis Cluster that no node describes, or an object that failed verification.
void log_line(const std::string& s) { kvtier::log(LogLevel::kWarning, "storage/redis", s); }

constexpr std::array<std::uint16_t, 256> make_crc16_table() {
  std::array<std::uint16_t, 256> t{};
  for (int i = 0; i < 256; ++i) {
    std::uint16_t crc = static_cast<std::uint16_t>(i << 8);
    for (int b = 0; b < 8; ++b) crc = static_cast<std::uint16_t>((crc & 0x8000) ? (crc << 1) ^ 0x1021 : crc << 1);
    t[i] = crc;
  }
  return t;
}
constexpr auto kCrc16Table = make_crc16_table();

std::uint16_t crc16(std::string_view s) noexcept {
  std::uint16_t crc = 0;
  for (unsigned char c : s) crc = static_cast<std::uint16_t>((crc << 8) ^ kCrc16Table[((crc >> 8) ^ c) & 0xff]);
  return crc;
}

struct ReplyDeleter {
  void operator()(redisReply* r) const noexcept {
    if (r) freeReplyObject(r);
  }
};
using ReplyPtr = std::unique_ptr<redisReply, ReplyDeleter>;
struct ContextDeleter {
  void operator()(redisContext* c) const noexcept {
    if (c) redisFree(c);
  }
};
using ContextPtr = std::unique_ptr<redisContext, ContextDeleter>;

using Clock = std::chrono::steady_clock;
constexpr Clock::time_point kNoDeadline = Clock::time_point::max();

timeval to_timeval(std::chrono::milliseconds ms) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(ms.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms.count() % 1000) * 1000);
  return tv;
}

struct SlotMap {
  std::vector<std::string> nodes;
  std::array<std::int16_t, kNumSlots> owner;
  SlotMap() { owner.fill(-1); }
  int node_index(const std::string& node) {
    auto it = std::find(nodes.begin(), nodes.end(), node);
    if (it != nodes.end()) return static_cast<int>(it - nodes.begin());
    nodes.push_back(node);
    return static_cast<int>(nodes.size() - 1);
  }
};

// "MOVED 3999 127.0.0.1:6381" -> (3999, "127.0.0.1:6381")
bool parse_redirect(std::string_view msg, std::string_view word, int* slot, std::string* node) {
  if (msg.substr(0, word.size()) != word || msg.size() <= word.size() + 1) return false;
  msg.remove_prefix(word.size() + 1);
  auto sp = msg.find(' ');
  if (sp == std::string_view::npos) return false;
  *slot = std::atoi(std::string(msg.substr(0, sp)).c_str());
  *node = std::string(msg.substr(sp + 1));
  return true;
}

class RedisBackend final : public StorageBackend {
 public:
  RedisBackend(RedisBackendConfig config, StorageOptions options)
      : config_(std::move(config)), options_(std::move(options)) {
    ns_digest_ = format::namespace_digest(options_);
    header_size_ = format::header_bytes(options_, 8);
    // "<prefix>:[<tenant>:]": a fixed string per tenant, so an ACL user can be limited to it.
    key_base_ =
        options_.tenant.empty() ? config_.key_prefix + ":" : fmt::format("{}:{}:", config_.key_prefix, options_.tenant);
    // With a secret the rest of the name is a keyed hash (SCAN shows nothing of ns or block).
    if (options_.tenant_secret.empty())
      key_base_ += fmt::format("{:016x}-{:016x}:", ns_digest_, options_.layout_fingerprint);
  }

  ~RedisBackend() override {
    {
      std::lock_guard<std::mutex> lk(queue_mu_);
      stopping_ = true;
    }
    queue_cv_.notify_all();
    for (auto& t : workers_) t.join();
    for (auto& task : queue_)
      for (auto& [i, item] : task.items) task.completion->complete(i, Cancelled("redis backend shut down"));
  }

  Status init() {
    ScopedSigpipeBlock no_sigpipe;
    if (config_.endpoints.empty()) return InvalidArgument("redis backend: no endpoints");
    KVTIER_RETURN_IF_ERROR(format::check_tenant_options(options_).with_context("redis backend"));
    if (config_.workers == 0 || config_.workers > kMaxRedisWorkers)
      return InvalidArgument(fmt::format("redis backend: workers (storage.redis.workers) {} not in [1, {}]",
                                         config_.workers, kMaxRedisWorkers));
    if (config_.max_batch_items == 0 || config_.max_batch_items > kMaxRedisBatchItems)
      return InvalidArgument(
          fmt::format("redis backend: max_batch_items (storage.redis.max_batch_items) {} not in [1, {}]",
                      config_.max_batch_items, kMaxRedisBatchItems));
    if (config_.item_deadline.count() <= 0 || config_.batch_deadline.count() <= 0)
      return InvalidArgument(fmt::format("redis backend: item_deadline {} ms and batch_deadline {} ms must be > 0",
                                         config_.item_deadline.count(), config_.batch_deadline.count()));
    if (config_.command_timeout.count() <= 0 || config_.connect_timeout.count() <= 0)
      return InvalidArgument(fmt::format("redis backend: command_timeout {} ms and connect_timeout {} ms must be > 0",
                                         config_.command_timeout.count(), config_.connect_timeout.count()));
    if (config_.create_deadline.count() <= 0)
      return InvalidArgument(
          fmt::format("redis backend: create_deadline {} ms must be > 0", config_.create_deadline.count()));
    // Added to the clock: past about 292 years that overflowed (a deadline already passed, blaming another
    // limit). A day is what the spec's parameters allow too.
    constexpr std::chrono::milliseconds kMaxWait = std::chrono::hours(24);
    const std::pair<const char*, std::chrono::milliseconds> waits[] = {
        {"connect_timeout", config_.connect_timeout}, {"command_timeout", config_.command_timeout},
        {"backoff_initial", config_.backoff_initial}, {"backoff_max", config_.backoff_max},
        {"item_deadline", config_.item_deadline},     {"batch_deadline", config_.batch_deadline},
        {"create_deadline", config_.create_deadline}};
    for (const auto& [name, value] : waits)
      if (value.count() < 0 || value > kMaxWait)
        return InvalidArgument(
            fmt::format("redis backend: {} {} ms is not within a day ({} ms)", name, value.count(), kMaxWait.count()));
    for (const auto& e : config_.endpoints) KVTIER_RETURN_IF_ERROR(parse_host_port(e));
    // A connection reset or an unreachable node while the cluster is changing
    // (restart, failover, an admin killing clients) is transient: every
    // endpoint is tried, then again after a backoff, up to max_retries more rounds.
    // All of it within create_deadline: without it a stopped or hung server cost
    // (max_retries + 1) x command_timeout per seed endpoint (25.6 s for one by default).
    const Clock::time_point deadline = Clock::now() + config_.create_deadline;
    KeptStatus last = Unavailable("no endpoint tried");  // the latest endpoint's failure, reported only if none works
    std::string node;
    auto backoff = config_.backoff_initial;
    for (std::uint32_t attempt = 0; attempt <= config_.max_retries && node.empty() && Clock::now() < deadline;
         ++attempt) {
      if (attempt > 0) {
        std::this_thread::sleep_for(capped(backoff, deadline));
        backoff = std::min(backoff * 2, config_.backoff_max);
      }
      for (const auto& e : config_.endpoints) {
        if (Clock::now() >= deadline) break;
        auto c = connect(e, deadline);
        if (!c.ok()) {
          if (c.status().code() == StatusCode::kFailedPrecondition) return c.status();
          last = c.status();
          continue;
        }
        if (config_.mode == RedisMode::kSingle) {
          // Nothing else is sent at create in single mode: a missing password must show here,
          // not as a failure of every later item.
          // A connection lost during the PING says nothing about the password: the node is
          // used as before (items retry and fail on their own), only a refusal fails create.
          auto pong = command_by(c->get(), deadline, "PING");
          const ReplyPtr r = pong.ok() ? std::move(pong).value() : nullptr;
          if (r && r->type == REDIS_REPLY_ERROR && is_auth_error(std::string_view(r->str, r->len)))
            return FailedPrecondition(fmt::format("PING on {} refused: {}", e, std::string(r->str, r->len)));
          node = e;
          break;
        }
        auto map = load_slots(c->get(), e, deadline);
        if (map.status().code() == StatusCode::kFailedPrecondition) return map.status();
        if (map.ok()) {
          cluster_ = true;
          slots_ = std::make_shared<SlotMap>(std::move(map).value());
          node = e;
          break;
        }
        // Only a server that says it is not a cluster makes kAuto fall back to
        // one node; a reset connection says nothing about the server.
        if (map.status().code() == StatusCode::kNotSupported && config_.mode == RedisMode::kAuto) {
          cluster_ = false;
          node = e;
          break;
        }
        if (map.status().code() == StatusCode::kNotSupported)  // kCluster against a non-cluster server
          return map.status().with_context(fmt::format("CLUSTER SLOTS on {}", e));
        last = map.status();
      }
    }
    if (node.empty() && Clock::now() >= deadline)
      return Unavailable(fmt::format("redis backend: no endpoint usable within create_deadline of {} ms (last: {})",
                                     config_.create_deadline.count(), last.to_string()));
    if (node.empty())
      return last.with_context(
          fmt::format("redis backend: no endpoint usable after {} rounds", config_.max_retries + 1));
    single_node_ = node;
    for (std::uint32_t i = 0; i < config_.workers; ++i) workers_.emplace_back([this] { worker(); });
    return Status::Ok();
  }

  std::string_view name() const noexcept override { return cluster_ ? "redis-cluster" : "redis"; }
  StorageCaps caps() const noexcept override {
    StorageCaps c;
    c.zero_copy_host = false;
    c.native_async = false;
    c.shared = true;
    c.cancellable = true;
    c.persistent = true;
    c.max_in_flight = config_.workers * config_.max_batch_items;
    c.max_object_bytes = (std::uint64_t{512} << 20) - header_size_;
    c.alignment = 1;
    return c;
  }
  const StorageOptions& options() const noexcept override { return options_; }
  // Values pass through hiredis buffers: registration is bookkeeping only.
  Status register_region(void* ptr, std::uint64_t bytes) override { return regions_.add(ptr, bytes); }
  Status unregister_region(void* ptr) override { return regions_.remove(ptr); }

  Result<StorageTicket> post(StorageBatch batch) override {
    KVTIER_RETURN_IF_ERROR(check_batch_buffers(batch));
    const std::uint64_t max_bytes = caps().max_object_bytes;
    for (std::size_t i = 0; i < batch.items.size(); ++i) {
      const StorageItem& it = batch.items[i];
      if (batch.op == StorageOp::kPut) {
        if (it.bytes > max_bytes)
          return InvalidArgument(fmt::format("put item {}: {} bytes > Redis limit {}", i, it.bytes, max_bytes));
        KVTIER_RETURN_IF_ERROR(
            format::check_payload_size(options_, it.bytes).with_context(fmt::format("put item {}", i)));
      }
    }
    StorageTicket t = StorageTicket::create(batch.op, batch.items.size());
    const Clock::time_point batch_deadline = Clock::now() + config_.batch_deadline;
    {
      std::lock_guard<std::mutex> lk(queue_mu_);
      if (stopping_) return FailedPrecondition("redis backend is shutting down");
      for (std::size_t b = 0; b < batch.items.size(); b += config_.max_batch_items) {
        Task task;
        task.completion = t.completion();
        task.deadline = batch_deadline;
        task.op = batch.op;
        const std::size_t e = std::min(batch.items.size(), b + config_.max_batch_items);
        for (std::size_t i = b; i < e; ++i) task.items.emplace_back(i, batch.items[i]);
        queue_.push_back(std::move(task));
      }
    }
    queue_cv_.notify_all();
    return t;
  }

  Status cancel(const StorageTicket& ticket) override {
    if (!ticket.valid()) return InvalidArgument("cancel: invalid ticket");
    std::lock_guard<std::mutex> lk(queue_mu_);
    for (auto it = queue_.begin(); it != queue_.end();) {
      if (it->completion == ticket.completion()) {
        for (auto& [i, item] : it->items) it->completion->complete(i, Cancelled("cancelled before it started"));
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    return Status::Ok();
  }

  StorageStats stats() const override {
    StorageStats s;
    s.quarantined = quarantined_.load();
    s.auth_failures = auth_failures_.load();
    s.redirects = redirects_.load();
    s.reconnects = reconnects_.load();
    return s;
  }

  Result<std::uint64_t> stored_object_bytes(const StorageKey& key) override {
    KVTIER_ASSIGN_OR_RETURN(ReplyPtr r, admin_command(key, {"STRLEN"}));
    if (r->type != REDIS_REPLY_INTEGER) return DataLoss(fmt::format("STRLEN: reply of type {} (out of spec)", r->type));
    if (r->integer == 0) return NotFound(fmt::format("key {} not stored", key.to_string()));
    return static_cast<std::uint64_t>(r->integer);
  }

  Status corrupt_stored_object(const StorageKey& key, std::uint64_t offset, std::uint8_t xor_mask) override {
    KVTIER_ASSIGN_OR_RETURN(ReplyPtr r,
                            admin_command(key, {"GETRANGE", std::to_string(offset), std::to_string(offset)}));
    if (r->type != REDIS_REPLY_STRING || r->len != 1)
      return OutOfRange(fmt::format("offset {} beyond object {}", offset, key.to_string()));
    std::string b(1, static_cast<char>(static_cast<unsigned char>(r->str[0]) ^ xor_mask));
    KVTIER_ASSIGN_OR_RETURN(ReplyPtr w, admin_command(key, {"SETRANGE", std::to_string(offset), b}));
    if (w->type == REDIS_REPLY_ERROR) return Unavailable(w->str);
    return Status::Ok();
  }

 private:
  struct Task {
    std::shared_ptr<detail::Completion> completion;
    Clock::time_point deadline = kNoDeadline;  // post() + batch_deadline
    StorageOp op = StorageOp::kGet;
    std::vector<std::pair<std::size_t, StorageItem>> items;
  };
  struct Work {
    std::size_t outer = 0;
    StorageItem item;
    std::string key;
    std::string cmd;       // a put's SET up to its value's payload: RESP prefix + object header
    std::string cmd_tail;  // after the payload: "\r\n" and the EX arguments
    std::string ask_node;  // set after an ASK redirect
    Status last = Unavailable("not attempted");
    bool done = false;
    bool too_long = false;         // get: the value is longer than header + capacity (not read whole)
    std::uint64_t stored_len = 0;  // exists: the value's length (STRLEN)
    // delete: only while the value is still these bytes (kDeleteIfUnchanged); empty: unconditional DEL.
    std::string expect;
    // An attempt was sent and its reply never read (timeout, reset): the server may have applied it. A retried
    // delete that then finds nothing to delete is the first attempt's success, not a missing key.
    bool maybe_applied = false;
  };
  // A value that failed verification: its key and the bytes read, so that only those bytes are deleted.
  struct Quarantined {
    StorageKey key;
    std::string value;
  };
  // Deletes KEYS[1] only while it holds ARGV[1]: one atomic step on the server, so an object another instance
  // wrote since the failed read is left alone. Needs EVAL in the user's ACL (docs/storage.md); the script runs
  // with that user's rights, hence GETRANGE (which it has) rather than GET (which it need not have).
  static constexpr const char* kDeleteIfUnchanged =
      "if redis.call('GETRANGE', KEYS[1], 0, -1) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0";
  using Conns = std::unordered_map<std::string, ContextPtr>;

  std::string redis_key(const StorageKey& k) const {
    return options_.tenant_secret.empty() ? key_base_ + k.to_string()
                                          : key_base_ + format::keyed_object_name(options_, k);
  }

  // `limit`, capped by what is left until `deadline`; zero once it passed (a zero timeval would
  // mean "no timeout" to hiredis, so callers stop instead of passing it on).
  static std::chrono::milliseconds capped(std::chrono::milliseconds limit, Clock::time_point deadline) {
    if (deadline == kNoDeadline) return limit;
    const auto now = Clock::now();
    if (now >= deadline) return std::chrono::milliseconds(0);
    // Rounded up: a remaining 0.3 ms is still a 1 ms wait, not none.
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - now);
    return std::min(limit, left);
  }

  // Sets the socket's send/receive timeout to the command timeout capped by the deadline.
  // False when the deadline has passed (or the timeout cannot be set).
  bool arm(redisContext* c, Clock::time_point deadline) const {
    const auto t = capped(config_.command_timeout, deadline);
    return t.count() > 0 && redisSetTimeout(c, to_timeval(t)) == REDIS_OK;
  }

  enum class ReadOutcome { kOk, kError, kSilent, kTimedOut };

  // Reads one reply so that nothing waits past `deadline`. hiredis's redisGetReply waits up to a
  // socket timeout per recv(), so a server that trickles its reply (a byte every 500 ms) held a
  // get with a 2 s deadline for 40 s. Here every wait is a poll() bounded by what is left (and
  // by command_timeout: a server silent that long is taken as dead), each recv() then finds data
  // and returns at once, and the reply is parsed from what hiredis has buffered. Commands still
  // in hiredis's output buffer are written first, under a send timeout capped the same way.
  // kOk with *out set; kTimedOut once the deadline passed; kSilent when nothing arrived within
  // command_timeout; kError on a connection error (c->errstr). The connection cannot be reused
  // after anything but kOk (part of a reply may have been read).
  ReadOutcome read_reply(redisContext* c, void** out, Clock::time_point deadline) const {
    *out = nullptr;
    if (redisGetReplyFromReader(c, out) != REDIS_OK) return ReadOutcome::kError;
    int written = 0;
    while (*out == nullptr) {
      while (!written) {
        if (!arm(c, deadline)) return ReadOutcome::kTimedOut;
        if (redisBufferWrite(c, &written) != REDIS_OK)
          return Clock::now() >= deadline ? ReadOutcome::kTimedOut : ReadOutcome::kError;
      }
      const auto wait = capped(config_.command_timeout, deadline);
      if (wait.count() == 0) return ReadOutcome::kTimedOut;
      pollfd p{c->fd, POLLIN, 0};
      const int n = ::poll(&p, 1, static_cast<int>(wait.count()));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return ReadOutcome::kError;
      if (n == 0) return Clock::now() >= deadline ? ReadOutcome::kTimedOut : ReadOutcome::kSilent;
      if (redisBufferRead(c) != REDIS_OK) return ReadOutcome::kError;
      if (redisGetReplyFromReader(c, out) != REDIS_OK) return ReadOutcome::kError;
    }
    return ReadOutcome::kOk;
  }

  // Why read_reply() returned no reply, for messages.
  std::string read_failure(redisContext* c, ReadOutcome o) const {
    switch (o) {
      case ReadOutcome::kOk: return "ok";
      case ReadOutcome::kTimedOut: return "deadline passed";
      case ReadOutcome::kSilent:
        return fmt::format("no reply within command_timeout of {} ms", config_.command_timeout.count());
      case ReadOutcome::kError: return c->errstr[0] ? c->errstr : "connection lost";
    }
    return "connection lost";
  }

  // A command (redisCommand's format) and its reply, within `deadline`; the reply or the
  // failure's text. Used at create and for CLUSTER SLOTS and AUTH on new connections.
  Result<ReplyPtr> command_by(redisContext* c, Clock::time_point deadline, const char* format, ...) const {
    va_list ap;
    va_start(ap, format);
    const int rc = redisvAppendCommand(c, format, ap);
    va_end(ap);
    if (rc != REDIS_OK) return Unavailable(c->errstr[0] ? c->errstr : "out of memory");
    void* raw = nullptr;
    const ReadOutcome o = read_reply(c, &raw, deadline);
    if (o == ReadOutcome::kOk) return ReplyPtr(static_cast<redisReply*>(raw));
    if (o == ReadOutcome::kTimedOut) return TimedOut(read_failure(c, o));
    return Unavailable(read_failure(c, o));
  }

  // arm() only once less than command_timeout is left (until then the socket keeps its timeout).
  bool rearm(redisContext* c, Clock::time_point deadline) const {
    return capped(config_.command_timeout, deadline) >= config_.command_timeout || arm(c, deadline);
  }

  Result<ContextPtr> connect(const std::string& node, Clock::time_point deadline = kNoDeadline) const {
    KVTIER_ASSIGN_OR_RETURN(auto hp, parse_host_port(node));
    const auto connect_timeout = capped(config_.connect_timeout, deadline);
    if (connect_timeout.count() == 0) return TimedOut(fmt::format("connect {}: deadline passed", node));
    ContextPtr c(redisConnectWithTimeout(hp.first.c_str(), hp.second, to_timeval(connect_timeout)));
    if (!c) return Unavailable(fmt::format("connect {}: out of memory", node));
    if (c->err) return Unavailable(fmt::format("connect {}: {}", node, c->errstr));
    if (!arm(c.get(), deadline)) return Unavailable(fmt::format("set timeout on {}: {}", node, c->errstr));
    redisEnableKeepAlive(c.get());
    if (!config_.password.empty()) {
      auto got = config_.username.empty()
                     ? command_by(c.get(), deadline, "AUTH %b", config_.password.data(), config_.password.size())
                     : command_by(c.get(), deadline, "AUTH %b %b", config_.username.data(), config_.username.size(),
                                  config_.password.data(), config_.password.size());
      if (!got.ok()) return Status(got.status().code(), fmt::format("AUTH on {}: {}", node, got.status().message()));
      ReplyPtr r = std::move(got).value();
      if (r->type == REDIS_REPLY_ERROR)
        return FailedPrecondition(fmt::format("AUTH on {} refused: {}", node, std::string(r->str, r->len)));
    }
    return c;
  }

  Result<SlotMap> load_slots(redisContext* c, const std::string& node, Clock::time_point deadline) const {
    auto got = command_by(c, deadline, "CLUSTER SLOTS");
    if (!got.ok())
      return Status(got.status().code(), fmt::format("CLUSTER SLOTS on {}: {}", node, got.status().message()));
    ReplyPtr r = std::move(got).value();
    if (r->type == REDIS_REPLY_ERROR) {
      const std::string msg(r->str, r->len);
      // Refused for want of credentials or rights says nothing about clustering.
      if (is_auth_error(msg)) return FailedPrecondition(fmt::format("CLUSTER SLOTS on {} refused: {}", node, msg));
      return NotSupported(msg);
    }
    if (r->type != REDIS_REPLY_ARRAY)
      return DataLoss(
          fmt::format("CLUSTER SLOTS on {}: a reply of type {}, not an array (out of spec)", node, r->type));
    const std::string seed_host = parse_host_port(node).value().first;
    SlotMap map;
    // The reply is the server's (or whatever answers on its port): every field is checked before it indexes.
    auto bad = [&](std::size_t i, const std::string& why) {
      return DataLoss(fmt::format("CLUSTER SLOTS on {}: entry {} {}", node, i, why));
    };
    for (std::size_t i = 0; i < r->elements; ++i) {
      redisReply* e = r->element[i];
      if (e->type != REDIS_REPLY_ARRAY || e->elements < 3) continue;
      if (e->element[0]->type != REDIS_REPLY_INTEGER || e->element[1]->type != REDIS_REPLY_INTEGER)
        return bad(i, "has a slot range that is not two integers");
      const long long lo = e->element[0]->integer, hi = e->element[1]->integer;
      if (lo < 0 || hi >= kNumSlots || lo > hi)
        return bad(i, fmt::format("has slots {}..{}, not a range within 0..{}", lo, hi, kNumSlots - 1));
      redisReply* m = e->element[2];
      if (m->type != REDIS_REPLY_ARRAY || m->elements < 2) continue;
      // A null host (Redis 7's unknown preferred endpoint) means the node we asked, as "" and "?" do.
      const int host_type = m->element[0]->type;
      if ((host_type != REDIS_REPLY_STRING && host_type != REDIS_REPLY_NIL) ||
          m->element[1]->type != REDIS_REPLY_INTEGER)
        return bad(i, "has a node that is not (host, port)");
      const long long port = m->element[1]->integer;
      if (port < 1 || port > 65535) return bad(i, fmt::format("has port {}", port));
      std::string host = host_type == REDIS_REPLY_STRING ? std::string(m->element[0]->str, m->element[0]->len) : "";
      if (host.empty() || host == "?") host = seed_host;
      const std::string n = fmt::format("{}:{}", host, port);
      const int idx = map.node_index(n);
      if (idx > std::numeric_limits<std::int16_t>::max()) return bad(i, "names more nodes than a cluster has slots");
      for (long long s = lo; s <= hi; ++s) map.owner[s] = static_cast<std::int16_t>(idx);
    }
    if (map.nodes.empty()) return Unavailable(fmt::format("CLUSTER SLOTS on {}: no slots assigned", node));
    return map;
  }

  std::shared_ptr<const SlotMap> slot_map() const {
    std::lock_guard<std::mutex> lk(slots_mu_);
    return slots_;
  }

  std::string route(const std::string& key) const {
    if (!cluster_) return single_node_;
    auto map = slot_map();
    const int idx = map->owner[redis_key_slot(key)];
    if (idx < 0) return map->nodes.front();
    return map->nodes[idx];
  }

  void note_moved(int slot, const std::string& node) {
    std::lock_guard<std::mutex> lk(slots_mu_);
    auto copy = std::make_shared<SlotMap>(*slots_);
    if (slot >= 0 && slot < kNumSlots) copy->owner[slot] = static_cast<std::int16_t>(copy->node_index(node));
    slots_ = std::move(copy);
  }

  void refresh_slots(Conns& conns, Clock::time_point deadline) {
    std::vector<std::string> candidates = slot_map()->nodes;
    for (const auto& e : config_.endpoints) candidates.push_back(e);
    for (const auto& n : candidates) {
      if (Clock::now() >= deadline) return;  // the next operation refreshes again
      redisContext* c = get_conn(conns, n, nullptr, deadline);
      if (!c) continue;
      if (!arm(c, deadline)) {
        conns.erase(n);
        continue;
      }
      auto map = load_slots(c, n, deadline);
      if (map.ok()) {
        std::lock_guard<std::mutex> lk(slots_mu_);
        slots_ = std::make_shared<SlotMap>(std::move(map).value());
        return;
      }
      conns.erase(n);
    }
    log_line("slot map refresh failed on every known node");
  }

  redisContext* get_conn(Conns& conns, const std::string& node, Status* err, Clock::time_point deadline) {
    auto it = conns.find(node);
    if (it != conns.end()) return it->second.get();
    auto c = connect(node, deadline);
    if (!c.ok()) {
      if (err) *err = c.status();
      return nullptr;
    }
    return conns.emplace(node, std::move(c).value()).first->second.get();
  }

  // One-off synchronous command on the key's node (test hooks).
  Result<ReplyPtr> admin_command(const StorageKey& k, std::vector<std::string> args) {
    ScopedSigpipeBlock no_sigpipe;
    const std::string key = redis_key(k);
    std::string node = route(key);
    for (int attempt = 0; attempt < 3; ++attempt) {
      KVTIER_ASSIGN_OR_RETURN(ContextPtr c, connect(node));
      std::vector<const char*> argv{args[0].c_str(), key.c_str()};
      std::vector<std::size_t> lens{args[0].size(), key.size()};
      for (std::size_t i = 1; i < args.size(); ++i) {
        argv.push_back(args[i].data());
        lens.push_back(args[i].size());
      }
      ReplyPtr r(
          static_cast<redisReply*>(redisCommandArgv(c.get(), static_cast<int>(argv.size()), argv.data(), lens.data())));
      if (!r) return Unavailable(fmt::format("{} on {}: {}", args[0], node, c->errstr));
      int slot;
      std::string to;
      if (r->type == REDIS_REPLY_ERROR && parse_redirect(std::string_view(r->str, r->len), "MOVED", &slot, &to)) {
        if (!cluster_)  // no slot map in single mode (as for items: handle())
          return FailedPrecondition(
              fmt::format("{} on {}: a redirect to {}: a cluster node; open it with cluster=on", args[0], node, to));
        note_moved(slot, to);
        node = to;
        continue;
      }
      return r;
    }
    return Unavailable("too many redirects");
  }

  void worker() {
    ScopedSigpipeBlock no_sigpipe;  // for the thread's whole life
    Conns conns;
    for (;;) {
      Task task;
      {
        std::unique_lock<std::mutex> lk(queue_mu_);
        queue_cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      process(task, conns);
    }
  }

  void build_set(Work& w) {
    std::string value_prefix(header_size_, '\0');
    Status st = format::encode_header(options_, ns_digest_, w.item.key, w.item.buffer, w.item.bytes,
                                      static_cast<std::uint32_t>(header_size_),
                                      reinterpret_cast<std::byte*>(value_prefix.data()));
    if (!st.ok()) {
      w.done = true;
      w.last = st;
      return;
    }
    const std::uint64_t vlen = header_size_ + w.item.bytes;
    const std::string ttl = std::to_string(config_.ttl_seconds);
    const int argc = config_.ttl_seconds ? 5 : 3;
    w.cmd = fmt::format("*{}\r\n$3\r\nSET\r\n${}\r\n{}\r\n${}\r\n", argc, w.key.size(), w.key, vlen);
    w.cmd += value_prefix;
    w.cmd_tail = "\r\n";
    if (config_.ttl_seconds) w.cmd_tail += fmt::format("$2\r\nEX\r\n${}\r\n{}\r\n", ttl.size(), ttl);
  }

  // The most bytes a get of `capacity` may need: this backend's header and the payload. A value
  // that is longer is refused without being read whole (GETRANGE asks for one byte more, to see
  // that it is), so a foreign 512 MiB value under a key costs a get what a hit costs.
  std::uint64_t value_limit(std::uint64_t capacity) const {
    return header_size_ + std::min(capacity, caps().max_object_bytes);
  }

  // Queues the item's command. A put is written to the socket here instead: what hiredis
  // buffered before it first, then prefix, the caller's payload and tail with writev, so a large
  // value is not copied into a command string and again into hiredis's output buffer. False when
  // the connection failed (or timed out) while writing.
  bool append(redisContext* c, StorageOp op, Work& w, Clock::time_point deadline) {
    switch (op) {
      case StorageOp::kExists: return redisAppendCommand(c, "STRLEN %b", w.key.data(), w.key.size()) == REDIS_OK;
      case StorageOp::kGet: {
        // GETRANGE's end is inclusive: at most value_limit + 1 bytes come back.
        const std::string end = std::to_string(value_limit(w.item.bytes));
        return redisAppendCommand(c, "GETRANGE %b 0 %b", w.key.data(), w.key.size(), end.data(), end.size()) ==
               REDIS_OK;
      }
      case StorageOp::kDelete:
        if (!w.expect.empty())
          return redisAppendCommand(c, "EVAL %s 1 %b %b", kDeleteIfUnchanged, w.key.data(), w.key.size(),
                                    w.expect.data(), w.expect.size()) == REDIS_OK;
        return redisAppendCommand(c, "DEL %b", w.key.data(), w.key.size()) == REDIS_OK;
      case StorageOp::kPut: {
        // Each write waits at most one send timeout, re-armed to what is left of the deadline, so
        // a server that reads slowly cannot stretch the put past it.
        int done = 0;
        while (!done)
          if (!rearm(c, deadline) || redisBufferWrite(c, &done) != REDIS_OK) return false;
        iovec iov[3] = {{w.cmd.data(), w.cmd.size()},
                        {const_cast<void*>(static_cast<const void*>(w.item.buffer)), w.item.bytes},
                        {w.cmd_tail.data(), w.cmd_tail.size()}};
        int first = 0;
        while (first < 3) {
          if (!rearm(c, deadline)) return false;
          const ssize_t n = ::writev(c->fd, iov + first, 3 - first);
          if (n < 0 && errno == EINTR) continue;
          if (n <= 0) return false;  // EAGAIN: the socket's send timeout passed
          std::size_t left = static_cast<std::size_t>(n);
          while (first < 3 && left >= iov[first].iov_len) left -= iov[first++].iov_len;
          if (first < 3) {
            iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
            iov[first].iov_len -= left;
          }
        }
        return true;
      }
    }
    return false;
  }

  // Handles one reply. Returns true when the item should be retried after a backoff.
  bool handle(StorageOp op, Work& w, redisReply* r, bool* refresh, std::vector<Quarantined>* quarantine) {
    w.ask_node.clear();
    if (r->type == REDIS_REPLY_ERROR) {
      const std::string_view msg(r->str, r->len);
      int slot = -1;
      std::string node;
      const bool redirect = msg.starts_with("MOVED") || msg.starts_with("ASK");
      if (redirect && !cluster_) {
        // A cluster node (or a proxy) opened as a single server: there is no slot map to follow the redirect with.
        w.done = true;
        w.last = FailedPrecondition(fmt::format(
            "redis {} {}: the server answered '{}': it is a cluster node; open it with cluster=on (or auto)",
            storage_op_name(op), w.key, msg));
        return false;
      }
      if (parse_redirect(msg, "MOVED", &slot, &node)) {
        ++redirects_;
        note_moved(slot, node);
        *refresh = true;
        w.last = Unavailable(fmt::format("redirected: {}", msg));
        return false;
      }
      if (parse_redirect(msg, "ASK", &slot, &node)) {
        ++redirects_;
        w.ask_node = node;
        w.last = Unavailable(fmt::format("redirected: {}", msg));
        return false;
      }
      if (msg.starts_with("TRYAGAIN") || msg.starts_with("CLUSTERDOWN") || msg.starts_with("LOADING") ||
          msg.starts_with("MASTERDOWN") || msg.starts_with("BUSY")) {
        w.last = Unavailable(fmt::format("redis: {}", msg));
        return true;
      }
      w.done = true;
      if (msg.starts_with("NOAUTH") || msg.starts_with("WRONGPASS") || msg.starts_with("NOPERM"))
        w.last = FailedPrecondition(fmt::format("redis: {}", msg));
      else if (msg.starts_with("OOM"))
        w.last = ResourceExhausted(fmt::format("redis: {}", msg));
      else if (msg.starts_with("WRONGTYPE"))
        // Someone else's value of another type under this block's key: no object of ours (a put replaces it).
        w.last = op == StorageOp::kGet
                     ? DataLoss(fmt::format("key {}: the Redis key holds a value of another type, not an object",
                                            w.item.key.to_string()))
                     : NotFound(fmt::format("key {} not stored (the Redis key holds a value of another type)",
                                            w.item.key.to_string()));
      else
        // Any other refusal (a command unknown or disabled there, scripting off): the server's answer, not a
        // fault of kvtier's; not retried.
        w.last =
            FailedPrecondition(fmt::format("redis {} {}: the server refused: {}", storage_op_name(op), w.key, msg));
      return false;
    }
    w.done = true;
    switch (op) {
      case StorageOp::kPut:
        w.last = r->type == REDIS_REPLY_STATUS ? Status::Ok() : DataLoss("SET: reply out of spec");
        w.cmd.clear();
        w.cmd.shrink_to_fit();
        w.cmd_tail.clear();
        return false;
      case StorageOp::kDelete:
        w.last = r->type != REDIS_REPLY_INTEGER
                     ? DataLoss(w.expect.empty() ? "DEL: reply out of spec"
                                                 : "EVAL (delete if unchanged): reply out of spec")
                 : r->integer > 0 || w.maybe_applied ? Status::Ok()
                 : w.expect.empty()
                     ? NotFound(fmt::format("key {} not stored", w.item.key.to_string()))
                     : NotFound(fmt::format("key {} is gone or holds other bytes", w.item.key.to_string()));
        return false;
      case StorageOp::kExists:
        if (r->type != REDIS_REPLY_INTEGER || r->integer < 0) {
          w.last = DataLoss(fmt::format("STRLEN {}: reply out of spec", w.key));
        } else if (r->integer == 0) {
          w.last = NotFound(fmt::format("key {} not stored", w.item.key.to_string()));
        } else {
          w.last = Status::Ok();
          w.stored_len = static_cast<std::uint64_t>(r->integer);
          w.item.bytes = static_cast<std::uint64_t>(r->integer) > header_size_
                             ? static_cast<std::uint64_t>(r->integer) - header_size_
                             : 0;
        }
        return false;
      case StorageOp::kGet: {
        // GETRANGE answers a missing key with an empty string (an empty value is no object either).
        if (r->type == REDIS_REPLY_NIL || (r->type == REDIS_REPLY_STRING && r->len == 0)) {
          w.last = NotFound(fmt::format("key {} not stored", w.item.key.to_string()));
          return false;
        }
        if (r->type != REDIS_REPLY_STRING) {
          w.last = DataLoss("GETRANGE: reply out of spec");
          return false;
        }
        if (r->len > value_limit(w.item.bytes)) {
          // Not verified, so not quarantined: it may be a valid object for a larger destination.
          // process() asks for its length and words the refusal.
          w.too_long = true;
          return false;
        }
        Status st = verify_value(w, reinterpret_cast<const std::byte*>(r->str), r->len);
        if (format::is_auth_failure(st)) ++auth_failures_;
        if (st.code() == StatusCode::kDataLoss) {
          quarantine->push_back(Quarantined{w.item.key, std::string(r->str, r->len)});
          st = st.with_context("object quarantined (deleted)");
        }
        w.last = st;
        return false;
      }
    }
    return false;
  }

  Status verify_value(Work& w, const std::byte* data, std::size_t len) {
    auto h = format::decode_header(data, len, nullptr, options_.tenant_secret);
    if (!h.ok()) return DataLoss(h.status().message());
    KVTIER_RETURN_IF_ERROR(format::check_identity(*h, ns_digest_, options_.layout_fingerprint, w.item.key));
    KVTIER_RETURN_IF_ERROR(format::check_object_size(*h, len, true));
    KVTIER_RETURN_IF_ERROR(format::verify_object(data, *h, data + h->header_size, options_.tenant_secret));
    if (h->payload_bytes > w.item.bytes)
      return InvalidArgument(fmt::format("get {}: object of {} bytes > destination capacity {}", w.item.key.to_string(),
                                         h->payload_bytes, w.item.bytes));
    if (h->payload_bytes) std::memcpy(w.item.buffer, data + h->header_size, h->payload_bytes);
    w.item.bytes = h->payload_bytes;
    return Status::Ok();
  }

  void process(Task& task, Conns& conns) {
    const Clock::time_point start = Clock::now();
    const Clock::time_point deadline = std::min(start + config_.item_deadline, task.deadline);
    if (start >= deadline) {  // waited in the queue behind other sub-batches until the batch ran out of time
      for (auto& [i, item] : task.items)
        task.completion->complete(
            i, TimedOut(fmt::format("redis {} of key {}: batch deadline of {} ms passed before it started",
                                    storage_op_name(task.op), item.key.to_string(), config_.batch_deadline.count())));
      return;
    }
    std::vector<Work> work(task.items.size());
    for (std::size_t i = 0; i < work.size(); ++i) {
      work[i].outer = task.items[i].first;
      work[i].item = task.items[i].second;
      work[i].key = redis_key(work[i].item.key);
      if (task.op == StorageOp::kPut) build_set(work[i]);
    }
    std::vector<Quarantined> quarantine;
    run(task.op, work, conns, &quarantine, deadline);
    // Removed before the gets complete, so a caller that sees DataLoss and
    // looks again finds a miss (unless the delete itself failed: see below).
    if (!quarantine.empty()) remove_quarantined(quarantine, conns, deadline);
    if (task.op == StorageOp::kGet) refuse_too_long(work, conns, deadline);
    for (auto& w : work) {
      const std::uint64_t bytes = w.last.ok() ? w.item.bytes : 0;
      task.completion->complete(w.outer, w.last, bytes);
    }
  }

  // Runs the items of one op to completion: pipelined per node, redirects
  // followed, I/O errors retried on a fresh connection with backoff. Keys whose
  // value failed verification are appended to *quarantine (even when the
  // connection broke later in the same pipeline).
  // Nothing waits past `deadline`: connects, socket timeouts and backoff are capped by what is
  // left, and items still open when it passes complete with TimedOut.
  void run(StorageOp op, std::vector<Work>& work, Conns& conns, std::vector<Quarantined>* quarantine,
           Clock::time_point deadline) {
    auto backoff = config_.backoff_initial;
    std::uint32_t attempts = 0;
    for (std::uint32_t attempt = 0; attempt <= config_.max_retries && Clock::now() < deadline; ++attempt) {
      ++attempts;
      std::map<std::string, std::vector<Work*>> groups;
      for (auto& w : work)
        if (!w.done) groups[w.ask_node.empty() ? route(w.key) : w.ask_node].push_back(&w);
      if (groups.empty()) break;
      bool refresh = false, need_backoff = false;
      for (auto& [node, items] : groups) {
        Status err;
        redisContext* c = get_conn(conns, node, &err, deadline);
        if (c && !arm(c, deadline)) {
          for (Work* w : items)
            w->last = TimedOut(fmt::format("redis {} on {}: deadline passed", storage_op_name(op), node));
          continue;
        }
        if (!c) {
          if (err.code() == StatusCode::kFailedPrecondition) {
            for (Work* w : items) w->done = true;
          }
          for (Work* w : items) w->last = err;
          need_backoff = true;
          refresh = true;  // cluster: a failover may have moved the slots to another node
          continue;
        }
        std::vector<bool> asked(items.size());
        bool broken = false;
        for (std::size_t i = 0; i < items.size() && !broken; ++i) {
          asked[i] = !items[i]->ask_node.empty();
          if (asked[i]) redisAppendCommand(c, "ASKING");
          if (!append(c, op, *items[i], deadline)) {
            const Status st =
                Clock::now() >= deadline
                    ? TimedOut(fmt::format("redis {} on {}: deadline passed while writing", storage_op_name(op), node))
                    : Unavailable(fmt::format("redis {} on {}: write failed: {}", storage_op_name(op), node,
                                              c->errstr[0] ? c->errstr : std::strerror(errno)));
            for (Work* w : items)
              if (!w->done) w->last = st;
            broken = true;
          }
        }
        for (std::size_t i = 0; i < items.size() && !broken; ++i) {
          for (int part = asked[i] ? 0 : 1; part < 2; ++part) {
            void* raw = nullptr;
            const ReadOutcome got = read_reply(c, &raw, deadline);
            if (got != ReadOutcome::kOk) {
              const std::string what = read_failure(c, got);
              const Status st =
                  got == ReadOutcome::kTimedOut || Clock::now() >= deadline
                      ? TimedOut(fmt::format("redis {} on {}: deadline passed ({})", storage_op_name(op), node, what))
                      : Unavailable(fmt::format("redis {} on {}: {}", storage_op_name(op), node, what));
              for (std::size_t j = i; j < items.size(); ++j)
                if (!items[j]->done) {
                  items[j]->last = st;
                  items[j]->maybe_applied = true;
                }
              broken = true;  // replies still pending (or half read) on the connection: it cannot be reused
              break;
            }
            ReplyPtr r(static_cast<redisReply*>(raw));
            if (part == 0) continue;  // ASKING's +OK
            if (handle(op, *items[i], r.get(), &refresh, quarantine)) need_backoff = true;
          }
        }
        if (broken) {
          conns.erase(node);  // reconnect on the next attempt
          ++reconnects_;
          need_backoff = true;
          refresh = true;
        }
      }
      if (refresh && cluster_) refresh_slots(conns, deadline);
      if (need_backoff && attempt < config_.max_retries) {
        const auto pause = capped(backoff, deadline);
        if (pause.count() > 0) std::this_thread::sleep_for(pause);
        backoff = std::min(backoff * 2, config_.backoff_max);
      }
    }
    if (Clock::now() < deadline) return;
    for (auto& w : work)
      if (!w.done && w.last.code() != StatusCode::kTimedOut)
        w.last = TimedOut(fmt::format("redis {} of key {}: deadline passed after {} attempts (last: {})",
                                      storage_op_name(op), w.key, attempts, w.last.to_string()));
  }

  // Words the refusal of the gets whose value was longer than header + capacity, with the value's
  // length when a STRLEN (a small reply, routed and retried like an exists) gets it in time.
  void refuse_too_long(std::vector<Work>& work, Conns& conns, Clock::time_point deadline) {
    std::vector<Work> sizes;
    std::vector<Work*> refused;
    for (auto& w : work) {
      if (!w.too_long) continue;
      refused.push_back(&w);
      sizes.emplace_back();
      sizes.back().item.key = w.item.key;
      sizes.back().key = w.key;
    }
    if (refused.empty()) return;
    std::vector<Quarantined> unused;
    run(StorageOp::kExists, sizes, conns, &unused, deadline);
    for (std::size_t i = 0; i < refused.size(); ++i) {
      Work& w = *refused[i];
      const std::uint64_t limit = value_limit(w.item.bytes);
      // A length that fits means the value changed since the GETRANGE: then only the bound is known.
      const bool known = sizes[i].last.ok() && sizes[i].stored_len > limit;
      const std::string stored = known ? fmt::format("stored value of {} bytes", sizes[i].stored_len)
                                       : fmt::format("stored value (over {} bytes)", limit);
      w.last = InvalidArgument(fmt::format(
          "get {}: {} is longer than the {}-byte header plus the destination capacity of {} bytes; refused after "
          "reading at most {} bytes of it",
          w.item.key.to_string(), stored, header_size_, w.item.bytes, limit + 1));
    }
  }

  // Deletes objects that failed verification, through the same routing and
  // retries as a caller's delete: a dropped connection or a slot that moved
  // between the GET and the delete must not leave the bad object in the shared
  // pool. Each delete is conditional (kDeleteIfUnchanged): a good object that
  // another instance wrote between our read and the delete stays. Where the
  // server refuses EVAL (an ACL without it, scripting disabled) the delete falls
  // back to a plain DEL, which would remove such an object too (a miss, never
  // wrong bytes), and says so once. A delete that still fails is reported, not
  // counted: the object stays, and every later get verifies it again and
  // reports DataLoss.
  void remove_quarantined(std::vector<Quarantined>& bad, Conns& conns, Clock::time_point deadline) {
    std::vector<Work> dels(bad.size());
    for (std::size_t i = 0; i < bad.size(); ++i) {
      dels[i].item.key = bad[i].key;
      dels[i].key = redis_key(bad[i].key);
      if (!eval_refused_.load(std::memory_order_relaxed)) dels[i].expect = std::move(bad[i].value);
    }
    std::vector<Quarantined> unused;
    run(StorageOp::kDelete, dels, conns, &unused, deadline);
    // EVAL refused by the server: the same deletes as plain DELs, from now on for good.
    std::vector<std::size_t> refused;
    for (std::size_t i = 0; i < dels.size(); ++i) {
      const Work& d = dels[i];
      if (d.expect.empty() || d.last.code() != StatusCode::kFailedPrecondition) continue;
      if (!eval_refused_.exchange(true))
        log_line(
            fmt::format("the server refused EVAL ({}): objects that fail verification are deleted with a plain "
                        "DEL, which also removes one rewritten since the read (grant +eval: docs/storage.md)",
                        d.last.message()));
      refused.push_back(i);
    }
    if (!refused.empty()) {
      std::vector<Work> plain(refused.size());
      for (std::size_t j = 0; j < refused.size(); ++j) {
        plain[j].item.key = dels[refused[j]].item.key;
        plain[j].key = dels[refused[j]].key;
      }
      run(StorageOp::kDelete, plain, conns, &unused, deadline);
      for (std::size_t j = 0; j < refused.size(); ++j) dels[refused[j]].last = plain[j].last;
    }
    for (const Work& d : dels) {
      if (d.last.ok()) {
        ++quarantined_;
        log_line(fmt::format("deleted {}: failed verification", d.key));
      } else if (d.last.code() == StatusCode::kNotFound) {
        log_line(fmt::format("{} failed verification and is already gone or rewritten", d.key));
      } else {
        log_line(fmt::format("could not delete {} (failed verification): {}", d.key, d.last.to_string()));
      }
    }
  }

  RedisBackendConfig config_;
  StorageOptions options_;
  std::uint64_t ns_digest_ = 0;
  std::uint64_t header_size_ = 0;
  std::string key_base_;
  bool cluster_ = false;
  std::string single_node_;
  mutable std::mutex slots_mu_;
  std::shared_ptr<SlotMap> slots_;
  std::atomic<std::uint64_t> quarantined_{0};
  std::atomic<bool> eval_refused_{false};  // the server refused a conditional delete: plain DELs from then on
  std::atomic<std::uint64_t> auth_failures_{0};
  std::atomic<std::uint64_t> redirects_{0};
  std::atomic<std::uint64_t> reconnects_{0};
  RegionSet regions_;

  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

std::uint16_t redis_key_slot(std::string_view key) noexcept {
  const auto open = key.find('{');
  if (open != std::string_view::npos) {
    const auto close = key.find('}', open + 1);
    if (close != std::string_view::npos && close != open + 1) key = key.substr(open + 1, close - open - 1);
  }
  return crc16(key) & (kNumSlots - 1);
}

Result<std::pair<std::string, int>> parse_host_port(std::string_view endpoint) {
  const auto colon = endpoint.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == endpoint.size())
    return InvalidArgument(fmt::format("endpoint '{}' is not host:port", endpoint));
  int port = 0;
  for (char c : endpoint.substr(colon + 1)) {
    if (c < '0' || c > '9' || port > 65535) return InvalidArgument(fmt::format("bad port in '{}'", endpoint));
    port = port * 10 + (c - '0');
  }
  if (port <= 0 || port > 65535) return InvalidArgument(fmt::format("bad port in '{}'", endpoint));
  std::string host(endpoint.substr(0, colon));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return std::make_pair(host, port);
}

Result<std::unique_ptr<StorageBackend>> create_redis_backend(RedisBackendConfig config, StorageOptions options) {
  auto b = std::make_unique<RedisBackend>(std::move(config), std::move(options));
  KVTIER_RETURN_IF_ERROR(b->init());
  return std::unique_ptr<StorageBackend>(std::move(b));
}

}  // namespace kvtier::storage
