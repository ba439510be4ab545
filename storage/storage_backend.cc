#include "kvtier/backend/storage_backend.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <unordered_map>

#include "kvtier/core/config.h"
#include "kvtier/core/deadline.h"
#include "kvtier/core/enum_names.h"
#include "kvtier/storage/disk_backend.h"
#include "kvtier/storage/memory_backend.h"
#include "kvtier/storage/redis_backend.h"
#include "kvtier/storage/storage_config.h"

namespace kvtier::storage {

StorageKey StorageKey::from_u64(std::uint64_t hi, std::uint64_t lo, std::uint32_t rank) {
  StorageKey k;
  for (int i = 0; i < 8; ++i) {
    k.digest[i] = static_cast<std::uint8_t>(hi >> (56 - 8 * i));
    k.digest[8 + i] = static_cast<std::uint8_t>(lo >> (56 - 8 * i));
  }
  k.rank = rank;
  return k;
}

std::string StorageKey::to_string() const {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s(32, '0');
  for (int i = 0; i < 16; ++i) {
    s[2 * i] = kHex[digest[i] >> 4];
    s[2 * i + 1] = kHex[digest[i] & 15];
  }
  return fmt::format("{}-r{}", s, rank);
}

std::size_t StorageKeyHash::operator()(const StorageKey& k) const noexcept {
  std::uint64_t a, b;
  std::memcpy(&a, k.digest.data(), 8);
  std::memcpy(&b, k.digest.data() + 8, 8);
  return static_cast<std::size_t>(a ^ (b * 0x9e3779b97f4a7c15ULL) ^ (std::uint64_t{k.rank} << 17));
}

constexpr EnumName<StorageOp> kStorageOpEntries[] = {
    {StorageOp::kExists, "exists"},
    {StorageOp::kGet, "get"},
    {StorageOp::kPut, "put"},
    {StorageOp::kDelete, "delete"},
};
constexpr auto kStorageOpNames = enum_table("storage op", kStorageOpEntries);
std::string_view storage_op_name(StorageOp op) noexcept { return kStorageOpNames.name(op); }

namespace detail {

void Completion::complete(std::size_t i, Status status, std::uint64_t bytes) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (i >= results_.size() || done_[i]) return;
    done_[i] = true;
    results_[i].status = std::move(status);
    results_[i].bytes = bytes;
    if (remaining_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  }
  cv_.notify_all();
}

bool Completion::item_done(std::size_t i) const {
  std::lock_guard<std::mutex> lk(mu_);
  return i < done_.size() && done_[i];
}

ItemResult Completion::item(std::size_t i) const {
  std::lock_guard<std::mutex> lk(mu_);
  if (i >= results_.size()) return {OutOfRange(fmt::format("item {} >= batch size {}", i, results_.size())), 0};
  return results_[i];
}

std::vector<ItemResult> Completion::snapshot() const {
  std::lock_guard<std::mutex> lk(mu_);
  return results_;
}

bool Completion::wait_for(std::chrono::nanoseconds timeout) const {
  std::unique_lock<std::mutex> lk(mu_);
  return cv_.wait_until(lk, deadline_after(timeout), [&] { return remaining_.load(std::memory_order_acquire) == 0; });
}

}  // namespace detail

ItemResult StorageTicket::item(std::size_t i) const {
  if (c_ == nullptr)
    return {
        FailedPrecondition(fmt::format("item {} of an empty storage ticket (default-constructed or moved from)", i)),
        0};
  return c_->item(i);
}

StorageTicket StorageTicket::create(StorageOp op, std::size_t n) {
  StorageTicket t;
  t.c_ = std::make_shared<detail::Completion>(op, n);
  return t;
}

Status StorageTicket::wait(std::chrono::milliseconds timeout) const {
  if (!c_) return InvalidArgument("wait on an empty ticket");
  if (c_->wait_for(clamp_timeout(timeout))) return Status::Ok();
  return TimedOut(
      fmt::format("{} of {} items still pending after {} ms", c_->remaining(), c_->size(), timeout.count()));
}

