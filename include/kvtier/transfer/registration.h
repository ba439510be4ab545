// Registration of the KV caches a TransferManager moves between: the device
// cache (one tensor per (layer, role), block-major) and the pinned host cache.
//
// Two ways in:
//   - typed: a BlockSpace of kind kDevice built from a KvLayout and the base
//     pointer (and stride) of each (layer, role) plane (BlockSpace::from_planes
//     / layer_first), plus a HostCacheSpec;
//   - the name map of FastDeploy's CacheTransferManager: FastDeploy names its tensors
//       key_caches_{layer}_rank{r}.device{d}, value_caches_…,
//       key_cache_scales_…, value_cache_scales_…, indexer_caches_…
//     device_space_from_name_map() checks that every (layer, role) of the
//     layout has its tensor, with block count and per-block size matching
//     the layout, and that no tensor of this rank/device is left out (a draft
//     layer or a scale tensor the layout does not list is an error, not a
//     tensor silently never swapped). Errors name the tensor.
//
// Device identity: `device_label` is only the {d} in the names. kvtier never
// selects a device with it; the Device object (its process-visible ordinal,
// correct under CUDA_VISIBLE_DEVICES) decides where copies run.
//
// Thread-safety: free functions on values; no shared state.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvtier/backend/device.h"
#include "kvtier/core/layout.h"
#include "kvtier/core/status.h"

namespace kvtier {

// How the host tier is provided.
struct HostCacheSpec {
  // Caller-owned memory, already pinned (cudaHostAlloc / registered), kind
  // kPinnedHost, same layout as the device space. kvtier never frees it; it
  // must stay valid until TransferManager::shutdown() returned.
  std::optional<BlockSpace> space;

  // Otherwise kvtier allocates `num_blocks` blocks of pinned memory itself.
  std::uint64_t num_blocks = 0;
  enum class Arrangement : std::uint8_t {
    kLayerFirst,  // one region per (layer, role): FastDeploy's CacheTransferManager's layout
    kPageFirst,   // one page per block holding every layer and role (storage-friendly)
  };
  Arrangement arrangement = Arrangement::kLayerFirst;
  std::uint64_t page_alignment = 4096;  // kPageFirst only
  PinnedOptions pinned;
  // Fill kvtier-allocated host memory with this byte (-1: leave it).
  int fill_byte = -1;
};

struct KvCacheRegistration {
  BlockSpace device;  // kind kDevice; its device_ordinal must equal Device::ordinal()
  HostCacheSpec host;
};

// One tensor of the name map of FastDeploy's CacheTransferManager (an engine's
// KV tensor, e.g. from DLPack).
// dim 0 is the block index; each block (dims 1..) must be contiguous.
struct TensorDesc {
  void* data = nullptr;
  std::vector<std::int64_t> shape;
  DType dtype = DType::kBf16;
  // Bytes between consecutive blocks; 0 = contiguous (product of shape[1:] x dtype bytes).
  std::uint64_t block_stride_bytes = 0;
  // Element strides of every dimension (DLPack's); empty = C-contiguous.
  // When given they are checked: dims 1.. C-contiguous, strides[0] >= the
  // block's elements, and strides[0] decides the block stride.
  std::vector<std::int64_t> strides;
  // Ordinal of the device holding the tensor; -1 = not known (not checked).
  int device_ordinal = -1;
};

// The layout an engine's tensor map implies: layers 0..L-1 in order, each
// with key_caches (kKey, or kLatent when the map has no value_caches at all:
// MLA), value_caches, key/value_cache_scales and indexer_caches when present;
// block bytes and dtypes from the tensors (uint8 tensors of fp8 caches stay
// uint8). Layers at or above `num_model_layers` are draft (MTP) layers.
// Errors name the tensor: missing key_caches of a layer, a layer with only
// some of the roles other layers have, shapes that are not [num_blocks, ...].
Result<KvLayout> layout_from_name_map(const std::map<std::string, TensorDesc>& tensors, std::uint32_t num_model_layers,
                                      int rank, int device_label, std::uint32_t block_tokens);

// "key_caches_3_rank0.device1". Role kLatent uses key_caches (MLA keeps its
// latent there); kOther uses `other_name` as the prefix.
std::string seed_tensor_name(Role role, std::string_view other_name, std::uint32_t layer, int rank, int device_label);

// Builds and validates the device BlockSpace from the tensor map of FastDeploy's
// CacheTransferManager.
// `device_ordinal` is Device::ordinal() of the device that owns the tensors.
Result<BlockSpace> device_space_from_name_map(const std::map<std::string, TensorDesc>& tensors, const KvLayout& layout,
                                              int rank, int device_label, int device_ordinal);

// Builds the host BlockSpace from the host pointer map of FastDeploy's
// CacheTransferManager (one pinned region per (layer, role), block b at
// ptr + b * block_bytes).
Result<BlockSpace> host_space_from_name_map(const std::map<std::string, void*>& pointers, const KvLayout& layout,
                                            std::uint64_t num_host_blocks, int rank, int device_label,
                                            int device_ordinal);

// Both at once: the device space from `device_tensors`; the host tier from
// `host_pointers` when non-null (caller-owned pinned regions), else allocated
// by kvtier with `num_host_blocks` blocks (layer-first, like FastDeploy's
// CacheTransferManager).
Result<KvCacheRegistration> registration_from_name_map(const std::map<std::string, TensorDesc>& device_tensors,
                                                       const std::map<std::string, void*>* host_pointers,
                                                       std::uint64_t num_host_blocks, const KvLayout& layout, int rank,
                                                       int device_label, int device_ordinal);

}  // namespace kvtier
