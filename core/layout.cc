#include "kvtier/core/layout.h"

#include <fmt/format.h>

#include <algorithm>
#include <initializer_list>
#include <limits>
#include <set>
#include <utility>

#include "kvtier/core/enum_names.h"

namespace kvtier {
namespace {

// FNV-1a 64 over a canonical byte encoding: stable across processes/machines.
class Fnv64 {
 public:
  void bytes(const void* data, std::size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < n; ++i) {
      h_ ^= p[i];
      h_ *= 1099511628211ull;
    }
  }
  void u64(std::uint64_t v) {
    unsigned char le[8];
    for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(v >> (8 * i));
    bytes(le, 8);
  }
  void str(std::string_view s) {
    u64(s.size());
    bytes(s.data(), s.size());
  }
  std::uint64_t value() const { return h_; }

 private:
  std::uint64_t h_ = 14695981039346656037ull;
};

std::string human_bytes(std::uint64_t b) {
  if (b % (1u << 20) == 0 && b >= (1u << 20)) return fmt::format("{}MiB", b >> 20);
  if (b % 1024 == 0 && b >= 1024) return fmt::format("{}KiB", b >> 10);
  return fmt::format("{}B", b);
}

// Saturating at UINT64_MAX: a size that does not fit stays too large to fit anything, instead of wrapping to a small
// one that a later check would take for valid.
constexpr std::uint64_t kSaturated = std::numeric_limits<std::uint64_t>::max();
std::uint64_t add_sat(std::uint64_t a, std::uint64_t b) {
  std::uint64_t out = 0;
  return __builtin_add_overflow(a, b, &out) ? kSaturated : out;
}
std::uint64_t mul_sat(std::uint64_t a, std::uint64_t b) {
  std::uint64_t out = 0;
  return __builtin_mul_overflow(a, b, &out) ? kSaturated : out;
}
std::uint64_t align_up(std::uint64_t v, std::uint64_t a) {
  if (a <= 1 || v % a == 0) return v;
  return mul_sat(v / a + 1, a);
}

}  // namespace

std::uint32_t dtype_bytes(DType dtype) noexcept {
  if (dtype_is_fp8(dtype)) return 1;
  switch (dtype) {
    case DType::kBf16:
    case DType::kFp16:
    case DType::kInt16:
    case DType::kUint16: return 2;
    case DType::kFp32:
    case DType::kInt32:
    case DType::kUint32: return 4;
    case DType::kFp64:
    case DType::kInt64:
    case DType::kUint64:
    case DType::kComplex64: return 8;
    case DType::kComplex128: return 16;
    default: return 1;  // int8, uint8, bool (and fp8, above)
  }
}

constexpr EnumName<DType> kDtypeEntries[] = {
    {DType::kBf16, "bf16"},
    {DType::kFp16, "fp16"},
    {DType::kFp32, "fp32"},
    {DType::kFp8E4M3, "fp8_e4m3"},
    {DType::kFp8E5M2, "fp8_e5m2"},
    {DType::kInt8, "int8"},
    {DType::kUint8, "uint8"},
    {DType::kInt16, "int16"},
    {DType::kUint16, "uint16"},
    {DType::kInt32, "int32"},
    {DType::kUint32, "uint32"},
    {DType::kInt64, "int64"},
    {DType::kUint64, "uint64"},
    {DType::kFp64, "fp64"},
    {DType::kBool, "bool"},
    {DType::kComplex64, "complex64"},
    {DType::kComplex128, "complex128"},
    {DType::kFp8E4M3Fnuz, "fp8_e4m3fnuz"},
    {DType::kFp8E5M2Fnuz, "fp8_e5m2fnuz"},
    {DType::kFp8E8M0, "fp8_e8m0"},
    {DType::kFp8E3M4, "fp8_e3m4"},
    {DType::kFp8E4M3Ieee, "fp8_e4m3_ieee"},
    {DType::kFp8E4M3B11Fnuz, "fp8_e4m3b11fnuz"},
    // Further spellings (PyTorch's and engines' names).
    {DType::kBf16, "bfloat16"},
    {DType::kFp16, "float16"},
    {DType::kFp32, "float32"},
    {DType::kFp64, "float64"},
    {DType::kFp8E4M3, "fp8"},
    {DType::kFp8E4M3, "fp8_e4m3fn"},
};
constexpr auto kDtypeNames = enum_table("dtype", kDtypeEntries);
static_assert(kDtypeNames.covers_dense(std::size(kAllDTypes)), "a DType without a name");
std::string_view dtype_name(DType dtype) noexcept { return kDtypeNames.name(dtype); }

