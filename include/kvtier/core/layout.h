// KV layout description: what a block is made of (KvLayout) and where blocks
// live in one memory (BlockSpace).
//
// A KvLayout lists, per layer, the roles (key, value, fp8 scales, MLA latent,
// indexer, any other side tensor) with their dtype and bytes per block. It
// holds no pointers and is shared by allocation, copies and storage.
//
// A BlockSpace places the blocks of a KvLayout in one memory (device, pinned
// host): for every (layer, role) a Plane {base, stride}; block b of that
// (layer, role) occupies [base + b*stride, base + b*stride + block_bytes).
// This one description covers:
//   - device tensors per (layer, role), block-major: FastDeploy's
//     [num_blocks, kv_heads, block_tokens, head_dim] (HND inside a block) or
//     NHD [num_blocks, block_tokens, kv_heads, head_dim]; K/V interleaved
//     [num_blocks, 2, ...] is stride = 2 * block_bytes;
//   - host layer-first: one region per (layer, role) (FastDeploy's
//     CacheTransferManager's layout);
//   - host page-first (block-first): one contiguous page per block holding
//     every layer and role, the unit that storage tiers move.
// The in-block token order (HND/NHD) is metadata: copies move a block's bytes
// unchanged, so host and storage keep the device's order; it is part of the
// layout fingerprint so that mismatched engines never share stored blocks.
//
// Thread-safety: both types are immutable values after creation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kvtier/core/status.h"

namespace kvtier {

// Element types of KV tensors. kvtier moves bytes: the type only sets the element size (and so the
// alignment a tensor's address needs) and is part of the layout's fingerprint. Values are stable
// (they are hashed into fingerprints): new types are appended. kFp8E4M3 is the "FN" variant
// (finite, NaN only) that engines use; the other fp8 encodings have their own names.
enum class DType : std::uint8_t {
  kBf16,
  kFp16,
  kFp32,
  kFp8E4M3,
  kFp8E5M2,
  kInt8,
  kUint8,
  kInt16,
  kUint16,
  kInt32,
  kUint32,
  kInt64,
  kUint64,
  kFp64,
  kBool,
  kComplex64,
  kComplex128,
  kFp8E4M3Fnuz,
  kFp8E5M2Fnuz,
  kFp8E8M0,
  kFp8E3M4,
  kFp8E4M3Ieee,
  kFp8E4M3B11Fnuz,
};
// Every DType, in enum order (parsers and tests iterate over it).
inline constexpr DType kAllDTypes[] = {
    DType::kBf16,      DType::kFp16,        DType::kFp32,          DType::kFp8E4M3,     DType::kFp8E5M2,
    DType::kInt8,      DType::kUint8,       DType::kInt16,         DType::kUint16,      DType::kInt32,
    DType::kUint32,    DType::kInt64,       DType::kUint64,        DType::kFp64,        DType::kBool,
    DType::kComplex64, DType::kComplex128,  DType::kFp8E4M3Fnuz,   DType::kFp8E5M2Fnuz, DType::kFp8E8M0,
    DType::kFp8E3M4,   DType::kFp8E4M3Ieee, DType::kFp8E4M3B11Fnuz};
std::uint32_t dtype_bytes(DType dtype) noexcept;
std::string_view dtype_name(DType dtype) noexcept;
// Accepts dtype_name()'s names and the usual aliases (bfloat16, float16, float32, float64, fp8).
Result<DType> parse_dtype(std::string_view name);
// True for the one-byte float encodings (all fp8 variants).
bool dtype_is_fp8(DType dtype) noexcept;

enum class Role : std::uint8_t {
  kKey = 0,
  kValue,
  kKeyScale,
  kValueScale,
  kLatent,   // MLA compressed KV (kv_lora_rank + rope dims), no value tensor
  kIndexer,  // DSA indexer keys
  kOther,    // any future side tensor; RoleLayout::name tells them apart
};
inline constexpr int kNumRoleKinds = 7;
std::string_view role_name(Role role) noexcept;

// Bit mask over Role values; kAllRoles selects every role of every layer.
using RoleMask = std::uint32_t;
inline constexpr RoleMask kAllRoles = 0xFFFFFFFFu;
constexpr RoleMask role_bit(Role role) { return RoleMask{1} << static_cast<unsigned>(role); }

// Token order inside one block of a role tensor.
enum class TokenOrder : std::uint8_t { kHnd, kNhd, kOpaque };
std::string_view token_order_name(TokenOrder order) noexcept;

struct RoleLayout {
  Role role = Role::kKey;
  DType dtype = DType::kBf16;
  std::uint64_t block_bytes = 0;  // payload of one block of this (layer, role); any size >= 1
  std::string name;               // required for Role::kOther, optional otherwise
};

struct LayerLayout {
  std::vector<RoleLayout> roles;
  bool draft = false;  // MTP / speculative draft layer (swapped like any other)
};

// Model-shaped constructors.
struct GqaShape {
  std::uint32_t num_layers = 32;
  std::uint32_t num_draft_layers = 0;
  std::uint32_t kv_heads = 8;  // per tensor-parallel rank
  std::uint32_t block_tokens = 64;
  std::uint32_t head_dim = 128;
  DType dtype = DType::kBf16;
  bool fp8_scales = false;  // adds key_scale/value_scale [kv_heads, block_tokens]
  DType scale_dtype = DType::kBf16;
  TokenOrder token_order = TokenOrder::kHnd;
};
struct MlaShape {
  std::uint32_t num_layers = 61;
  std::uint32_t num_draft_layers = 0;
  std::uint32_t block_tokens = 64;
  std::uint32_t latent_dim = 576;  // kv_lora_rank + qk_rope_head_dim
  DType dtype = DType::kBf16;
  std::uint32_t indexer_dim = 0;  // > 0 adds an indexer role (DSA)
  DType indexer_dtype = DType::kFp8E4M3;
};

class KvLayout {
 public:
  KvLayout() = default;
  // Validates: >= 1 layer, each layer >= 1 role, no duplicate (role, name) in
  // a layer, block_bytes >= 1, kOther roles named.
  static Result<KvLayout> create(std::vector<LayerLayout> layers, std::uint32_t block_tokens,
                                 TokenOrder token_order = TokenOrder::kHnd);
  static Result<KvLayout> gqa(const GqaShape& shape);
  static Result<KvLayout> mla(const MlaShape& shape);
  // Every layer has exactly one role of `block_bytes` (a synthetic layout for
  // benchmarks and tests).
  static Result<KvLayout> uniform(std::uint32_t num_layers, std::uint32_t roles_per_layer, std::uint64_t block_bytes);
  // The most layers a layout takes (the largest models have a few hundred; a count past this is a mistake, and
  // every per-layer table would be allocated before anything else refused it).
  static constexpr std::uint32_t kMaxLayers = 4096;
  // The most bytes one block of all layers and roles takes (create() refuses more): a 7B model's 512-token block
  // is 64 MiB; past a TiB the sizes are a mistake, and their sum could wrap.
  static constexpr std::uint64_t kMaxBlockBytes = std::uint64_t{1} << 40;

