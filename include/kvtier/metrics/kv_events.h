// KV cache events in vLLM's schema (vllm/distributed/kv_events.py), so that
// routers that consume vLLM's events (llm-d, Dynamo, Mooncake's Conductor)
// can follow a kvtier cache.
//
// BlockStored: blocks that became cached in a medium (a chain: each block's
// parent is the previous one, the first block's parent is parent_block_hash,
// absent at the root). BlockRemoved: blocks no longer cached in a medium.
// AllBlocksCleared: nothing is cached any more. Block hashes are kvtier's
// 128-bit BlockKeys as 16 bytes (hi then lo, big-endian): a msgpack bin, which
// vLLM's ExternalBlockHash (bytes | int) accepts.
//
// Wire format, two encodings (EventEncoding), both msgspec's encoding of vLLM's tagged structs:
//   EventBatch = [ts: float64, events: [event...], data_parallel_rank|nil]   (array_like in every vLLM release)
// kMap (the default), as vLLM 0.34 writes them (KVCacheEvent is tag=True, omit_defaults, not array_like):
//   BlockStored = {"type": "BlockStored", "block_hashes": [hash...], "parent_block_hash": parent|nil,
//                  "token_ids": [token_id...], "block_size": n, "lora_id": id|nil, "medium": m|nil,
//                  "lora_name": nil[, "locality": "LOCAL"|"REMOTE"]}
//   BlockRemoved = {"type": "BlockRemoved", "block_hashes": [hash...], "medium": m|nil[, "locality": ...]}
//   AllBlocksCleared = {"type": "AllBlocksCleared"}
//   Media are vLLM's: "GPU", "CPU", and "STORAGE" for both storage media, told apart by "locality" (LOCAL
//   for kDisk, REMOTE for kRemote). Read back, a STORAGE event whose locality is absent, nil or another string
//   is kDisk.
// kArray, the array_like events of earlier vLLM releases (and routers written for them):
//   BlockStored = ["BlockStored", [hash...], parent|nil, [token_id...], block_size, lora_id|nil, medium|nil]
//   BlockRemoved = ["BlockRemoved", [hash...], medium|nil]
//   AllBlocksCleared = ["AllBlocksCleared"]
//   Media by medium_name(): "GPU", "CPU", "DISK", "REMOTE".
// decode_msgpack() reads both (per event), skips the map fields it does not keep (vLLM's group_idx, extra_keys,
// ...), and takes integer block hashes of all 64 bits (vLLM's default) as BlockHash{0, hash}.
// The ZMQ publisher (zmq_publisher.h) sends each batch as frames (topic, seq as 8 bytes big-endian, payload).
//
// Thread-safety: values; the functions are pure.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "kvtier/core/status.h"

namespace kvtier::metrics {

enum class Medium : std::uint8_t { kGpu, kCpu, kDisk, kRemote };
std::string_view medium_name(Medium m) noexcept;  // "GPU", "CPU", "DISK", "REMOTE"
// Also takes vLLM's "STORAGE" (local storage: kDisk).
Result<Medium> parse_medium(std::string_view name);

enum class EventEncoding : std::uint8_t { kMap, kArray };        // see the wire format above
std::string_view event_encoding_name(EventEncoding e) noexcept;  // "map", "array"
Result<EventEncoding> parse_event_encoding(std::string_view name);

struct BlockHash {
  std::uint64_t hi = 0, lo = 0;
  friend bool operator==(const BlockHash&, const BlockHash&) = default;
  friend auto operator<=>(const BlockHash&, const BlockHash&) = default;
};

struct BlockStored {
  std::vector<BlockHash> block_hashes;
  std::optional<BlockHash> parent_block_hash;
  std::vector<std::int64_t> token_ids;  // empty when the producer holds keys only (the cache manager)
  std::uint32_t block_size = 0;         // tokens per block
  std::optional<std::int64_t> lora_id;
  std::optional<Medium> medium;
  friend bool operator==(const BlockStored&, const BlockStored&) = default;
};

struct BlockRemoved {
  std::vector<BlockHash> block_hashes;
  std::optional<Medium> medium;
  friend bool operator==(const BlockRemoved&, const BlockRemoved&) = default;
};

struct AllBlocksCleared {
  friend bool operator==(const AllBlocksCleared&, const AllBlocksCleared&) = default;
};

using KvEvent = std::variant<BlockStored, BlockRemoved, AllBlocksCleared>;

struct EventBatch {
  double ts = 0;  // seconds since the Unix epoch
  std::vector<KvEvent> events;
  std::optional<std::int64_t> data_parallel_rank;
  friend bool operator==(const EventBatch&, const EventBatch&) = default;
};

// msgpack bytes of a batch, as vLLM's msgspec encoder writes them (kMap: vLLM 0.34's encoding).
std::string encode_msgpack(const EventBatch& batch, EventEncoding encoding = EventEncoding::kMap);
// The inverse, for subscribers and tests. DataLoss naming the offset for bytes that are not such a batch.
Result<EventBatch> decode_msgpack(std::string_view bytes);

// Seconds since the Unix epoch, for EventBatch::ts.
double unix_time_now() noexcept;

}  // namespace kvtier::metrics