bool dtype_is_fp8(DType dtype) noexcept {
  switch (dtype) {
    case DType::kFp8E4M3:
    case DType::kFp8E5M2:
    case DType::kFp8E4M3Fnuz:
    case DType::kFp8E5M2Fnuz:
    case DType::kFp8E8M0:
    case DType::kFp8E3M4:
    case DType::kFp8E4M3Ieee:
    case DType::kFp8E4M3B11Fnuz: return true;
    default: return false;
  }
}

Result<DType> parse_dtype(std::string_view name) { return kDtypeNames.parse(name); }

constexpr EnumName<Role> kRoleEntries[] = {
    {Role::kKey, "key"},
    {Role::kValue, "value"},
    {Role::kKeyScale, "key_scale"},
    {Role::kValueScale, "value_scale"},
    {Role::kLatent, "latent"},
    {Role::kIndexer, "indexer"},
    {Role::kOther, "other"},
};
constexpr auto kRoleNames = enum_table("role", kRoleEntries);
std::string_view role_name(Role role) noexcept { return kRoleNames.name(role); }

constexpr EnumName<TokenOrder> kTokenOrderEntries[] = {
    {TokenOrder::kHnd, "HND"},
    {TokenOrder::kNhd, "NHD"},
    {TokenOrder::kOpaque, "opaque"},
};
constexpr auto kTokenOrderNames = enum_table("token order", kTokenOrderEntries);
std::string_view token_order_name(TokenOrder order) noexcept { return kTokenOrderNames.name(order); }

constexpr EnumName<MemoryKind> kMemoryKindEntries[] = {
    {MemoryKind::kDevice, "device"},
    {MemoryKind::kPinnedHost, "pinned_host"},
};
constexpr auto kMemoryKindNames = enum_table("memory kind", kMemoryKindEntries);
std::string_view memory_kind_name(MemoryKind kind) noexcept { return kMemoryKindNames.name(kind); }

Result<KvLayout> KvLayout::create(std::vector<LayerLayout> layers, std::uint32_t block_tokens, TokenOrder token_order) {
  if (layers.empty()) return InvalidArgument("KvLayout needs at least one layer, got 0");
  if (layers.size() > kMaxLayers)
    return InvalidArgument(fmt::format("KvLayout takes at most {} layers, got {}", kMaxLayers, layers.size()));
  if (block_tokens == 0) return InvalidArgument("KvLayout block_tokens must be >= 1, got 0");
  KvLayout out;
  out.block_tokens_ = block_tokens;
  out.token_order_ = token_order;
  Fnv64 h;
  h.str("kvtier.layout.v1");
  h.u64(block_tokens);
  h.u64(static_cast<std::uint64_t>(token_order));
  h.u64(layers.size());
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const LayerLayout& layer = layers[l];
    if (layer.roles.empty()) return InvalidArgument(fmt::format("KvLayout layer {} has no roles", l));
    std::set<std::pair<int, std::string>> seen;
    h.u64(layer.draft ? 1 : 0);
    h.u64(layer.roles.size());
    for (std::size_t r = 0; r < layer.roles.size(); ++r) {
      const RoleLayout& role = layer.roles[r];
      if (role.block_bytes == 0)
        return InvalidArgument(
            fmt::format("KvLayout layer {} role {} ({}) has block_bytes 0", l, r, role_name(role.role)));
      if (static_cast<int>(role.role) >= kNumRoleKinds)
        return InvalidArgument(
            fmt::format("KvLayout layer {} role {} has invalid role value {}", l, r, static_cast<int>(role.role)));
      if (role.role == Role::kOther && role.name.empty())
        return InvalidArgument(fmt::format("KvLayout layer {} role {} is Role::kOther but has no name", l, r));
      if (!seen.emplace(static_cast<int>(role.role), role.name).second)
        return InvalidArgument(fmt::format("KvLayout layer {} has role '{}{}{}' twice", l, role_name(role.role),
                                           role.name.empty() ? "" : ":", role.name));
      h.u64(static_cast<std::uint64_t>(role.role));
      h.u64(static_cast<std::uint64_t>(role.dtype));
      h.u64(role.block_bytes);
      h.str(role.name);
      // The sum is every block's size and every offset in it: a wrap made 2 x 2^63 a block of 0 bytes.
      if (role.block_bytes > kMaxBlockBytes - out.total_block_bytes_)
        return InvalidArgument(
            fmt::format("KvLayout layer {} role {} ({}): block_bytes {} takes the block past {} bytes", l, r,
                        role_name(role.role), role.block_bytes, kMaxBlockBytes));
      out.total_block_bytes_ += role.block_bytes;
      ++out.num_planes_;
    }
  }
  out.fingerprint_ = h.value();
  out.layers_ = std::move(layers);
  return out;
}