  std::uint32_t num_layers() const noexcept { return static_cast<std::uint32_t>(layers_.size()); }
  const LayerLayout& layer(std::uint32_t l) const { return layers_[l]; }
  const std::vector<LayerLayout>& layers() const noexcept { return layers_; }
  std::uint32_t num_roles(std::uint32_t l) const { return static_cast<std::uint32_t>(layers_[l].roles.size()); }
  std::uint64_t block_bytes(std::uint32_t l, std::uint32_t r) const { return layers_[l].roles[r].block_bytes; }
  std::uint32_t block_tokens() const noexcept { return block_tokens_; }
  TokenOrder token_order() const noexcept { return token_order_; }
  // Sum of block_bytes over roles of one layer / over every layer and role.
  std::uint64_t layer_block_bytes(std::uint32_t l) const;
  std::uint64_t total_block_bytes() const noexcept { return total_block_bytes_; }
  std::uint32_t num_planes() const noexcept { return num_planes_; }
  // Finds the role index of `role` in layer l (first match); NotFound if absent.
  Result<std::uint32_t> find_role(std::uint32_t l, Role role) const;
  // Stable 64-bit digest of the whole description (layers, roles, dtypes,
  // sizes, token order, block tokens). Equal layouts have equal fingerprints.
  std::uint64_t fingerprint() const noexcept { return fingerprint_; }
  std::string describe() const;  // "32 layers x {key bf16 128KiB, value bf16 128KiB}"

  friend bool operator==(const KvLayout& a, const KvLayout& b) noexcept {
    return a.fingerprint_ == b.fingerprint_ && a.num_planes_ == b.num_planes_;
  }