Status StorageTicket::first_error() const {
  if (!c_) return InvalidArgument("first_error on an empty ticket");
  for (std::size_t i = 0; i < c_->size(); ++i) {
    ItemResult r = c_->item(i);
    if (!r.status.ok()) return r.status.with_context(fmt::format("item {}", i));
  }
  return Status::Ok();
}

Result<std::vector<ItemResult>> run_batch(StorageBackend& backend, StorageBatch batch,
                                          std::chrono::milliseconds timeout) {
  KVTIER_ASSIGN_OR_RETURN(StorageTicket t, backend.post(std::move(batch)));
  KVTIER_RETURN_IF_ERROR(t.wait(timeout));
  return t.results();
}

namespace {

// A spec parameter's number, at most `max` (named with the parameter: a value past it would wrap a 32-bit field
// or overflow a deadline's clock arithmetic into failures that name something else).
constexpr std::uint64_t kMaxRedisWaitMs = 86'400'000;

Result<std::uint64_t> bounded_param(std::string_view key, std::string_view value, std::uint64_t max,
                                    std::string_view why) {
  // A count or a time in whole units: digits only (a size's suffixes would make "5s" 5 and "1K" workers 1024).
  std::uint64_t n = 0;
  const auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), n);
  if (value.empty() || ec != std::errc() || ptr != value.data() + value.size())
    return InvalidArgument(
        fmt::format("parameter {}='{}' is not a whole number (at most {}: {})", key, value, max, why));
  if (n > max) return InvalidArgument(fmt::format("parameter {}={} is more than {} ({})", key, value, max, why));
  return n;
}

// A size parameter (capacity=64G): parse_size's forms, the error naming the parameter.
Result<std::uint64_t> size_param(std::string_view key, std::string_view value) {
  auto n = parse_size(value);
  if (!n.ok()) return InvalidArgument(fmt::format("parameter {}: {}", key, n.status().message()));
  return n;
}

// Splits "a?k=v&k2=v2" into the path and the parameters.
std::pair<std::string_view, std::vector<std::pair<std::string_view, std::string_view>>> split_query(
    std::string_view s) {
  std::vector<std::pair<std::string_view, std::string_view>> params;
  const auto q = s.find('?');
  if (q == std::string_view::npos) return {s, params};
  std::string_view rest = s.substr(q + 1);
  s = s.substr(0, q);
  while (!rest.empty()) {
    const auto amp = rest.find('&');
    std::string_view kv = rest.substr(0, amp);
    const auto eq = kv.find('=');
    params.emplace_back(kv.substr(0, eq), eq == std::string_view::npos ? "" : kv.substr(eq + 1));
    if (amp == std::string_view::npos) break;
    rest.remove_prefix(amp + 1);
  }
  return {s, params};
}