namespace {
// The product of `factors` into `out`, false when it passes KvLayout::kMaxBlockBytes (or 2^64).
bool shape_bytes(std::initializer_list<std::uint64_t> factors, std::uint64_t& out) {
  std::uint64_t product = 1;
  for (std::uint64_t f : factors)
    if (__builtin_mul_overflow(product, f, &product) || product > KvLayout::kMaxBlockBytes) return false;
  out = product;
  return true;
}
}  // namespace

Result<KvLayout> KvLayout::gqa(const GqaShape& s) {
  if (std::uint64_t{s.num_layers} + s.num_draft_layers == 0) return InvalidArgument("GqaShape has 0 layers");
  if (std::uint64_t{s.num_layers} + s.num_draft_layers > kMaxLayers)
    return InvalidArgument(fmt::format("GqaShape has {} + {} draft layers, at most {} in all", s.num_layers,
                                       s.num_draft_layers, kMaxLayers));
  if (s.kv_heads == 0 || s.block_tokens == 0 || s.head_dim == 0)
    return InvalidArgument(fmt::format("GqaShape dimensions must be >= 1: kv_heads={} block_tokens={} head_dim={}",
                                       s.kv_heads, s.block_tokens, s.head_dim));
  // Products of 32-bit dimensions can pass 2^64 (and wrap into a size create() accepts): bounded first.
  std::uint64_t kv_bytes = 0, scale_bytes = 0;
  if (!shape_bytes({s.kv_heads, s.block_tokens, s.head_dim, dtype_bytes(s.dtype)}, kv_bytes) ||
      !shape_bytes({s.kv_heads, s.block_tokens, dtype_bytes(s.scale_dtype)}, scale_bytes))
    return InvalidArgument(
        fmt::format("GqaShape kv_heads={} block_tokens={} head_dim={}: a block takes more than {} bytes", s.kv_heads,
                    s.block_tokens, s.head_dim, kMaxBlockBytes));
  std::vector<LayerLayout> layers;
  for (std::uint32_t l = 0; l < s.num_layers + s.num_draft_layers; ++l) {
    LayerLayout layer;
    layer.draft = l >= s.num_layers;
    layer.roles.push_back({Role::kKey, s.dtype, kv_bytes, {}});
    layer.roles.push_back({Role::kValue, s.dtype, kv_bytes, {}});
    if (s.fp8_scales) {
      layer.roles.push_back({Role::kKeyScale, s.scale_dtype, scale_bytes, {}});
      layer.roles.push_back({Role::kValueScale, s.scale_dtype, scale_bytes, {}});
    }
    layers.push_back(std::move(layer));
  }
  return create(std::move(layers), s.block_tokens, s.token_order);
}

