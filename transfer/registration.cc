#include "kvtier/transfer/registration.h"

#include <fmt/format.h>

#include <set>

namespace kvtier {
namespace {

// The bytes of one block of a tensor [num_blocks, ...] (dimensions 1.. times the dtype's size), its dimensions already
// checked positive. The products wrapped: a shape [4, 2^62 + 16] of fp32 read as 64-byte blocks and registered.
Result<std::uint64_t> tensor_block_bytes(const TensorDesc& t, std::string_view name) {
  std::uint64_t bytes = dtype_bytes(t.dtype);
  for (std::size_t i = 1; i < t.shape.size(); ++i)
    if (__builtin_mul_overflow(bytes, static_cast<std::uint64_t>(t.shape[i]), &bytes) ||
        bytes > KvLayout::kMaxBlockBytes)
      return InvalidArgument(
          fmt::format("KV tensor '{}': a block of dimensions 1..{} is more than {} bytes (at "
                      "dimension {} = {})",
                      name, t.shape.size() - 1, KvLayout::kMaxBlockBytes, i, t.shape[i]));
  return bytes;
}

std::string_view seed_prefix(Role role, std::string_view other_name) {
  switch (role) {
    case Role::kKey: return "key_caches";
    case Role::kValue: return "value_caches";
    case Role::kKeyScale: return "key_cache_scales";
    case Role::kValueScale: return "value_cache_scales";
    case Role::kLatent: return "key_caches";
    case Role::kIndexer: return "indexer_caches";
    case Role::kOther: return other_name;
  }
  return other_name;
}

bool is_byte_type(DType d) { return d == DType::kUint8 || d == DType::kInt8 || d == DType::kBool; }
bool is_fp8(DType d) { return dtype_is_fp8(d); }

// FastDeploy's CacheTransferManager stores fp8 caches as uint8 tensors.
bool dtype_compatible(DType tensor, DType role) {
  if (tensor == role) return true;
  return (is_byte_type(tensor) && (is_fp8(role) || is_byte_type(role))) || (is_byte_type(role) && is_fp8(tensor));
}

// Splits "<prefix>_<layer>_rank<r>.device<d>"; false when it does not parse.
bool parse_seed_name(std::string_view name, std::string& prefix, std::uint32_t& layer, int& rank, int& device) {
  auto dev_pos = name.rfind(".device");
  if (dev_pos == std::string_view::npos) return false;
  auto rank_pos = name.rfind("_rank", dev_pos);
  if (rank_pos == std::string_view::npos) return false;
  auto layer_pos = name.rfind('_', rank_pos - 1);
  if (layer_pos == std::string_view::npos || layer_pos == 0) return false;
  auto to_int = [](std::string_view s, long long& out) {
    if (s.empty() || s.size() > 9) return false;
    out = 0;
    for (char c : s) {
      if (c < '0' || c > '9') return false;
      out = out * 10 + (c - '0');
    }
    return true;
  };
  long long l = 0, r = 0, d = 0;
  if (!to_int(name.substr(layer_pos + 1, rank_pos - layer_pos - 1), l)) return false;
  if (!to_int(name.substr(rank_pos + 5, dev_pos - rank_pos - 5), r)) return false;
  if (!to_int(name.substr(dev_pos + 7), d)) return false;
  prefix = std::string(name.substr(0, layer_pos));
  layer = static_cast<std::uint32_t>(l);
  rank = static_cast<int>(r);
  device = static_cast<int>(d);
  return true;
}

std::string names_for_other_ids(const std::set<std::pair<int, int>>& ids) {
  std::string out;
  for (const auto& [r, d] : ids) {
    if (!out.empty()) out += ", ";
    out += fmt::format("rank{}.device{}", r, d);
  }
  return out;
}

}  // namespace

std::string seed_tensor_name(Role role, std::string_view other_name, std::uint32_t layer, int rank, int device_label) {
  return fmt::format("{}_{}_rank{}.device{}", seed_prefix(role, other_name), layer, rank, device_label);
}

Result<BlockSpace> device_space_from_name_map(const std::map<std::string, TensorDesc>& tensors, const KvLayout& layout,
                                              int rank, int device_label, int device_ordinal) {
  if (layout.num_layers() == 0) return InvalidArgument("device_space_from_name_map: empty layout");
  std::set<std::string> expected;
  std::set<std::string> prefixes;
  std::set<std::pair<int, int>> other_ids;
  std::uint64_t num_blocks = 0;
  std::string num_blocks_from;
  std::vector<std::vector<Plane>> planes(layout.num_layers());
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l) {
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
      const RoleLayout& role = layout.layer(l).roles[r];
      std::string name = seed_tensor_name(role.role, role.name, l, rank, device_label);
      prefixes.insert(std::string(seed_prefix(role.role, role.name)));
      if (!expected.insert(name).second)
        return InvalidArgument(fmt::format("layout maps two roles of layer {} to tensor name '{}'", l, name));
      auto it = tensors.find(name);
      if (it == tensors.end()) {
        for (const auto& [n, desc] : tensors) {
          std::string p;
          std::uint32_t tl;
          int tr, td;
          if (parse_seed_name(n, p, tl, tr, td) && (tr != rank || td != device_label)) other_ids.insert({tr, td});
        }
        std::string hint = other_ids.empty()
                               ? std::string()
                               : fmt::format(" (the map has tensors for {})", names_for_other_ids(other_ids));
        return NotFound(
            fmt::format("KV tensor '{}' ({} of layer {}{}) is missing from the device tensor map of {} "
                        "entries{}",
                        name, role_name(role.role), l, layout.layer(l).draft ? ", draft" : "", tensors.size(), hint));
      }
      const TensorDesc& t = it->second;
      if (t.data == nullptr) return InvalidArgument(fmt::format("KV tensor '{}' has a null data pointer", name));
      if (t.device_ordinal >= 0 && t.device_ordinal != device_ordinal)
        return InvalidArgument(fmt::format("KV tensor '{}' is on device {}, but the cache is registered on device {}",
                                           name, t.device_ordinal, device_ordinal));
      if (reinterpret_cast<std::uintptr_t>(t.data) % dtype_bytes(t.dtype) != 0)
        return InvalidArgument(fmt::format("KV tensor '{}' data pointer {} is not aligned to its {}-byte elements",
                                           name, t.data, dtype_bytes(t.dtype)));
      if (t.shape.size() < 2)
        return InvalidArgument(
            fmt::format("KV tensor '{}' has rank {} shape; expected [num_blocks, ...]", name, t.shape.size()));
      for (std::size_t i = 0; i < t.shape.size(); ++i)
        if (t.shape[i] <= 0)
          return InvalidArgument(fmt::format("KV tensor '{}' has dimension {} = {}", name, i, t.shape[i]));
      if (!dtype_compatible(t.dtype, role.dtype))
        return InvalidArgument(fmt::format("KV tensor '{}' has dtype {}; the layout says {} for {} of layer {}", name,
                                           dtype_name(t.dtype), dtype_name(role.dtype), role_name(role.role), l));
      KVTIER_ASSIGN_OR_RETURN(const std::uint64_t bytes, tensor_block_bytes(t, name));
      const std::uint64_t elems = dtype_bytes(t.dtype) != 0 ? bytes / dtype_bytes(t.dtype) : 0;
      if (bytes != role.block_bytes) {
        std::string dims;
        for (std::size_t i = 0; i < t.shape.size(); ++i) dims += fmt::format("{}{}", i ? ", " : "", t.shape[i]);
        return InvalidArgument(
            fmt::format("KV tensor '{}' shape [{}] x {} gives {} bytes per block; the layout "
                        "says {} for {} of layer {}",
                        name, dims, dtype_name(t.dtype), bytes, role.block_bytes, role_name(role.role), l));
      }
      auto blocks = static_cast<std::uint64_t>(t.shape[0]);
      if (num_blocks == 0) {
        num_blocks = blocks;
        num_blocks_from = name;
      } else if (blocks != num_blocks) {
        return InvalidArgument(
            fmt::format("KV tensor '{}' has {} blocks but '{}' has {}", name, blocks, num_blocks_from, num_blocks));
      }
      std::uint64_t stride = t.block_stride_bytes ? t.block_stride_bytes : bytes;
      if (!t.strides.empty()) {
        if (t.strides.size() != t.shape.size())
          return InvalidArgument(
              fmt::format("KV tensor '{}' has {} strides for {} dimensions", name, t.strides.size(), t.shape.size()));
        // Each block must be one contiguous run of bytes: dims 1.. C-contiguous
        // (a dimension of extent 1 may have any stride).
        std::int64_t want = 1;  // no overflow: the product of dimensions 1.. is a block's elements, checked above
        for (std::size_t i = t.shape.size(); i-- > 1;) {
          if (t.shape[i] != 1 && t.strides[i] != want)
            return InvalidArgument(fmt::format(
                "KV tensor '{}' is not contiguous within a block: dimension {} has stride {} (elements), expected {} "
                "(blocks must be contiguous; call .contiguous() or allocate block-major)",
                name, i, t.strides[i], want));
          want *= t.shape[i];
        }
        if (t.strides[0] < static_cast<std::int64_t>(elems))
          return InvalidArgument(fmt::format(
              "KV tensor '{}' block stride {} elements is smaller than a block ({} elements): blocks overlap or dim 0 "
              "is not the block index",
              name, t.strides[0], elems));
        // A stride of 2^62 elements wrapped to a few bytes, which then passed as a block stride.
        if (__builtin_mul_overflow(static_cast<std::uint64_t>(t.strides[0]), dtype_bytes(t.dtype), &stride))
          return InvalidArgument(
              fmt::format("KV tensor '{}' block stride {} elements overflows 64 bits in bytes", name, t.strides[0]));
      }
      if (stride < bytes)
        return InvalidArgument(fmt::format("KV tensor '{}' block stride {} < block bytes {}", name, stride, bytes));
      planes[l].push_back(Plane{static_cast<std::byte*>(t.data), stride});
    }
  }
  // A tensor of this rank/device that the layout does not list would never be swapped.
  for (const auto& [n, desc] : tensors) {
    std::string p;
    std::uint32_t tl;
    int tr, td;
    if (!parse_seed_name(n, p, tl, tr, td) || tr != rank || td != device_label) continue;
    static const std::set<std::string> kSeedPrefixes = {"key_caches", "value_caches", "key_cache_scales",
                                                        "value_cache_scales", "indexer_caches"};
    if ((kSeedPrefixes.count(p) || prefixes.count(p)) && !expected.count(n))
      return InvalidArgument(
          fmt::format("KV tensor '{}' is in the device tensor map but not in the layout ({}); "
                      "register every KV-bearing tensor (draft layers, scales, indexer)",
                      n, layout.describe()));
  }
  auto space = BlockSpace::from_planes(MemoryKind::kDevice, device_ordinal, layout, num_blocks, std::move(planes));
  if (!space.ok()) return space.status().with_context("device_space_from_name_map");
  return space;
}