// A parameter given twice is refused: which of the two was meant is a guess either way (a spec assembled from
// a template and an override, say, would otherwise keep whichever came last without a word).
Status refuse_repeated_params(const std::vector<std::pair<std::string_view, std::string_view>>& params,
                              std::string_view kind, std::string_view shown_spec) {
  for (std::size_t i = 0; i < params.size(); ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (params[i].first == params[j].first)
        return InvalidArgument(
            fmt::format("{} parameter '{}' is given twice in '{}'", kind, params[i].first, shown_spec));
  return Status::Ok();
}

// The parameters every spec shares: tenant=<id>, secret_file=<path>. True when `k` was one.
Result<bool> apply_tenant_param(std::string_view k, std::string_view v, StorageOptions& options) {
  if (k == "tenant") {
    options.tenant = std::string(v);
    return true;
  }
  if (k == "secret_file") {
    KVTIER_ASSIGN_OR_RETURN(options.tenant_secret, read_tenant_secret_file(std::string(v)));
    return true;
  }
  return false;
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

Result<std::string> read_tenant_secret_file(const std::string& path) {
  // Links are followed (Kubernetes mounts a secret as a link into a ..data directory); what is checked below is the
  // file they lead to.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return NotFound(fmt::format("tenant secret file '{}': {}", path, std::strerror(errno)));
  struct stat sb {};
  std::string text;
  Status st = Status::Ok();
  if (::fstat(fd, &sb) != 0) {
    st = Unavailable(fmt::format("tenant secret file '{}': fstat: {}", path, std::strerror(errno)));
  } else if (!S_ISREG(sb.st_mode)) {
    st = FailedPrecondition(fmt::format("tenant secret file '{}' is not a regular file", path));
  } else if ((sb.st_mode & 077) != 0) {
    st = FailedPrecondition(
        fmt::format("tenant secret file '{}' has mode {:o}: group and others must have no access (chmod 600)", path,
                    sb.st_mode & 0777));
  } else if (sb.st_size > 4096) {
    st = InvalidArgument(fmt::format("tenant secret file '{}' is {} bytes: expected 64..128 hex digits", path,
                                     static_cast<long long>(sb.st_size)));
  } else {
    text.resize(static_cast<std::size_t>(sb.st_size));
    const ssize_t n = ::pread(fd, text.data(), text.size(), 0);
    if (n < 0)
      st = Unavailable(fmt::format("tenant secret file '{}': read: {}", path, std::strerror(errno)));
    else
      text.resize(static_cast<std::size_t>(n));
  }
  ::close(fd);
  KVTIER_RETURN_IF_ERROR(st);
  std::string_view hex = text;
  while (!hex.empty() && std::isspace(static_cast<unsigned char>(hex.front()))) hex.remove_prefix(1);
  while (!hex.empty() && std::isspace(static_cast<unsigned char>(hex.back()))) hex.remove_suffix(1);
  if (hex.size() % 2 != 0 || hex.size() < 64 || hex.size() > 128)
    return InvalidArgument(fmt::format(
        "tenant secret file '{}' holds {} characters: expected 64..128 hex digits (32..64 bytes)", path, hex.size()));
  std::string secret(hex.size() / 2, '\0');
  for (std::size_t i = 0; i < secret.size(); ++i) {
    const int hi = hex_value(hex[2 * i]), lo = hex_value(hex[2 * i + 1]);
    if (hi < 0 || lo < 0)
      return InvalidArgument(
          fmt::format("tenant secret file '{}': non-hex character at offset {}", path, 2 * i + (hi < 0 ? 0 : 1)));
    secret[i] = static_cast<char>(hi * 16 + lo);
  }
  return secret;
}

Status check_batch_buffers(const StorageBatch& batch) {
  switch (batch.op) {
    case StorageOp::kExists:
    case StorageOp::kDelete: return Status::Ok();
    case StorageOp::kGet:
    case StorageOp::kPut: break;
    default:  // the disk backend's I/O thread had no case for it: the batch never completed
      return InvalidArgument(
          fmt::format("unknown storage op {} (exists 0, get 1, put 2, delete 3)", static_cast<int>(batch.op)));
  }
  for (std::size_t i = 0; i < batch.items.size(); ++i)
    if (batch.items[i].buffer == nullptr && batch.items[i].bytes > 0)
      return InvalidArgument(
          fmt::format("{} item {}: null buffer for {} bytes", storage_op_name(batch.op), i, batch.items[i].bytes));
  if (batch.op == StorageOp::kPut && batch.items.size() > 1) {
    std::unordered_map<StorageKey, std::size_t, StorageKeyHash> first;
    first.reserve(batch.items.size());
    for (std::size_t i = 0; i < batch.items.size(); ++i)
      if (auto [it, fresh] = first.emplace(batch.items[i].key, i); !fresh)
        return InvalidArgument(
            fmt::format("put items {} and {} name one key {} (a batch's puts run at once: which "
                        "would stay is not defined)",
                        it->second, i, batch.items[i].key.to_string()));
  }
  return Status::Ok();
}

Result<std::unique_ptr<StorageBackend>> make_storage_backend(std::string_view spec, StorageOptions options) {
  return make_storage_backend(spec, std::move(options), StorageBackendDefaults{});
}

std::string redact_storage_spec(std::string_view spec) {
  // Any scheme:// (a mistyped one too: its credentials are as secret).
  const std::size_t scheme = spec.find("://");
  if (scheme == std::string_view::npos) return std::string(spec);
  const std::size_t begin = scheme + 3, at = spec.rfind('@');
  if (at == std::string_view::npos || at < begin) return std::string(spec);
  const std::string_view cred = spec.substr(begin, at - begin);
  const std::size_t colon = cred.find(':');
  const std::string user = colon == std::string_view::npos ? "" : std::string(cred.substr(0, colon)) + ":";
  return fmt::format("{}{}***{}", spec.substr(0, begin), user, spec.substr(at));
}

namespace {

// A redis:// userinfo part, percent-decoded; `what` names it, the value is never shown (it may be a password).
Result<std::string> decode_userinfo(std::string_view s, std::string_view what) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      out += s[i];
      continue;
    }
    auto hex = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    const int hi = i + 2 < s.size() ? hex(s[i + 1]) : -1;
    const int lo = i + 2 < s.size() ? hex(s[i + 2]) : -1;
    if (hi < 0 || lo < 0)
      return InvalidArgument(
          fmt::format("redis spec: the {} holds a '%' at offset {} that is not followed by two hex "
                      "digits (write a '%' as %25)",
                      what, i));
    out += static_cast<char>(hi * 16 + lo);
    i += 2;
  }
  return out;
}

}  // namespace