Result<KvLayout> KvLayout::mla(const MlaShape& s) {
  if (std::uint64_t{s.num_layers} + s.num_draft_layers == 0) return InvalidArgument("MlaShape has 0 layers");
  if (std::uint64_t{s.num_layers} + s.num_draft_layers > kMaxLayers)
    return InvalidArgument(fmt::format("MlaShape has {} + {} draft layers, at most {} in all", s.num_layers,
                                       s.num_draft_layers, kMaxLayers));
  if (s.block_tokens == 0 || s.latent_dim == 0)
    return InvalidArgument(
        fmt::format("MlaShape dimensions must be >= 1: block_tokens={} latent_dim={}", s.block_tokens, s.latent_dim));
  std::uint64_t latent_bytes = 0, indexer_bytes = 0;
  if (!shape_bytes({s.block_tokens, s.latent_dim, dtype_bytes(s.dtype)}, latent_bytes) ||
      !shape_bytes({s.block_tokens, s.indexer_dim, dtype_bytes(s.indexer_dtype)}, indexer_bytes))
    return InvalidArgument(
        fmt::format("MlaShape block_tokens={} latent_dim={} indexer_dim={}: a block takes more "
                    "than {} bytes",
                    s.block_tokens, s.latent_dim, s.indexer_dim, kMaxBlockBytes));
  std::vector<LayerLayout> layers;
  for (std::uint32_t l = 0; l < s.num_layers + s.num_draft_layers; ++l) {
    LayerLayout layer;
    layer.draft = l >= s.num_layers;
    layer.roles.push_back({Role::kLatent, s.dtype, latent_bytes, {}});
    if (s.indexer_dim > 0) layer.roles.push_back({Role::kIndexer, s.indexer_dtype, indexer_bytes, {}});
    layers.push_back(std::move(layer));
  }
  return create(std::move(layers), s.block_tokens, TokenOrder::kOpaque);
}

Result<KvLayout> KvLayout::uniform(std::uint32_t num_layers, std::uint32_t roles_per_layer, std::uint64_t block_bytes) {
  if (roles_per_layer == 0 || roles_per_layer > 2 + 4)
    return InvalidArgument(fmt::format("uniform layout roles_per_layer must be in [1, 6], got {}", roles_per_layer));
  static constexpr Role kOrder[] = {Role::kKey,        Role::kValue,  Role::kKeyScale,
                                    Role::kValueScale, Role::kLatent, Role::kIndexer};
  if (num_layers > kMaxLayers)
    return InvalidArgument(fmt::format("uniform layout takes at most {} layers, got {}", kMaxLayers, num_layers));
  std::vector<LayerLayout> layers(num_layers);
  for (auto& layer : layers)
    for (std::uint32_t r = 0; r < roles_per_layer; ++r)
      layer.roles.push_back({kOrder[r], DType::kUint8, block_bytes, {}});
  return create(std::move(layers), 1, TokenOrder::kOpaque);
}

std::uint64_t KvLayout::layer_block_bytes(std::uint32_t l) const {
  std::uint64_t sum = 0;
  for (const auto& r : layers_[l].roles) sum += r.block_bytes;
  return sum;
}

Result<std::uint32_t> KvLayout::find_role(std::uint32_t l, Role role) const {
  if (l >= layers_.size()) return OutOfRange(fmt::format("layer {} >= num_layers {}", l, layers_.size()));
  for (std::uint32_t r = 0; r < layers_[l].roles.size(); ++r)
    if (layers_[l].roles[r].role == role) return r;
  return NotFound(fmt::format("layer {} has no role '{}'", l, role_name(role)));
}

std::string KvLayout::describe() const {
  if (layers_.empty()) return "empty layout";
  std::string roles;
  for (const auto& r : layers_[0].roles) {
    if (!roles.empty()) roles += ", ";
    roles += fmt::format("{}{}{} {} {}", role_name(r.role), r.name.empty() ? "" : ":", r.name, dtype_name(r.dtype),
                         human_bytes(r.block_bytes));
  }
  return fmt::format("{} layers x {{{}}}, {} tokens/block, {} per block", layers_.size(), roles, block_tokens_,
                     human_bytes(total_block_bytes_));
}

Result<BlockSpace> BlockSpace::from_planes(MemoryKind kind, int device_ordinal, KvLayout layout,
                                           std::uint64_t num_blocks, std::vector<std::vector<Plane>> planes,
                                           std::vector<std::vector<std::uint64_t>> region_bytes) {
  return make(kind, device_ordinal, std::move(layout), num_blocks, std::move(planes), std::move(region_bytes), false);
}

Result<BlockSpace> BlockSpace::layer_slot(MemoryKind kind, int device_ordinal, KvLayout layout,
                                          std::uint64_t num_blocks, std::vector<std::vector<Plane>> planes) {
  return make(kind, device_ordinal, std::move(layout), num_blocks, std::move(planes), {}, true);
}