Result<KvLayout> layout_from_name_map(const std::map<std::string, TensorDesc>& tensors, std::uint32_t num_model_layers,
                                      int rank, int device_label, std::uint32_t block_tokens) {
  struct Found {
    std::map<Role, const TensorDesc*> roles;
    std::map<Role, std::string> names;
  };
  std::map<std::uint32_t, Found> layers;
  bool any_value = false;
  static const std::map<std::string, Role> kPrefixRole = {{"key_caches", Role::kKey},
                                                          {"value_caches", Role::kValue},
                                                          {"key_cache_scales", Role::kKeyScale},
                                                          {"value_cache_scales", Role::kValueScale},
                                                          {"indexer_caches", Role::kIndexer}};
  for (const auto& [n, desc] : tensors) {
    std::string p;
    std::uint32_t tl;
    int tr, td;
    if (!parse_seed_name(n, p, tl, tr, td) || tr != rank || td != device_label) continue;
    auto role = kPrefixRole.find(p);
    if (role == kPrefixRole.end()) continue;
    if (desc.shape.size() < 2)
      return InvalidArgument(
          fmt::format("KV tensor '{}' has rank {} shape; expected [num_blocks, ...]", n, desc.shape.size()));
    for (std::size_t i = 0; i < desc.shape.size(); ++i)
      if (desc.shape[i] <= 0)
        return InvalidArgument(fmt::format("KV tensor '{}' has dimension {} = {}", n, i, desc.shape[i]));
    KVTIER_RETURN_IF_ERROR(tensor_block_bytes(desc, n).status());
    layers[tl].roles[role->second] = &desc;
    layers[tl].names[role->second] = n;
    any_value = any_value || role->second == Role::kValue;
  }
  if (layers.empty())
    return NotFound(fmt::format("no KV tensor of rank{}.device{} in the tensor map of {} entries (names like '{}')",
                                rank, device_label, tensors.size(),
                                seed_tensor_name(Role::kKey, "", 0, rank, device_label)));
  const std::uint32_t num_layers = layers.rbegin()->first + 1;
  // Layers at or above num_model_layers are draft (MTP) layers: 0 would take every layer for one, so a layer
  // count read as 0 went unnoticed.
  if (num_model_layers == 0)
    return InvalidArgument(fmt::format(
        "num_model_layers 0: the model has at least one layer (the map holds KV tensors of {} layers; those at or "
        "above num_model_layers are draft layers)",
        num_layers));
  if (num_layers < num_model_layers)
    return NotFound(fmt::format("KV tensors of layers {}..{} are missing (the model has {} layers)", num_layers,
                                num_model_layers - 1, num_model_layers));
  std::vector<LayerLayout> out;
  const Found* first = nullptr;
  for (std::uint32_t l = 0; l < num_layers; ++l) {
    auto it = layers.find(l);
    if (it == layers.end() || !it->second.roles.count(Role::kKey))
      return NotFound(fmt::format("KV tensor '{}' is missing (layer {} of {})",
                                  seed_tensor_name(Role::kKey, "", l, rank, device_label), l, num_layers));
    const Found& f = it->second;
    if (first == nullptr) first = &f;
    for (const auto& [role, desc] : first->roles)
      if (!f.roles.count(role))
        return NotFound(fmt::format("KV tensor '{}' is missing: layer 0 has one",
                                    seed_tensor_name(role, "", l, rank, device_label)));
    LayerLayout ll;
    ll.draft = l >= num_model_layers;
    for (const auto& [role, desc] : f.roles) {
      const std::uint64_t bytes = *tensor_block_bytes(*desc, "");  // checked as the tensor was found
      const Role r = role == Role::kKey && !any_value ? Role::kLatent : role;
      ll.roles.push_back(RoleLayout{r, desc->dtype, bytes, ""});
    }
    out.push_back(std::move(ll));
  }
  auto layout = KvLayout::create(std::move(out), block_tokens);
  if (!layout.ok()) return layout.status().with_context("layout_from_name_map");
  return layout;
}