Result<std::unique_ptr<StorageBackend>> make_storage_backend(std::string_view spec, StorageOptions options,
                                                             const StorageBackendDefaults& defaults) {
  const std::string shown_spec = redact_storage_spec(spec);
  // The paths, hosts and names of a spec reach C APIs that stop at a NUL byte: "disk:/a\0/b" would open /a.
  if (const std::size_t nul = spec.find('\0'); nul != std::string_view::npos) {
    std::string shown;
    for (const char ch : std::string_view(shown_spec).substr(0, 200)) {
      if (ch == '\0')
        shown += "\\0";
      else
        shown += ch;
    }
    return InvalidArgument(fmt::format("storage spec '{}' holds a NUL byte at offset {}", shown, nul));
  }
  if (spec.starts_with("disk:")) {
    auto [path, params] = split_query(spec.substr(5));
    KVTIER_RETURN_IF_ERROR(refuse_repeated_params(params, "disk", spec));
    DiskBackendConfig c = defaults.disk;
    c.root = std::string(path);
    for (auto [k, v] : params) {
      if (k == "capacity") {
        KVTIER_ASSIGN_OR_RETURN(c.capacity_bytes, size_param(k, v));
      } else if (k == "durability") {
        if (v == "process")
          c.durability = Durability::kProcessCrash;
        else if (v == "power")
          c.durability = Durability::kPowerLoss;
        else
          return InvalidArgument(fmt::format("durability '{}' is not process|power", v));
      } else if (k == "direct") {
        if (v == "auto")
          c.direct_io = DirectIo::kAuto;
        else if (v == "on")
          c.direct_io = DirectIo::kOn;
        else if (v == "off")
          c.direct_io = DirectIo::kOff;
        else
          return InvalidArgument(fmt::format("direct '{}' is not auto|on|off", v));
      } else if (k == "qd") {
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t qd, bounded_param(k, v, 4096, "items in flight on the io_uring ring"));
        c.queue_depth = static_cast<std::uint32_t>(qd);
      } else {
        KVTIER_ASSIGN_OR_RETURN(bool tenant_param, apply_tenant_param(k, v, options));
        if (!tenant_param) return InvalidArgument(fmt::format("unknown disk parameter '{}' in '{}'", k, spec));
      }
    }
    return create_disk_backend(std::move(c), std::move(options));
  }
  if (spec.starts_with("redis://")) {
    auto [rest, params] = split_query(spec.substr(8));
    // A '?' in the credentials cut the spec there: the rest of the password is in a parameter, which no message
    // may show (a parameter never holds '@').
    for (auto [k, v] : params)
      if (k.find('@') != std::string_view::npos || v.find('@') != std::string_view::npos)
        return InvalidArgument(
            "redis spec (not shown: it holds credentials): a parameter holds '@': a '?' in the user name or "
            "password must be written %3F");
    KVTIER_RETURN_IF_ERROR(refuse_repeated_params(params, "redis", shown_spec));
    RedisBackendConfig c = defaults.redis;
    c.endpoints.clear();
    const auto at = rest.rfind('@');
    if (at != std::string_view::npos) {
      std::string_view cred = rest.substr(0, at);
      const auto colon = cred.find(':');
      if (colon == std::string_view::npos) {
        KVTIER_ASSIGN_OR_RETURN(c.password, decode_userinfo(cred, "password"));
      } else {
        KVTIER_ASSIGN_OR_RETURN(c.username, decode_userinfo(cred.substr(0, colon), "user name"));
        KVTIER_ASSIGN_OR_RETURN(c.password, decode_userinfo(cred.substr(colon + 1), "password"));
      }
      rest = rest.substr(at + 1);
    }
    while (!rest.empty()) {
      const auto comma = rest.find(',');
      c.endpoints.emplace_back(rest.substr(0, comma));
      if (comma == std::string_view::npos) break;
      rest.remove_prefix(comma + 1);
    }
    for (auto [k, v] : params) {
      if (k == "cluster") {
        if (v == "auto")
          c.mode = RedisMode::kAuto;
        else if (v == "on" || v == "1")
          c.mode = RedisMode::kCluster;
        else if (v == "off" || v == "0")
          c.mode = RedisMode::kSingle;
        else
          return InvalidArgument(fmt::format("cluster '{}' is not auto|on|off", v));
      } else if (k == "prefix") {
        c.key_prefix = std::string(v);
      } else if (k == "timeout_ms" || k == "item_deadline_ms" || k == "batch_deadline_ms") {
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t ms, bounded_param(k, v, kMaxRedisWaitMs, "milliseconds, a day"));
        (k == "timeout_ms"         ? c.command_timeout
         : k == "item_deadline_ms" ? c.item_deadline
                                   : c.batch_deadline) = std::chrono::milliseconds(ms);
      } else if (k == "workers") {
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t n, bounded_param(k, v, 256, "connections per endpoint"));
        c.workers = static_cast<std::uint32_t>(n);
      } else if (k == "ttl") {
        KVTIER_ASSIGN_OR_RETURN(c.ttl_seconds, bounded_param(k, v, 2147483647, "seconds Redis accepts for EX"));
      } else {
        KVTIER_ASSIGN_OR_RETURN(bool tenant_param, apply_tenant_param(k, v, options));
        if (!tenant_param) return InvalidArgument(fmt::format("unknown redis parameter '{}' in '{}'", k, shown_spec));
      }
    }
    return create_redis_backend(std::move(c), std::move(options));
  }
  if (spec.starts_with("memory:")) {
    auto [rest, params] = split_query(spec.substr(7));
    if (!rest.empty())
      return InvalidArgument(
          fmt::format("memory spec '{}': nothing goes between 'memory:' and '?' (got '{}')", spec, rest));
    KVTIER_RETURN_IF_ERROR(refuse_repeated_params(params, "memory", spec));
    MemoryBackendConfig c;
    for (auto [k, v] : params) {
      if (k == "capacity") {
        KVTIER_ASSIGN_OR_RETURN(c.capacity_bytes, size_param(k, v));
      } else if (k == "evict") {
        if (v == "on" || v == "1")
          c.evict = true;
        else if (v == "off" || v == "0")
          c.evict = false;
        else
          return InvalidArgument(fmt::format("evict '{}' is not on|off", v));
      } else if (k == "threads") {
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t n, bounded_param(k, v, kMaxMemoryBackendThreads, "copy threads"));
        c.threads = static_cast<unsigned>(n);
      } else {
        KVTIER_ASSIGN_OR_RETURN(bool tenant_param, apply_tenant_param(k, v, options));
        if (!tenant_param) return InvalidArgument(fmt::format("unknown memory parameter '{}' in '{}'", k, spec));
      }
    }
    return create_memory_backend(c, std::move(options));
  }
  return InvalidArgument(fmt::format(
      "storage spec '{}' is neither disk:<dir>, redis://host:port nor memory:?capacity=<bytes>", shown_spec));
}

}  // namespace kvtier::storage