Result<BlockSpace> BlockSpace::make(MemoryKind kind, int device_ordinal, KvLayout layout, std::uint64_t num_blocks,
                                    std::vector<std::vector<Plane>> planes,
                                    std::vector<std::vector<std::uint64_t>> region_bytes, bool layers_share) {
  if (layout.num_layers() == 0) return InvalidArgument("BlockSpace needs a non-empty KvLayout");
  if (num_blocks == 0) return InvalidArgument("BlockSpace num_blocks must be >= 1, got 0");
  if (num_blocks > static_cast<std::uint64_t>(INT32_MAX))
    return InvalidArgument(fmt::format("BlockSpace num_blocks {} exceeds the int32 block id range", num_blocks));
  if (planes.size() != layout.num_layers())
    return InvalidArgument(
        fmt::format("BlockSpace has planes for {} layers, layout has {}", planes.size(), layout.num_layers()));
  if (!region_bytes.empty() && region_bytes.size() != planes.size())
    return InvalidArgument(
        fmt::format("BlockSpace region_bytes has {} layers, layout has {}", region_bytes.size(), layout.num_layers()));
  struct Interval {
    std::uintptr_t begin, end;
    std::uint32_t l, r;
  };
  std::vector<Interval> intervals;
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l) {
    if (planes[l].size() != layout.num_roles(l))
      return InvalidArgument(fmt::format("BlockSpace layer {} has {} planes, layout has {} roles", l, planes[l].size(),
                                         layout.num_roles(l)));
    if (!region_bytes.empty() && region_bytes[l].size() != planes[l].size())
      return InvalidArgument(fmt::format("BlockSpace region_bytes layer {} has {} entries, expected {}", l,
                                         region_bytes[l].size(), planes[l].size()));
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
      const Plane& p = planes[l][r];
      const std::uint64_t bb = layout.block_bytes(l, r);
      const auto rname = role_name(layout.layer(l).roles[r].role);
      if (p.base == nullptr)
        return InvalidArgument(fmt::format("BlockSpace layer {} role {} has a null base", l, rname));
      if (p.stride < bb)
        return InvalidArgument(
            fmt::format("BlockSpace layer {} role {}: stride {} < block_bytes {}", l, rname, p.stride, bb));
      // extent = (num_blocks - 1) * stride + block_bytes, and base + extent,
      // must not wrap: a wrapped extent would accept a tiny region.
      std::uint64_t extent = 0;
      const auto begin = reinterpret_cast<std::uintptr_t>(p.base);
      if (__builtin_mul_overflow(num_blocks - 1, p.stride, &extent) || __builtin_add_overflow(extent, bb, &extent) ||
          extent > std::numeric_limits<std::uintptr_t>::max() - begin)
        return InvalidArgument(
            fmt::format("BlockSpace layer {} role {}: {} blocks of stride {} exceed the address space", l, rname,
                        num_blocks, p.stride));
      if (!region_bytes.empty() && region_bytes[l][r] < extent)
        return InvalidArgument(
            fmt::format("BlockSpace layer {} role {}: region of {} bytes is too small for {} blocks (needs {} bytes)",
                        l, rname, region_bytes[l][r], num_blocks, extent));
      intervals.push_back({begin, begin + extent, l, r});
    }
  }
  // Overlap check between every pair of planes whose ranges intersect (not
  // only neighbours after sorting: a plane can hide behind a longer one).
  // Interleaved planes (e.g. K/V in one block with stride 2*block_bytes)
  // overlap as ranges but not byte-wise; compare block footprints when the
  // strides match, else ranges.
  std::sort(intervals.begin(), intervals.end(), [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  for (std::size_t i = 0; i < intervals.size(); ++i)
    for (std::size_t j = i + 1; j < intervals.size() && intervals[j].begin < intervals[i].end; ++j) {
      const Interval& a = intervals[i];
      const Interval& b = intervals[j];
      if (layers_share && a.l != b.l) continue;
      const Plane& pa = planes[a.l][a.r];
      const Plane& pb = planes[b.l][b.r];
      const std::uint64_t delta = b.begin - a.begin;
      const bool interleaved = pa.stride == pb.stride && delta % pa.stride >= layout.block_bytes(a.l, a.r) &&
                               (delta % pa.stride) + layout.block_bytes(b.l, b.r) <= pa.stride;
      if (!interleaved)
        return InvalidArgument(fmt::format("BlockSpace planes (layer {}, {}) and (layer {}, {}) overlap", a.l,
                                           role_name(layout.layer(a.l).roles[a.r].role), b.l,
                                           role_name(layout.layer(b.l).roles[b.r].role)));
    }
  BlockSpace out;
  out.kind_ = kind;
  out.device_ordinal_ = device_ordinal;
  out.layout_ = std::move(layout);
  out.num_blocks_ = num_blocks;
  out.planes_ = std::move(planes);
  out.layers_share_memory_ = layers_share;
  return out;
}

std::uint64_t BlockSpace::layer_first_region_bytes(const KvLayout& layout, std::uint32_t l, std::uint32_t r,
                                                   std::uint64_t num_blocks) {
  return mul_sat(layout.block_bytes(l, r), num_blocks);
}

Result<BlockSpace> BlockSpace::layer_first(MemoryKind kind, int device_ordinal, KvLayout layout,
                                           std::uint64_t num_blocks, std::vector<std::vector<void*>> bases) {
  if (bases.size() != layout.num_layers())
    return InvalidArgument(
        fmt::format("layer_first: {} layers of bases, layout has {}", bases.size(), layout.num_layers()));
  std::vector<std::vector<Plane>> planes(layout.num_layers());
  std::vector<std::vector<std::uint64_t>> sizes(layout.num_layers());
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l) {
    if (bases[l].size() != layout.num_roles(l))
      return InvalidArgument(fmt::format("layer_first: layer {} has {} bases, layout has {} roles", l, bases[l].size(),
                                         layout.num_roles(l)));
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
      const std::uint64_t bytes = layer_first_region_bytes(layout, l, r, num_blocks);
      if (bytes == kSaturated)
        return InvalidArgument(
            fmt::format("layer_first: {} blocks x {} bytes (layer {}, role {}) exceed the address "
                        "space",
                        num_blocks, layout.block_bytes(l, r), l, r));
      planes[l].push_back({static_cast<std::byte*>(bases[l][r]), layout.block_bytes(l, r)});
      sizes[l].push_back(bytes);
    }
  }
  return from_planes(kind, device_ordinal, std::move(layout), num_blocks, std::move(planes), std::move(sizes));
}