Result<BlockSpace> host_space_from_name_map(const std::map<std::string, void*>& pointers, const KvLayout& layout,
                                            std::uint64_t num_host_blocks, int rank, int device_label,
                                            int device_ordinal) {
  if (num_host_blocks == 0) return InvalidArgument("host_space_from_name_map: num_host_blocks is 0");
  std::vector<std::vector<void*>> bases(layout.num_layers());
  std::set<std::string> expected;
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l) {
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
      const RoleLayout& role = layout.layer(l).roles[r];
      std::string name = seed_tensor_name(role.role, role.name, l, rank, device_label);
      expected.insert(name);
      auto it = pointers.find(name);
      if (it == pointers.end())
        return NotFound(fmt::format("host KV pointer '{}' ({} of layer {}) is missing from the host map of {} entries",
                                    name, role_name(role.role), l, pointers.size()));
      if (it->second == nullptr) return InvalidArgument(fmt::format("host KV pointer '{}' is null", name));
      bases[l].push_back(it->second);
    }
  }
  for (const auto& [n, ptr] : pointers) {
    std::string p;
    std::uint32_t tl;
    int tr, td;
    if (parse_seed_name(n, p, tl, tr, td) && tr == rank && td == device_label && !expected.count(n))
      return InvalidArgument(
          fmt::format("host KV pointer '{}' is in the host map but not in the layout ({})", n, layout.describe()));
  }
  auto space =
      BlockSpace::layer_first(MemoryKind::kPinnedHost, device_ordinal, layout, num_host_blocks, std::move(bases));
  if (!space.ok()) return space.status().with_context("host_space_from_name_map");
  return space;
}

Result<KvCacheRegistration> registration_from_name_map(const std::map<std::string, TensorDesc>& device_tensors,
                                                       const std::map<std::string, void*>* host_pointers,
                                                       std::uint64_t num_host_blocks, const KvLayout& layout, int rank,
                                                       int device_label, int device_ordinal) {
  KvCacheRegistration reg;
  KVTIER_ASSIGN_OR_RETURN(reg.device,
                          device_space_from_name_map(device_tensors, layout, rank, device_label, device_ordinal));
  if (num_host_blocks == 0) return InvalidArgument("registration_from_name_map: num_host_blocks is 0");
  if (host_pointers) {
    KVTIER_ASSIGN_OR_RETURN(BlockSpace hs, host_space_from_name_map(*host_pointers, layout, num_host_blocks, rank,
                                                                    device_label, device_ordinal));
    reg.host.space = std::move(hs);
  } else {
    reg.host.num_blocks = num_host_blocks;
  }
  return reg;
}

}  // namespace kvtier
