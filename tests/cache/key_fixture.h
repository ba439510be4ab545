// The fixed input of the golden key test, shared with the helper process.
#pragma once

#include <cstdint>
#include <numeric>
#include <vector>

#include "kvtier/cache/block_key.h"

namespace kvtier::cache::testing {

inline KeyNamespace golden_namespace() {
  KeyNamespace ns;
  ns.model_id = "meta-llama/Llama-3.1-8B@main";
  ns.layout_fingerprint = 0x0123456789abcdefull;
  ns.dtype = "bf16";
  ns.tp_rank = 1;
  ns.tp_size = 2;
  ns.block_tokens = 4;
  return ns;
}

inline std::vector<std::int32_t> golden_tokens() {
  // 3 full blocks of 4 tokens + a partial one; includes negative and large values.
  return {1, 2, 3, 4, 128000, -1, 0, 7, 65535, 65536, 2147483647, -2147483647 - 1, 9, 9};
}

}  // namespace kvtier::cache::testing