std::uint64_t BlockSpace::page_first_page_bytes(const KvLayout& layout, std::uint64_t page_alignment,
                                                std::uint64_t role_alignment) {
  std::uint64_t offset = 0;
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r)
      offset = add_sat(align_up(offset, role_alignment), layout.block_bytes(l, r));
  return align_up(offset, page_alignment);
}

Result<BlockSpace> BlockSpace::page_first(MemoryKind kind, int device_ordinal, KvLayout layout,
                                          std::uint64_t num_blocks, void* base, std::uint64_t region_bytes,
                                          std::uint64_t page_alignment, std::uint64_t role_alignment) {
  if (base == nullptr) return InvalidArgument("page_first: null base");
  if (page_alignment == 0 || role_alignment == 0)
    return InvalidArgument(
        fmt::format("page_first: alignments must be >= 1 (page {}, role {})", page_alignment, role_alignment));
  const std::uint64_t page = page_first_page_bytes(layout, page_alignment, role_alignment);
  if (page == kSaturated)
    return InvalidArgument(
        fmt::format("page_first: a page of the layout aligned to {} (roles to {}) exceeds the address space",
                    page_alignment, role_alignment));
  std::uint64_t needed = 0;
  if (__builtin_mul_overflow(page, num_blocks, &needed))
    return InvalidArgument(
        fmt::format("page_first: {} blocks x {} page bytes exceed the address space", num_blocks, page));
  if (region_bytes < needed)
    return InvalidArgument(
        fmt::format("page_first: region of {} bytes < {} blocks x {} page bytes", region_bytes, num_blocks, page));
  std::vector<std::vector<Plane>> planes(layout.num_layers());
  std::uint64_t offset = 0;
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
      offset = align_up(offset, role_alignment);
      planes[l].push_back({static_cast<std::byte*>(base) + offset, page});
      offset += layout.block_bytes(l, r);
    }
  KVTIER_ASSIGN_OR_RETURN(BlockSpace out,
                          from_planes(kind, device_ordinal, std::move(layout), num_blocks, std::move(planes)));
  out.page_bytes_ = page;
  return out;
}

}  // namespace kvtier
