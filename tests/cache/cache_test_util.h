#pragma once

#include <gtest/gtest.h>

#include <vector>

#include "kvtier/cache/cache_manager.h"

namespace kvtier::cache::testing {

inline KeyHasher test_hasher() {
  KeyNamespace ns;
  ns.model_id = "test-model";
  ns.block_tokens = 16;
  return *KeyHasher::create(ns);
}

inline std::vector<BlockKey> path(std::vector<std::uint64_t> ids) { return test_hasher().keys_for_ids(ids); }

inline std::unique_ptr<CacheManager> make_cache(CacheConfig cfg) {
  auto c = CacheManager::create(std::move(cfg));
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  return std::move(c).value();
}

inline CacheConfig config(std::uint32_t device, std::uint32_t host = 0, std::uint32_t storage = 0) {
  CacheConfig c;
  c.device_blocks = device;
  c.host_blocks = host;
  c.storage_blocks = storage;
  return c;
}

template <typename F>
CacheConfig with(CacheConfig c, F&& edit) {
  edit(c);
  return c;
}

inline std::vector<BlockId> dsts(const std::vector<BlockMove>& moves) {
  std::vector<BlockId> out;
  for (const auto& m : moves) out.push_back(m.dst);
  return out;
}

#define EXPECT_INVARIANTS(cache)                        \
  do {                                                  \
    ::kvtier::Status inv_ = (cache).check_invariants(); \
    EXPECT_TRUE(inv_.ok()) << inv_.to_string();         \
  } while (0)

// commit()'s outcome in a random sequence: OK, or refused because a hit block of the admission is still loading
// (what the forward computed past the hit is committed after the loads' acks).
inline bool committed_or_loading(const CacheManager& c, AdmissionId id, const Status& st) {
  if (st.ok()) return true;
  auto as = c.admission_status(id);
  return st.code() == StatusCode::kFailedPrecondition && as.ok() && as->loading_blocks > 0;
}

}  // namespace kvtier::cache::testing