 private:
  std::vector<LayerLayout> layers_;
  std::uint32_t block_tokens_ = 0;
  TokenOrder token_order_ = TokenOrder::kHnd;
  std::uint64_t total_block_bytes_ = 0;
  std::uint32_t num_planes_ = 0;
  std::uint64_t fingerprint_ = 0;
};

enum class MemoryKind : std::uint8_t {
  kDevice,      // GPU memory (or the host backend's simulated device memory)
  kPinnedHost,  // page-locked host memory, reachable by DMA and by kernels via UVA
};
std::string_view memory_kind_name(MemoryKind kind) noexcept;

// A block's index in its pool (a BlockSpace's blocks, a cache tier's pool, a transport's destination list): the
// one block-id type of the public APIs. 32 bits unsigned: pools hold at most 2^32 blocks (at 64 tokens a block,
// 2^38 tokens per tier), ids stay compact in the cache's per-block state, and every engine's int32 block tables
// convert without loss. Formats with their own fixed width (the copy kernel's int32 pair list, u64 lists on the
// wire) convert at one place each through to_block_id, which refuses a value that does not fit.
using BlockId = std::uint32_t;
inline constexpr std::uint64_t kMaxBlockId = 0xffffffffu;

// `value` as a BlockId; InvalidArgument naming `what` and the value when it is negative or above kMaxBlockId
// (never a silent truncation).
template <typename Int>
Result<BlockId> to_block_id(Int value, std::string_view what = "block id") {
  static_assert(std::is_integral_v<Int>);
  if constexpr (std::is_signed_v<Int>) {
    if (value < 0) return InvalidArgument(std::string(what) + " " + std::to_string(value) + " is negative");
  }
  if (static_cast<std::uint64_t>(value) > kMaxBlockId)
    return InvalidArgument(std::string(what) + " " + std::to_string(value) + " does not fit a 32-bit block id");
  return static_cast<BlockId>(value);
}

struct Plane {
  std::byte* base = nullptr;
  std::uint64_t stride = 0;  // bytes between consecutive blocks, >= block_bytes
};

class BlockSpace {
 public:
  BlockSpace() = default;

  // General form: planes[l][r] for every (layer, role) of `layout`.
  // `region_bytes[l][r]`, when non-empty, is the size of the allocation behind
  // each plane and is checked against (num_blocks - 1) * stride + block_bytes.
  // Planes may not overlap each other (checked).
  static Result<BlockSpace> from_planes(MemoryKind kind, int device_ordinal, KvLayout layout, std::uint64_t num_blocks,
                                        std::vector<std::vector<Plane>> planes,
                                        std::vector<std::vector<std::uint64_t>> region_bytes = {});
  // A staging slot that holds one layer at a time: as from_planes, but planes of different layers may share
  // memory (every layer's planes lie in the same slot); the planes of one layer may not overlap (checked). A copy
  // into it must select one layer (the slot then holds that layer's blocks).
  static Result<BlockSpace> layer_slot(MemoryKind kind, int device_ordinal, KvLayout layout, std::uint64_t num_blocks,
                                       std::vector<std::vector<Plane>> planes);
  // One region per (layer, role), block stride = block_bytes.
  static Result<BlockSpace> layer_first(MemoryKind kind, int device_ordinal, KvLayout layout, std::uint64_t num_blocks,
                                        std::vector<std::vector<void*>> bases);
  // Bytes a layer-first region of (l, r) needs; UINT64_MAX when that does not fit in 64 bits.
  static std::uint64_t layer_first_region_bytes(const KvLayout& layout, std::uint32_t l, std::uint32_t r,
                                                std::uint64_t num_blocks);
  // One page per block holding every layer and role in (layer, role) order,
  // each role at an offset aligned to `role_alignment`, the page size rounded
  // up to `page_alignment` (e.g. 4096 for O_DIRECT storage).
  static Result<BlockSpace> page_first(MemoryKind kind, int device_ordinal, KvLayout layout, std::uint64_t num_blocks,
                                       void* base, std::uint64_t region_bytes, std::uint64_t page_alignment = 1,
                                       std::uint64_t role_alignment = 1);
  // Bytes of one page-first page; UINT64_MAX when that does not fit in 64 bits.
  static std::uint64_t page_first_page_bytes(const KvLayout& layout, std::uint64_t page_alignment = 1,
                                             std::uint64_t role_alignment = 1);

  MemoryKind kind() const noexcept { return kind_; }
  int device_ordinal() const noexcept { return device_ordinal_; }
  const KvLayout& layout() const noexcept { return layout_; }
  std::uint64_t num_blocks() const noexcept { return num_blocks_; }
  const Plane& plane(std::uint32_t l, std::uint32_t r) const { return planes_[l][r]; }
  std::byte* block_ptr(std::uint32_t l, std::uint32_t r, BlockId block) const {
    const Plane& p = planes_[l][r];
    return p.base + block * p.stride;
  }
  // Page-first spaces: bytes of one page (0 otherwise).
  std::uint64_t page_bytes() const noexcept { return page_bytes_; }
  // A layer_slot space: its layers' planes share memory, so a copy into or out of it selects exactly one layer.
  bool layers_share_memory() const noexcept { return layers_share_memory_; }

 private:
  static Result<BlockSpace> make(MemoryKind kind, int device_ordinal, KvLayout layout, std::uint64_t num_blocks,
                                 std::vector<std::vector<Plane>> planes,
                                 std::vector<std::vector<std::uint64_t>> region_bytes, bool layers_share);

  MemoryKind kind_ = MemoryKind::kDevice;
  int device_ordinal_ = 0;
  KvLayout layout_;
  std::uint64_t num_blocks_ = 0;
  std::vector<std::vector<Plane>> planes_;
  std::uint64_t page_bytes_ = 0;
  bool layers_share_memory_ = false;
};

}  // namespace kvtier
