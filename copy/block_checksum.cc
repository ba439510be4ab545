// CPU reference of the block checksum the SM kernel computes (copy_engine.h: block_checksum()).
#include <fmt/format.h>

#include <cstring>

#include "copy/kernel_plan.h"
#include "kvtier/copy/copy_engine.h"

namespace kvtier {

Result<std::uint64_t> block_checksum(const BlockSpace& space, BlockId block, std::span<const std::uint32_t> layers,
                                     RoleMask roles) {
  const KvLayout& layout = space.layout();
  if (block >= space.num_blocks())
    return OutOfRange(fmt::format("block_checksum: block {} of a space of {} blocks", block, space.num_blocks()));
  for (std::uint32_t l : layers)
    if (l >= layout.num_layers())
      return OutOfRange(fmt::format("block_checksum: layer {} of a layout of {} layers", l, layout.num_layers()));
  std::uint64_t sum = 0;
  std::uint32_t plane_index = 0;
  auto fold_layer = [&](std::uint32_t l) {
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
      if (!(roles & role_bit(layout.layer(l).roles[r].role))) continue;
      const auto* p = reinterpret_cast<const unsigned char*>(space.block_ptr(l, r, block));
      const std::uint64_t bytes = layout.block_bytes(l, r);
      for (std::uint64_t o = 0; o < bytes; o += 16) {
        std::uint64_t half[2] = {0, 0};
        std::memcpy(half, p + o, bytes - o < 16 ? bytes - o : 16);
        sum += copy_detail::checksum_word(half[0], half[1], copy_detail::checksum_position(plane_index, o));
      }
      ++plane_index;
    }
  };
  if (layers.empty())
    for (std::uint32_t l = 0; l < layout.num_layers(); ++l) fold_layer(l);
  else
    for (std::uint32_t l : layers) fold_layer(l);
  return sum;
}

}  // namespace kvtier
