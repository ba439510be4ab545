// Redis storage backend (hiredis): a shared tier that many inference
// instances read and write, on one Redis server or a Redis Cluster.
//
// Keys: "<prefix>:<ns digest>-<layout fingerprint>:<key>-r<rank>", value =
// object header + payload (object_format.h), verified on every get. With a tenant
// (StorageOptions::tenant) "<prefix>:<tenant>:<ns digest>-<layout fingerprint>:<key>-r<rank>", and
// with a tenant secret "<prefix>:<tenant>:<32 hex digits of a keyed hash>", which names nothing
// (docs/storage.md, ACL users restricted to "~<prefix>:<tenant>:*"). Commands sent: GETRANGE
// (get), SET, DEL, STRLEN (exists, and the length of a value a get refused), PING (create, single
// mode), CLUSTER SLOTS and ASKING (cluster), AUTH. Keys are
// spread over cluster slots by their digest (no hash tags), so a batch fans
// out over every master; capacity and eviction are the server's (maxmemory +
// allkeys-lru recommended; ttl_seconds adds an expiry to every put).
//
// A get reads at most the backend's header + the destination's capacity + 1 bytes of the value
// (GETRANGE 0..header + capacity): a longer value (a valid object for a larger destination, or a
// foreign value anyone with write access to the prefix SET there, up to Redis's 512 MiB) is
// refused with InvalidArgument naming its length, after a reply no larger than a hit's, and left
// in place (it was not verified, so it is not quarantined). A missing key and an empty value are
// both NotFound.
//
// Batches are split into sub-batches of at most max_batch_items, handled by a
// pool of worker threads; each worker pipelines its sub-batch per node (all
// commands written, then all replies read). Cluster routing is done here
// (hiredis has no cluster support): CRC16 key slots with hash tags, the slot
// map from CLUSTER SLOTS, MOVED -> refresh the map and retry, ASK -> ASKING +
// retry on the named node, TRYAGAIN/CLUSTERDOWN/LOADING and I/O errors ->
// reconnect and retry with exponential backoff, up to max_retries; then the
// item completes with Unavailable. Retries, reconnects and backoff all stay
// inside the item's deadline (item_deadline from its sub-batch's start,
// batch_deadline from post()): connects and socket timeouts are capped by
// what is left, and an item out of time completes with TimedOut. A reply is
// read with poll() against the deadline, so one that keeps arriving slowly is
// bounded as a whole, not per socket read. A hung
// server (accepting connections, never answering) therefore costs a caller
// at most the deadline, not (max_retries + 1) x command_timeout. Every connection authenticates (AUTH
// [username] password) when a password is set.
//
// A get that fails verification deletes the key (quarantine = removal: the
// shared pool must not keep serving it) and completes with DataLoss, after
// the delete, which is routed and retried like any delete. A delete that
// still fails is logged and not counted in stats().quarantined; the object
// stays, and every later get verifies it again (DataLoss, never its bytes).
// Not zero-copy for gets: values pass through hiredis's reply buffer
// (caps().zero_copy_host is false). A put's payload is written from the
// caller's buffer to the socket (writev), without an intermediate copy.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvtier/backend/storage_backend.h"

namespace kvtier::storage {

enum class RedisMode : std::uint8_t { kAuto, kSingle, kCluster };

// Limits of RedisBackendConfig's counts (create() refuses values outside them; the storage.redis.* knobs too).
inline constexpr std::uint32_t kMaxRedisWorkers = 256;
inline constexpr std::uint32_t kMaxRedisBatchItems = 65536;

struct RedisBackendConfig {
  std::vector<std::string> endpoints;  // "host:port": the server, or cluster seed nodes
  std::string username;                // optional (Redis 6 ACL user)
  std::string password;                // empty: no AUTH
  std::string key_prefix = "kvtier";
  RedisMode mode = RedisMode::kAuto;  // kAuto asks CLUSTER SLOTS
  std::chrono::milliseconds connect_timeout{1000};
  std::chrono::milliseconds command_timeout{5000};
  std::uint32_t workers = 2;
  std::uint32_t max_batch_items = 64;
  std::uint32_t max_retries = 4;
  std::chrono::milliseconds backoff_initial{5};
  std::chrono::milliseconds backoff_max{500};
  std::uint64_t ttl_seconds = 0;  // 0: no expiry
  // Overall bounds a caller sees, across retries, reconnects and backoff (the per-call timeouts
  // above only bound one connect or one reply): every item completes within item_deadline of the
  // moment a worker starts its sub-batch, and every item of a batch within batch_deadline of
  // post(). An item out of time completes with TimedOut, which the cache manager takes as a miss.
  std::chrono::milliseconds item_deadline{5000};
  std::chrono::milliseconds batch_deadline{10000};
  // Bound of create_redis_backend() as a whole: connects, AUTH, PING / CLUSTER SLOTS, retries and
  // backoff over every seed endpoint (each wait is also capped by connect_timeout /
  // command_timeout). Without it a stopped server cost (max_retries + 1) x command_timeout per seed.
  std::chrono::milliseconds create_deadline{10000};
};

// Connects to the first reachable endpoint, authenticates and (cluster mode)
// loads the slot map. Blocking, for at most create_deadline. A connection that
// fails or resets is retried on every endpoint, up to max_retries more rounds
// with backoff. Unavailable when no endpoint answers in time, FailedPrecondition when authentication is
// refused, NotSupported when mode is kCluster and the server is no cluster
// (kAuto then uses it as a single server; a reset never makes kAuto do so).
Result<std::unique_ptr<StorageBackend>> create_redis_backend(RedisBackendConfig config, StorageOptions options);

// Redis Cluster key slot (CRC16/XMODEM mod 16384, with {hash tag} rules).
std::uint16_t redis_key_slot(std::string_view key) noexcept;

// "host:port" -> (host, port); InvalidArgument on malformed input.
Result<std::pair<std::string, int>> parse_host_port(std::string_view endpoint);

}  // namespace kvtier::storage
