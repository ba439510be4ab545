// HybridCache: hybrid models' KV groups (full, sliding window, state) over one CacheManager per group. Shapes:
// Gemma-style (5 sliding-window groups + 1 full), Jamba / Qwen3-Next-style (a Mamba state group + an attention
// group), and three groups of three block sizes. Plans run through one FakePlanExecutor per group.
#include "kvtier/cache/hybrid_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "kvtier/backend/plan_executor.h"
#include "kvtier/metrics/registry.h"
#include "kvtier/testing/plan_executors.h"

namespace kvtier::cache {
namespace {

#define ASSERT_OK(expr)                                        \
  do {                                                         \
    const ::kvtier::Status st_ = (expr);                       \
    ASSERT_TRUE(st_.ok()) << #expr << ": " << st_.to_string(); \
  } while (0)

#define EXPECT_HYBRID_INVARIANTS(cache)                 \
  do {                                                  \
    ::kvtier::Status inv_ = (cache).check_invariants(); \
    EXPECT_TRUE(inv_.ok()) << inv_.to_string();         \
  } while (0)

KvGroupConfig group(std::string name, GroupKind kind, std::uint32_t block_tokens, std::uint32_t window,
                    std::uint32_t device, std::uint32_t host = 0, std::uint32_t storage = 0,
                    WritePolicy policy = WritePolicy::kWriteBack) {
  KvGroupConfig g;
  g.name = std::move(name);
  g.kind = kind;
  g.block_tokens = block_tokens;
  g.window_tokens = window;
  g.cache.device_blocks = device;
  g.cache.host_blocks = host;
  g.cache.storage_blocks = storage;
  g.cache.write_policy = policy;
  return g;
}

// Gemma-style: 5 sliding-window groups (window 1024 tokens) and 1 full-attention group, 16-token blocks.
HybridConfig gemma(std::uint32_t device = 256, std::uint32_t host = 0) {
  HybridConfig c;
  for (int i = 0; i < 5; ++i)
    c.groups.push_back(group("swa" + std::to_string(i), GroupKind::kSlidingWindow, 16, 1024, device, host));
  c.groups.push_back(group("full", GroupKind::kFull, 16, 0, device, host));
  return c;
}

// Jamba / Qwen3-Next-style: a Mamba state group (a state every 64 tokens) and an attention group (16 tokens).
HybridConfig jamba(std::uint32_t state_device = 32, std::uint32_t attn_device = 128, std::uint32_t host = 0) {
  HybridConfig c;
  c.groups.push_back(group("mamba", GroupKind::kState, 64, 0, state_device, host));
  c.groups.push_back(group("attn", GroupKind::kFull, 16, 0, attn_device, host));
  return c;
}

// Three block sizes: full (16), sliding window (32, window 128), state (64).
HybridConfig three() {
  HybridConfig c;
  c.groups.push_back(group("full", GroupKind::kFull, 16, 0, 128));
  c.groups.push_back(group("swa", GroupKind::kSlidingWindow, 32, 128, 64));
  c.groups.push_back(group("state", GroupKind::kState, 64, 0, 32));
  return c;
}

std::unique_ptr<HybridCache> make(HybridConfig c) {
  auto h = HybridCache::create(std::move(c));
  EXPECT_TRUE(h.ok()) << h.status().to_string();
  return h.ok() ? std::move(h).value() : nullptr;
}

std::vector<std::int32_t> tokens(std::uint32_t n, std::int32_t seed) {
  std::vector<std::int32_t> t(n);
  for (std::uint32_t i = 0; i < n; ++i) t[i] = seed * 100003 + static_cast<std::int32_t>(i);
  return t;
}

std::vector<std::int32_t> concat(std::vector<std::int32_t> a, const std::vector<std::int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A request's token ids and, per group, its token chain at that group's block size.
struct Prompt {
  std::vector<std::int32_t> ids;
  std::vector<std::vector<BlockKey>> chains;

  Prompt(const HybridCache& cache, std::vector<std::int32_t> t) : ids(std::move(t)) {
    for (const KvGroupConfig& g : cache.config().groups) chains.push_back(chain(g.block_tokens));
  }
  std::vector<BlockKey> chain(std::uint32_t block_tokens) const {
    KeyNamespace ns;
    ns.model_id = "hybrid-test-model";
    ns.block_tokens = block_tokens;
    return *KeyHasher::create(ns)->keys_for(ids);
  }
  HybridRequest request(std::uint32_t extra_tokens = 0) const {
    HybridRequest r;
    r.num_tokens = static_cast<std::uint32_t>(ids.size());
    r.extra_tokens = extra_tokens;
    for (const auto& c : chains) r.chains.emplace_back(c);
    return r;
  }
  // Group g's stored key of chain position i.
  BlockKey key(const HybridCache& cache, std::uint32_t g, std::uint32_t i) const {
    return group_block_key(chains[g][i], g, cache.config().groups[g].kind);
  }
};

const CacheManager& manager(const HybridCache& h, std::uint32_t g) { return **h.group_manager(g); }
std::uint32_t used(const HybridCache& h, std::uint32_t g) {
  return manager(h, g).stats().tiers[static_cast<int>(Tier::kDevice)].used;
}

// One step: the plan goes to each group's fake executor, the completions come back to their groups.
void run_plan(HybridCache& h, HybridPlanExecutor& exec) {
  HybridPlan p = h.take_plan();
  ASSERT_OK(exec.execute(p));
  std::vector<GroupCompletion> done = exec.poll();
  ASSERT_OK(h.apply_completions(done));
}

// Admit, move, compute everything, release: the request's blocks join every group's index.
HybridAdmission serve(HybridCache& h, HybridPlanExecutor& exec, const HybridRequest& r) {
  auto a = h.admit(r);
  EXPECT_TRUE(a.ok()) << a.status().to_string();
  if (!a.ok()) return {};
  run_plan(h, exec);
  EXPECT_TRUE(h.commit(a->id, r.num_tokens).ok());
  EXPECT_TRUE(h.release(a->id).ok());
  return *a;
}

struct Fakes {
  std::vector<std::unique_ptr<FakePlanExecutor>> fakes;
  std::unique_ptr<HybridPlanExecutor> exec;
  explicit Fakes(std::uint32_t groups) {
    std::vector<PlanExecutor*> ptrs;
    for (std::uint32_t g = 0; g < groups; ++g) {
      fakes.push_back(std::make_unique<FakePlanExecutor>());
      ptrs.push_back(fakes.back().get());
    }
    exec = std::make_unique<HybridPlanExecutor>(ptrs);
  }
};

std::set<std::pair<std::uint64_t, std::uint64_t>> keyset(const std::vector<BlockKey>& keys) {
  std::set<std::pair<std::uint64_t, std::uint64_t>> s;
  for (const BlockKey& k : keys) s.emplace(k.hi, k.lo);
  return s;
}

std::vector<BlockKey> cached_keys(const HybridCache& h, std::uint32_t g, Tier tier) {
  std::vector<BlockKey> out;
  for (const auto& b : manager(h, g).cached_blocks())
    if (b.tier == tier) out.push_back(b.key);
  return out;
}

TEST(HybridCache, GroupKeysAreDistinctAndNameTheGroup) {
  auto h = make(gemma());
  ASSERT_TRUE(h);
  Fakes f(h->num_groups());
  Prompt a(*h, tokens(512, 1));
  serve(*h, *f.exec, a.request());
  std::set<std::pair<std::uint64_t, std::uint64_t>> all;
  std::size_t total = 0;
  for (std::uint32_t g = 0; g < h->num_groups(); ++g) {
    std::vector<BlockKey> keys = cached_keys(*h, g, Tier::kDevice);
    EXPECT_EQ(keys.size(), 32u) << "group " << g;
    std::vector<BlockKey> want;
    for (std::uint32_t i = 0; i < 32; ++i) want.push_back(a.key(*h, g, i));
    EXPECT_EQ(keyset(keys), keyset(want)) << "group " << g;
    total += keys.size();
    all.merge(keyset(keys));
  }
  EXPECT_EQ(all.size(), total) << "two groups share a key";
  // The derivation depends on the chain key, the group and the kind, and nothing else.
  const BlockKey k = a.chains[0][0];
  EXPECT_EQ(group_block_key(k, 3, GroupKind::kFull), group_block_key(k, 3, GroupKind::kFull));
  EXPECT_NE(group_block_key(k, 3, GroupKind::kFull), group_block_key(k, 4, GroupKind::kFull));
  EXPECT_NE(group_block_key(k, 3, GroupKind::kFull), group_block_key(k, 3, GroupKind::kState));
  EXPECT_NE(group_block_key(k, 3, GroupKind::kFull), k);
  EXPECT_HYBRID_INVARIANTS(*h);
}

// Jamba-style: the attention group holds all 16 blocks of a prompt, the state group only the state saved at 128:
// a request continuing the prompt hits 128 tokens, and its attention blocks past 128 are fresh.
TEST(HybridCache, PrefixHitIsLimitedByTheWeakestGroup) {
  auto h = make(jamba());
  ASSERT_TRUE(h);
  Fakes f(h->num_groups());
  constexpr std::uint32_t kState = 0, kAttn = 1;
  Prompt a(*h, tokens(256, 1));
  HybridRequest ra = a.request();
  ra.save_states_at = {128};  // a chunked prefill saved only there
  serve(*h, *f.exec, ra);
  std::vector<BlockKey> attn_keys;
  for (std::uint32_t i = 0; i < 16; ++i) attn_keys.push_back(a.key(*h, kAttn, i));
  const std::vector<BlockId> cached_attn = manager(*h, kAttn).match(attn_keys).device_ids;
  ASSERT_EQ(cached_attn.size(), 16u);

  Prompt b(*h, concat(a.ids, tokens(64, 2)));
  auto m = h->match(b.request());
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->hit_tokens, 128u);
  EXPECT_EQ(m->limited_by, kState);
  EXPECT_EQ(m->groups[kAttn].alone_hit_tokens, 256u);
  EXPECT_EQ(m->groups[kState].alone_hit_tokens, 128u);

  auto adm = h->admit(b.request());
  ASSERT_TRUE(adm.ok()) << adm.status().to_string();
  EXPECT_EQ(adm->hit_tokens, 128u);
  const GroupAdmission& attn = adm->groups[kAttn];
  EXPECT_EQ(attn.hit_blocks, 8u);
  EXPECT_EQ(attn.new_blocks, 12u);  // positions 8..19: 8..15 are cached, but the forward recomputes them
  ASSERT_EQ(attn.device_blocks.size(), 20u);
  for (std::uint32_t i = 0; i < 8; ++i) EXPECT_EQ(attn.device_blocks[i], cached_attn[i]) << i;
  for (std::uint32_t i = 8; i < 20; ++i)
    EXPECT_EQ(std::count(cached_attn.begin(), cached_attn.end(), attn.device_blocks[i]), 0)
        << "position " << i << " would overwrite a cached block";
  const GroupAdmission& st = adm->groups[kState];
  EXPECT_EQ(st.hit_blocks, 1u);
  EXPECT_NE(st.state_in, kNoBlock);
  ASSERT_EQ(st.state_saves.size(), 1u);
  EXPECT_EQ(st.state_saves[0].tokens, 320u);
  run_plan(*h, *f.exec);
  ASSERT_OK(h->commit(adm->id, 320));
  ASSERT_OK(h->release(adm->id));
  // The recomputed copies of positions 8..15 were not indexed over the cached ones.
  EXPECT_EQ(manager(*h, kAttn).match(attn_keys).device_ids, cached_attn);
  EXPECT_HYBRID_INVARIANTS(*h);

  // Once a request (hit 128) saved the state at 256, the same prefix hits 256.
  Prompt c(*h, concat(a.ids, tokens(64, 3)));
  HybridRequest rc = c.request();
  rc.save_states_at = {256};
  EXPECT_EQ(serve(*h, *f.exec, rc).hit_tokens, 128u);
  Prompt d(*h, concat(a.ids, tokens(100, 4)));
  m = h->match(d.request());
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->hit_tokens, 256u);
  EXPECT_EQ(m->groups[kAttn].alone_hit_tokens, 256u);  // d shares 16 blocks with a
  EXPECT_EQ(m->groups[kState].alone_hit_tokens, 256u);
  EXPECT_NE(m->limited_by, kNoGroup);  // both stop below d's limit of 320
  EXPECT_HYBRID_INVARIANTS(*h);
}

// Gemma-style: a sliding-window group serves a 2048-token hit from the 64 blocks of its last 1024 tokens, with
// the blocks before them gone; it neither matches, loads nor allocates those.
TEST(HybridCache, SlidingWindowHoldsOnlyItsWindow) {
  // No host tier: evicted blocks are dropped. The full group is large enough to keep every block.
  HybridConfig cfg = gemma(/*device=*/160);
  constexpr std::uint32_t kFull = 5;
  cfg.groups[kFull].cache.device_blocks = 512;
  auto h = make(cfg);
  ASSERT_TRUE(h);
  Fakes f(h->num_groups());
  Prompt a(*h, tokens(2048, 1));
  auto adm = h->admit(a.request());
  ASSERT_TRUE(adm.ok()) << adm.status().to_string();
  for (std::uint32_t g = 0; g < 5; ++g) {
    EXPECT_EQ(adm->groups[g].first_block, 0u);
    EXPECT_EQ(adm->groups[g].new_blocks, 128u);
  }
  // Chunked commits: the window slides, the blocks it left are unpinned (evictable), the full group keeps all.
  ASSERT_OK(h->commit(adm->id, 1024));
  EXPECT_EQ(manager(*h, 0).reclaimable_device_blocks(), 0u);
  ASSERT_OK(h->commit(adm->id, 1536));
  EXPECT_EQ(manager(*h, 0).reclaimable_device_blocks(), 32u);  // blocks 0..31 end at or before 512
  ASSERT_OK(h->commit(adm->id, 2048));
  for (std::uint32_t g = 0; g < 5; ++g) EXPECT_EQ(manager(*h, g).reclaimable_device_blocks(), 64u) << g;
  EXPECT_EQ(manager(*h, kFull).reclaimable_device_blocks(), 0u);
  EXPECT_HYBRID_INVARIANTS(*h);
  ASSERT_OK(h->release(adm->id));

  // An unrelated request takes 96 blocks per group: 32 are free, the 64 least recent of a's go.
  Prompt x(*h, tokens(96 * 16, 9));
  serve(*h, *f.exec, x.request());
  for (std::uint32_t g = 0; g < 5; ++g) {
    std::uint32_t early = 0, window = 0;
    for (std::uint32_t i = 0; i < 128; ++i) {
      const BlockKey k = a.key(*h, g, i);
      (i < 64 ? early : window) += manager(*h, g).match(std::span<const BlockKey>(&k, 1)).device_blocks;
    }
    EXPECT_EQ(early, 0u) << "group " << g << ": blocks before the window are gone";
    EXPECT_EQ(window, 64u) << "group " << g;
  }
  Prompt b(*h, concat(a.ids, tokens(100, 2)));
  auto mb = h->match(b.request());
  ASSERT_TRUE(mb.ok());
  EXPECT_EQ(mb->hit_tokens, 2048u) << "the window groups serve from their last 64 blocks";
  // The window groups' pools are full: b's 7 fresh blocks per group evict. The window's blocks, the least
  // recent, are pinned first, so the evictions take x's and the hit holds.
  auto bb = h->admit(b.request());
  ASSERT_TRUE(bb.ok()) << bb.status().to_string();
  EXPECT_EQ(bb->hit_tokens, 2048u);
  for (std::uint32_t g = 0; g < 5; ++g) {
    const GroupAdmission& ga = bb->groups[g];
    EXPECT_EQ(ga.first_block, 64u);
    EXPECT_EQ(ga.hit_blocks, 64u);
    EXPECT_EQ(ga.new_blocks, 6u);
    ASSERT_EQ(ga.device_blocks.size(), 135u);  // ceil(2148 / 16)
    for (std::uint32_t i = 0; i < 64; ++i) EXPECT_EQ(ga.device_blocks[i], kNoBlock) << g << " " << i;
    for (std::uint32_t i = 64; i < 135; ++i) EXPECT_NE(ga.device_blocks[i], kNoBlock) << g << " " << i;
  }
  EXPECT_EQ(bb->groups[kFull].hit_blocks, 128u);
  ASSERT_OK(h->commit(bb->id, 2148));
  ASSERT_OK(h->release(bb->id));
  // A prefix whose window is gone is no hit: 1536 tokens need blocks 32..95, and 32..63 were dropped.
  Prompt e(*h, concat(std::vector<std::int32_t>(a.ids.begin(), a.ids.begin() + 1536), tokens(64, 3)));
  auto me = h->match(e.request());
  ASSERT_TRUE(me.ok());
  EXPECT_LT(me->hit_tokens, 1536u);
  EXPECT_EQ(me->groups[kFull].alone_hit_tokens, 1536u);
  EXPECT_NE(me->limited_by, kFull);
  EXPECT_HYBRID_INVARIANTS(*h);
}

// With a host tier: a window group's hit loads only its window's blocks.
TEST(HybridCache, SlidingWindowLoadsOnlyWindowBlocks) {
  auto h = make(gemma(/*device=*/160, /*host=*/512));
  ASSERT_TRUE(h);
  Fakes f(h->num_groups());
  constexpr std::uint32_t kFull = 5;
  Prompt a(*h, tokens(2048, 1));
  serve(*h, *f.exec, a.request());
  // A 160-block request pushes every block of a to host, in every group.
  Prompt x(*h, tokens(160 * 16, 9));
  auto ax = h->admit(x.request());
  ASSERT_TRUE(ax.ok()) << ax.status().to_string();
  HybridPlan px = h->take_plan();
  for (std::uint32_t g = 0; g < h->num_groups(); ++g) {
    // Each group's plan evicts that group's blocks (its keys, its host block ids).
    ASSERT_EQ(px.groups[g].evictions.size(), 128u) << g;
    std::vector<BlockKey> want, got;
    for (std::uint32_t i = 0; i < 128; ++i) want.push_back(a.key(*h, g, i));
    for (const BlockMove& mv : px.groups[g].evictions) got.push_back(mv.key);
    EXPECT_EQ(keyset(got), keyset(want)) << g;
  }
  ASSERT_OK(f.exec->execute(px));
  ASSERT_OK(h->apply_completions(f.exec->poll()));
  ASSERT_OK(h->commit(ax->id, 160 * 16));
  ASSERT_OK(h->release(ax->id));
  for (std::uint32_t g = 0; g < h->num_groups(); ++g) {
    EXPECT_EQ(manager(*h, g).stats().evictions_d2h, 128u) << g;
    EXPECT_EQ(cached_keys(*h, g, Tier::kHost).size(), 128u) << g;
  }

  Prompt b(*h, concat(a.ids, tokens(16, 2)));
  auto bb = h->admit(b.request());
  ASSERT_TRUE(bb.ok()) << bb.status().to_string();
  EXPECT_EQ(bb->hit_tokens, 2048u);
  HybridPlan pb = h->take_plan();
  for (std::uint32_t g = 0; g < 5; ++g) {
    EXPECT_EQ(bb->groups[g].loaded_blocks, 64u) << g;
    ASSERT_EQ(pb.groups[g].loads.size(), 64u) << g;
    std::vector<BlockKey> want, got;
    for (std::uint32_t i = 64; i < 128; ++i) want.push_back(a.key(*h, g, i));
    for (const BlockMove& mv : pb.groups[g].loads) got.push_back(mv.key);
    EXPECT_EQ(keyset(got), keyset(want)) << g;
  }
  EXPECT_EQ(pb.groups[kFull].loads.size(), 128u);
  // Not ready until every group's loads are acknowledged, each by its own group.
  auto st = h->admission_status(bb->id);
  ASSERT_TRUE(st.ok());
  EXPECT_FALSE(st->ready);
  EXPECT_EQ(st->loading_blocks, 5u * 64u + 128u);
  ASSERT_OK(h->ack_plan(kFull, pb.groups[kFull], Status::Ok()));
  st = h->admission_status(bb->id);
  EXPECT_EQ(st->loading_blocks, 5u * 64u);
  for (std::uint32_t g = 0; g < 5; ++g) ASSERT_OK(h->ack_plan(g, pb.groups[g], Status::Ok()));
  st = h->admission_status(bb->id);
  EXPECT_TRUE(st->ready);
  ASSERT_OK(h->commit(bb->id, 2064));
  ASSERT_OK(h->release(bb->id));
  EXPECT_HYBRID_INVARIANTS(*h);
}

// A state exists only at the block boundaries the forward saved: the default is the last one of the prompt.
TEST(HybridCache, StateGroupSavesOnlyAtBoundaries) {
  auto h = make(jamba());
  ASSERT_TRUE(h);
  Fakes f(h->num_groups());
  constexpr std::uint32_t kState = 0, kAttn = 1;
  Prompt a(*h, tokens(200, 1));
  auto adm = h->admit(a.request());
  ASSERT_TRUE(adm.ok()) << adm.status().to_string();
  const GroupAdmission& st = adm->groups[kState];
  EXPECT_EQ(st.state_in, kNoBlock);  // hit 0: the zero state
  ASSERT_EQ(st.state_saves.size(), 1u);
  EXPECT_EQ(st.state_saves[0].tokens, 192u);
  EXPECT_NE(st.state_work, kNoBlock);
  EXPECT_TRUE(st.device_blocks.empty());
  EXPECT_EQ(used(*h, kState), 2u);  // the save and the running state
  run_plan(*h, *f.exec);
  ASSERT_OK(h->commit(adm->id, 150));
  EXPECT_TRUE(cached_keys(*h, kState, Tier::kDevice).empty()) << "150 is no boundary the forward saved";
  ASSERT_OK(h->commit(adm->id, 200));
  ASSERT_EQ(cached_keys(*h, kState, Tier::kDevice).size(), 1u);
  EXPECT_EQ(cached_keys(*h, kState, Tier::kDevice)[0], a.key(*h, kState, 2));  // after 3 blocks of 64
  EXPECT_EQ(manager(*h, kState).reclaimable_device_blocks(), 1u) << "the saved state is not pinned by a";
  ASSERT_OK(h->release(adm->id));
  EXPECT_EQ(used(*h, kState), 1u);  // the running state went back to the pool

  // 150 tokens of a: the attention group serves 144, but there is no state at 64 or 128.
  Prompt d(*h, concat(std::vector<std::int32_t>(a.ids.begin(), a.ids.begin() + 150), tokens(50, 5)));
  auto md = h->match(d.request());
  ASSERT_TRUE(md.ok());
  EXPECT_EQ(md->hit_tokens, 0u);
  EXPECT_EQ(md->limited_by, kState);
  EXPECT_EQ(md->groups[kAttn].alone_hit_tokens, 128u);

  // a continued: hit at the saved boundary, served from the saved block.
  Prompt b(*h, concat(a.ids, tokens(100, 2)));
  HybridRequest rb = b.request();
  rb.save_states_at = {256, 300 / 64 * 64};  // chunk ends: 256, then the last boundary (256 again: refused)
  EXPECT_EQ(h->admit(rb).status().code(), StatusCode::kInvalidArgument);
  rb.save_states_at = {256};
  auto bb = h->admit(rb);
  ASSERT_TRUE(bb.ok()) << bb.status().to_string();
  EXPECT_EQ(bb->hit_tokens, 192u);
  EXPECT_EQ(bb->groups[kState].state_in, st.state_saves[0].block);
  ASSERT_EQ(bb->groups[kState].state_saves.size(), 1u);
  EXPECT_EQ(bb->groups[kState].state_saves[0].tokens, 256u);
  run_plan(*h, *f.exec);
  ASSERT_OK(h->commit(bb->id, 300));
  ASSERT_OK(h->release(bb->id));
  EXPECT_EQ(cached_keys(*h, kState, Tier::kDevice).size(), 2u);  // 192 (a) and 256 (b)

  // Several chunk boundaries saved in one admission.
  Prompt c(*h, tokens(256, 7));
  HybridRequest rc = c.request();
  rc.save_states_at = {64, 128, 256};
  auto cc = h->admit(rc);
  ASSERT_TRUE(cc.ok());
  EXPECT_EQ(cc->groups[kState].state_saves.size(), 3u);
  run_plan(*h, *f.exec);
  ASSERT_OK(h->commit(cc->id, 128));  // the first two chunks
  EXPECT_EQ(cached_keys(*h, kState, Tier::kDevice).size(), 4u);
  ASSERT_OK(h->commit(cc->id, 256));
  EXPECT_EQ(cached_keys(*h, kState, Tier::kDevice).size(), 5u);
  ASSERT_OK(h->release(cc->id));
  Prompt e(*h, concat(std::vector<std::int32_t>(c.ids.begin(), c.ids.begin() + 160), tokens(40, 8)));
  auto me = h->match(e.request());
  ASSERT_TRUE(me.ok());
  EXPECT_EQ(me->hit_tokens, 128u);
  EXPECT_HYBRID_INVARIANTS(*h);
}

TEST(HybridCache, ThreeGroupsOfThreeBlockSizes) {
  auto h = make(three());
  ASSERT_TRUE(h);
  EXPECT_EQ(h->hit_granularity(), 64u);
  Fakes f(h->num_groups());
  constexpr std::uint32_t kFull = 0, kSwa = 1, kState = 2;
  Prompt a(*h, tokens(300, 1));
  auto adm = h->admit(a.request(/*extra_tokens=*/20));
  ASSERT_TRUE(adm.ok()) << adm.status().to_string();
  EXPECT_EQ(adm->groups[kFull].device_blocks.size(), 20u);  // ceil(320 / 16): 18 keyed, 2 unkeyed
  EXPECT_EQ(adm->groups[kFull].extra_blocks, 2u);
  EXPECT_EQ(adm->groups[kSwa].device_blocks.size(), 10u);  // ceil(320 / 32): 9 keyed, 1 unkeyed
  EXPECT_EQ(adm->groups[kSwa].extra_blocks, 1u);
  EXPECT_EQ(adm->groups[kState].state_saves.size(), 1u);
  EXPECT_EQ(adm->groups[kState].state_saves[0].tokens, 256u);
  run_plan(*h, *f.exec);
  ASSERT_OK(h->commit(adm->id, 300));
  // The window (128 tokens) left the blocks ending at or before 172: positions 0..4.
  EXPECT_EQ(manager(*h, kSwa).reclaimable_device_blocks(), 5u);
  ASSERT_OK(h->commit(adm->id, 320));  // decode into the unkeyed space slides the window on
  EXPECT_EQ(manager(*h, kSwa).reclaimable_device_blocks(), 6u);
  ASSERT_OK(h->release(adm->id));

  Prompt b(*h, concat(a.ids, tokens(50, 2)));
  auto m = h->match(b.request());
  ASSERT_TRUE(m.ok());
  // full alone: 18 blocks = 288 tokens, 256 on the 64-token grid; the window and the state serve 256 too.
  EXPECT_EQ(m->hit_tokens, 256u);
  EXPECT_EQ(m->groups[kFull].alone_hit_tokens, 256u);
  auto bb = h->admit(b.request());
  ASSERT_TRUE(bb.ok());
  EXPECT_EQ(bb->groups[kFull].hit_blocks, 16u);
  EXPECT_EQ(bb->groups[kSwa].first_block, 4u);  // window [128, 256): 32-token blocks 4..7
  EXPECT_EQ(bb->groups[kSwa].hit_blocks, 4u);
  EXPECT_EQ(bb->groups[kState].hit_blocks, 1u);
  EXPECT_NE(bb->groups[kState].state_in, kNoBlock);
  run_plan(*h, *f.exec);
  ASSERT_OK(h->commit(bb->id, 350));
  ASSERT_OK(h->release(bb->id));
  // max_hit_tokens below a boundary takes the hit back a whole 64-token step.
  HybridRequest rb = b.request();
  rb.max_hit_tokens = 255;
  m = h->match(rb);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->hit_tokens, 0u) << "no state at 192 was saved";
  EXPECT_HYBRID_INVARIANTS(*h);
}

// One group's pool cannot give its blocks: nothing is admitted in any group.
TEST(HybridCache, AdmitIsAllOrNothing) {
  auto h = make(jamba(/*state_device=*/4, /*attn_device=*/64));
  ASSERT_TRUE(h);
  constexpr std::uint32_t kState = 0, kAttn = 1;
  Prompt p1(*h, tokens(128, 1)), p2(*h, tokens(128, 2)), p3(*h, tokens(128, 3));
  auto a1 = h->admit(p1.request());
  auto a2 = h->admit(p2.request());
  ASSERT_TRUE(a1.ok() && a2.ok());
  EXPECT_EQ(used(*h, kState), 4u);  // full: a save and a running state each, pinned
  const CacheStats attn_before = manager(*h, kAttn).stats();
  const CacheStats state_before = manager(*h, kState).stats();
  auto a3 = h->admit(p3.request());
  ASSERT_FALSE(a3.ok());
  EXPECT_EQ(a3.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(a3.status().message().find("mamba"), std::string::npos) << a3.status().to_string();
  const CacheStats attn_after = manager(*h, kAttn).stats();
  const CacheStats state_after = manager(*h, kState).stats();
  EXPECT_EQ(attn_after.tiers[0].used, attn_before.tiers[0].used);
  EXPECT_EQ(attn_after.admissions, attn_before.admissions) << "the attention group was not even tried";
  EXPECT_EQ(attn_after.nodes, attn_before.nodes);
  EXPECT_EQ(state_after.tiers[0].used, state_before.tiers[0].used);
  EXPECT_EQ(state_after.admissions, state_before.admissions);
  EXPECT_EQ(h->stats().refusals, 1u);
  EXPECT_EQ(h->stats().rollbacks, 0u);
  EXPECT_HYBRID_INVARIANTS(*h);

  // Once a request ends, its saved state is evictable and the running state free: the next one fits.
  ASSERT_OK(h->commit(a1->id, 128));
  ASSERT_OK(h->release(a1->id));
  a3 = h->admit(p3.request());
  ASSERT_TRUE(a3.ok()) << a3.status().to_string();
  ASSERT_OK(h->release(a3->id));
  ASSERT_OK(h->release(a2->id));
  EXPECT_HYBRID_INVARIANTS(*h);
}

// The pool check counts a device hit as evictable only when no open admission pins it: a request sharing a
// running request's prefix needs just its own fresh blocks.
TEST(HybridCache, SharedPrefixOfARunningRequestIsNotCountedTwice) {
  auto h = make(jamba(/*state_device=*/32, /*attn_device=*/12));
  ASSERT_TRUE(h);
  Fakes f(h->num_groups());
  constexpr std::uint32_t kAttn = 1;
  serve(*h, *f.exec, Prompt(*h, tokens(64, 1)).request());  // 4 cached, evictable attention blocks
  Prompt r1(*h, tokens(128, 2));
  auto a1 = h->admit(r1.request());
  ASSERT_TRUE(a1.ok()) << a1.status().to_string();
  ASSERT_OK(h->commit(a1->id, 128));  // r1 still runs: its 8 blocks stay pinned
  EXPECT_EQ(used(*h, kAttn), 12u);
  EXPECT_EQ(manager(*h, kAttn).reclaimable_device_blocks(), 4u);
  // r2 continues r1: 8 blocks served (pinned by r1 already), 4 fresh ones, which the 4 evictable blocks give.
  Prompt r2(*h, concat(r1.ids, tokens(64, 3)));
  auto a2 = h->admit(r2.request());
  ASSERT_TRUE(a2.ok()) << a2.status().to_string();
  EXPECT_EQ(a2->hit_tokens, 128u);
  EXPECT_EQ(a2->groups[kAttn].new_blocks, 4u);
  EXPECT_HYBRID_INVARIANTS(*h);
  // One more fresh block than evictable ones is refused, before anything is admitted.
  ASSERT_OK(h->release(a2->id));
  Prompt r3(*h, concat(r1.ids, tokens(80, 4)));
  const CacheStats before = manager(*h, 0).stats();
  auto a3 = h->admit(r3.request());
  EXPECT_EQ(a3.status().code(), StatusCode::kResourceExhausted) << a3.status().to_string();
  EXPECT_NE(a3.status().message().find("needs 5 device blocks"), std::string::npos) << a3.status().to_string();
  EXPECT_EQ(manager(*h, 0).stats().admissions, before.admissions);
  ASSERT_OK(h->release(a1->id));
  EXPECT_HYBRID_INVARIANTS(*h);
}

// A group refusing after an earlier group was admitted: the earlier one is released, nothing leaks.
TEST(HybridCache, FailedGroupReleasesTheGroupsAdmittedBefore) {
  auto h = make(jamba());
  ASSERT_TRUE(h);
  Fakes f(h->num_groups());
  constexpr std::uint32_t kState = 0, kAttn = 1;
  Prompt a(*h, tokens(128, 1));
  serve(*h, *f.exec, a.request());
  const std::uint32_t state_used = used(*h, kState), attn_used = used(*h, kAttn);
  const std::uint64_t state_admissions = manager(*h, kState).stats().admissions;
  // The attention chain of a request whose blocks are out of order: its first key is indexed below another
  // block, which the attention group's CacheManager refuses only when admitting; the state group (group 0) was
  // admitted by then.
  Prompt b(*h, concat(a.ids, tokens(64, 2)));
  HybridRequest rb = b.request();
  std::vector<BlockKey> swapped = b.chains[kAttn];
  std::swap(swapped[0], swapped[1]);
  rb.chains[kAttn] = swapped;
  auto bad = h->admit(rb);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument) << bad.status().to_string();
  EXPECT_NE(bad.status().message().find("attn"), std::string::npos) << bad.status().to_string();
  // The state group (its save at 192 and its running state) was admitted before the failure.
  EXPECT_EQ(manager(*h, kState).stats().admissions, state_admissions + 2);
  EXPECT_EQ(used(*h, kState), state_used);
  EXPECT_EQ(used(*h, kAttn), attn_used);
  EXPECT_EQ(manager(*h, kState).reclaimable_device_blocks(), state_used) << "a pin leaked";
  EXPECT_HYBRID_INVARIANTS(*h);
  // The well-formed request still works.
  auto ok = h->admit(b.request());
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_EQ(ok->hit_tokens, 128u);
  ASSERT_OK(h->release(ok->id));
  EXPECT_HYBRID_INVARIANTS(*h);
}

// Each group evicts, writes through to host and storage, and drops by its own config; the moves name the
// group's keys and its block ids.
TEST(HybridCache, EvictionsAndTierWritesPerGroup) {
  HybridConfig cfg;
  cfg.groups.push_back(group("mamba", GroupKind::kState, 64, 0, 6));  // no host: evictions drop
  cfg.groups.push_back(
      group("attn", GroupKind::kFull, 16, 0, 24, /*host=*/128, /*storage=*/128, WritePolicy::kWriteThrough));
  auto h = make(cfg);
  ASSERT_TRUE(h);
  constexpr std::uint32_t kState = 0, kAttn = 1;
  Fakes f(h->num_groups());
  std::vector<Prompt> prompts;
  std::vector<BlockKey> storage_written;
  for (int i = 0; i < 8; ++i) {
    prompts.emplace_back(*h, tokens(128, 10 + i));
    auto a = h->admit(prompts.back().request());
    ASSERT_TRUE(a.ok()) << i << ": " << a.status().to_string();
    run_plan(*h, *f.exec);
    ASSERT_OK(h->commit(a->id, 128));
    ASSERT_OK(h->release(a->id));
    // Write-through: the commit queued backups; their acks queue storage writes.
    for (int step = 0; step < 2; ++step) {
      HybridPlan p = h->take_plan();
      EXPECT_TRUE(p.groups[kState].backups.empty() && p.groups[kState].storage_writes.empty());
      for (const BlockMove& mv : p.groups[kAttn].storage_writes) storage_written.push_back(mv.key);
      ASSERT_OK(f.exec->execute(p));
      ASSERT_OK(h->apply_completions(f.exec->poll()));
    }
  }
  const CacheStats attn = manager(*h, kAttn).stats();
  const CacheStats state = manager(*h, kState).stats();
  EXPECT_EQ(attn.backups_d2h, 64u);  // 8 requests x 8 blocks
  EXPECT_EQ(attn.storage_writes, 64u);
  EXPECT_GT(attn.drops_device, 0u);  // 24 device blocks for 64: device copies backed up, so dropped
  EXPECT_EQ(state.backups_d2h, 0u);
  EXPECT_EQ(state.storage_writes, 0u);
  EXPECT_EQ(state.drops_device, 3u);  // 8 saved states, 6 device blocks, one running state at a time
  EXPECT_EQ(state.evictions_d2h, 0u);
  // The storage objects are the attention group's keys (StoragePlanExecutor names objects by them).
  std::vector<BlockKey> attn_keys;
  for (const Prompt& p : prompts)
    for (std::uint32_t i = 0; i < 8; ++i) attn_keys.push_back(p.key(*h, kAttn, i));
  EXPECT_EQ(keyset(storage_written), keyset(attn_keys));
  // A completion names its group; an unknown group is refused before anything is acknowledged.
  std::vector<GroupCompletion> stray{{kAttn, Completion{MoveKind::kLoad, {}, Status::Ok()}},
                                     {7, Completion{MoveKind::kLoad, {0}, Status::Ok()}}};
  Status s = h->apply_completions(stray);
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_NE(s.message().find("group 7"), std::string::npos) << s.to_string();
  EXPECT_HYBRID_INVARIANTS(*h);
}

// A window's host hits are admitted one key at a time. With the host tier full of them, the device block allocated
// for the first demoted a device block to host, which dropped the next planned host hit: the admission was refused
// ("retry after the plan's acks") and the prefix was gone for good (its hit fell from 16 tokens to 0).
TEST(HybridCache, AWindowServedFromAFullHostTierIsAdmittedAndKeepsItsBlocks) {
  HybridConfig c;
  c.groups.push_back(group("swa", GroupKind::kSlidingWindow, 4, 8, /*device=*/4, /*host=*/2));
  auto h = make(c);
  ASSERT_TRUE(h);
  Fakes f(1);
  Prompt a(*h, tokens(16, 1));
  serve(*h, *f.exec, a.request());
  serve(*h, *f.exec, Prompt(*h, tokens(8, 2)).request());
  serve(*h, *f.exec, Prompt(*h, tokens(8, 3)).request());  // a's window blocks (2 and 3) fill the host tier
  EXPECT_EQ(manager(*h, 0).stats().tiers[static_cast<int>(Tier::kHost)].used, 2u);
  Prompt b(*h, concat(a.ids, tokens(4, 4)));
  auto m = h->match(b.request());
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->hit_tokens, 16u);
  auto bb = h->admit(b.request());
  ASSERT_TRUE(bb.ok()) << bb.status().to_string();
  EXPECT_EQ(bb->hit_tokens, 16u);
  EXPECT_EQ(bb->groups[0].loaded_blocks, 2u);
  run_plan(*h, *f.exec);
  ASSERT_OK(h->commit(bb->id, 20));
  ASSERT_OK(h->release(bb->id));
  EXPECT_HYBRID_INVARIANTS(*h);
  auto again = h->match(b.request());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->hit_tokens, 20u - 20u % h->hit_granularity());
}

// A window of W tokens is what a token attends to, itself included (vLLM keeps cdiv(W - 1, B) blocks before a hit):
// with W = 5 and 4-token blocks, a hit of 8 tokens needs block 1 only (tokens 4..7); kvtier asked for block 0 too.
TEST(HybridCache, AWindowNeedsWhatItsFirstRecomputedTokenAttendsTo) {
  HybridConfig c;
  c.groups.push_back(group("swa", GroupKind::kSlidingWindow, 4, 5, /*device=*/8));
  auto h = make(c);
  ASSERT_TRUE(h);
  Fakes f(1);
  Prompt a(*h, tokens(12, 1));
  serve(*h, *f.exec, a.request());
  HybridRequest r = a.request();
  r.max_hit_tokens = 8;
  auto aa = h->admit(r);
  ASSERT_TRUE(aa.ok()) << aa.status().to_string();
  EXPECT_EQ(aa->hit_tokens, 8u);
  EXPECT_EQ(aa->groups[0].first_block, 1u);
  EXPECT_EQ(aa->groups[0].device_blocks[0], kNoBlock);
  ASSERT_OK(h->release(aa->id));
}

// A failed load in one group fails the admission (recompute), the group named.
TEST(HybridCache, FailedLoadFailsTheAdmission) {
  auto h = make(jamba(/*state_device=*/8, /*attn_device=*/16, /*host=*/64));
  ASSERT_TRUE(h);
  Fakes f(h->num_groups());
  constexpr std::uint32_t kAttn = 1;
  Prompt a(*h, tokens(128, 1));
  serve(*h, *f.exec, a.request());
  serve(*h, *f.exec, Prompt(*h, tokens(256, 2)).request());  // pushes a's attention blocks to host
  Prompt b(*h, concat(a.ids, tokens(16, 3)));
  auto bb = h->admit(b.request());
  ASSERT_TRUE(bb.ok()) << bb.status().to_string();
  EXPECT_EQ(bb->hit_tokens, 128u);
  EXPECT_EQ(bb->groups[kAttn].loaded_blocks, 8u);
  HybridPlan p = h->take_plan();
  // Loads in flight: a third request's hit waits on them.
  auto mc = h->match(b.request());
  ASSERT_TRUE(mc.ok());
  EXPECT_EQ(mc->hit_tokens, 0u);
  EXPECT_TRUE(mc->stopped_at_in_flight);
  EXPECT_TRUE(mc->groups[kAttn].in_flight);
  ASSERT_OK(h->ack_plan(0, p.groups[0], Status::Ok()));
  ASSERT_OK(h->ack_plan(kAttn, p.groups[kAttn], DataLoss("checksum mismatch")));
  auto st = h->admission_status(bb->id);
  ASSERT_TRUE(st.ok());
  EXPECT_TRUE(st->failed);
  EXPECT_FALSE(st->ready);
  EXPECT_EQ(st->failed_group, kAttn);
  ASSERT_OK(h->release(bb->id));
  EXPECT_HYBRID_INVARIANTS(*h);
}

// Tokens past the hit are computed on every group's hit bytes. A window group's blocks are index entries of their
// own, so a failed load there broke no chain: the blocks computed on it (and the full group's) were indexed and
// served to later requests.
TEST(HybridCache, NothingComputedOnAFailedLoadIsIndexedInAnyGroup) {
  HybridConfig c;
  c.groups.push_back(group("full", GroupKind::kFull, 16, 0, 8, 32));
  c.groups.push_back(group("swa", GroupKind::kSlidingWindow, 16, 32, 8, 32));
  auto h = make(c);
  ASSERT_TRUE(h);
  Fakes f(h->num_groups());
  constexpr std::uint32_t kSwa = 1;
  Prompt a(*h, tokens(64, 1));
  serve(*h, *f.exec, a.request());
  for (bool fail : {false, true}) {
    SCOPED_TRACE(fail ? "the window group's load fails" : "the loads land");
    serve(*h, *f.exec, Prompt(*h, tokens(128, fail ? 6 : 2)).request());  // pushes a's blocks to host
    Prompt b(*h, concat(a.ids, tokens(32, fail ? 3 : 4)));
    auto bb = h->admit(b.request());
    ASSERT_TRUE(bb.ok()) << bb.status().to_string();
    ASSERT_EQ(bb->hit_tokens, 64u);
    ASSERT_GT(bb->groups[kSwa].loaded_blocks, 0u);
    HybridPlan p = h->take_plan();
    // The forward may not index tokens past the hit while the hit is still loading.
    Status early = h->commit(bb->id, 96);
    EXPECT_EQ(early.code(), StatusCode::kFailedPrecondition) << early.to_string();
    ASSERT_OK(h->ack_plan(0, p.groups[0], Status::Ok()));
    ASSERT_OK(h->ack_plan(kSwa, p.groups[kSwa], fail ? DataLoss("checksum mismatch") : Status::Ok()));
    ASSERT_OK(h->commit(bb->id, 96));
    ASSERT_OK(h->release(bb->id));
    run_plan(*h, *f.exec);
    auto m = h->match(Prompt(*h, concat(b.ids, tokens(16, 5))).request());
    ASSERT_TRUE(m.ok());
    if (fail) {
      EXPECT_LE(m->hit_tokens, 64u) << "a's own blocks (their host copies are intact), nothing computed past them";
      for (std::uint32_t g = 0; g < 2; ++g)
        for (std::uint32_t pos : {4u, 5u})
          for (Tier t : {Tier::kDevice, Tier::kHost})
            EXPECT_EQ(keyset(cached_keys(*h, g, t)).count({b.key(*h, g, pos).hi, b.key(*h, g, pos).lo}), 0u)
                << "group " << g << " position " << pos;
    } else {
      EXPECT_EQ(m->hit_tokens, 96u);
    }
    EXPECT_HYBRID_INVARIANTS(*h);
  }
}

TEST(HybridCache, EventsAndMetricsCarryTheGroup) {
  metrics::Registry reg;  // outlives the cache, as attach_metrics requires
  auto h = make(three());
  ASSERT_TRUE(h);
  Fakes f(h->num_groups());
  ASSERT_OK(h->enable_kv_events());
  ASSERT_OK(h->attach_metrics(reg, {{"model", "m"}}));
  Prompt a(*h, tokens(256, 1));
  serve(*h, *f.exec, a.request());
  std::vector<GroupEvent> events = h->take_events();
  std::map<std::uint32_t, std::vector<BlockKey>> stored;
  for (const GroupEvent& e : events) {
    ASSERT_LT(e.group, 3u);
    const auto* bs = std::get_if<metrics::BlockStored>(&e.event);
    ASSERT_NE(bs, nullptr);
    EXPECT_EQ(bs->block_size, h->config().groups[e.group].block_tokens) << "group " << e.group;
    for (const metrics::BlockHash& x : bs->block_hashes) stored[e.group].push_back(BlockKey{x.hi, x.lo});
  }
  ASSERT_EQ(stored.size(), 3u);
  for (std::uint32_t g = 0; g < 2; ++g) {
    std::vector<BlockKey> want;
    for (std::uint32_t i = 0; i < a.chains[g].size(); ++i) want.push_back(a.key(*h, g, i));
    EXPECT_EQ(keyset(stored[g]), keyset(want)) << g;
  }
  EXPECT_EQ(keyset(stored[2]), keyset({a.key(*h, 2, 3)}));  // the state after 256 tokens
  // Metrics: every group's series, labelled.
  const std::string text = reg.expose();
  for (const char* name : {"full", "swa", "state"}) {
    bool found = false;
    std::size_t at = 0;
    while ((at = text.find("\nkvtier_cache_admissions_total{", at)) != std::string::npos) {
      const std::string line = text.substr(at + 1, text.find('\n', at + 1) - at - 1);
      found |= line.find(std::string("kv_group=\"") + name + "\"") != std::string::npos &&
               line.find("model=\"m\"") != std::string::npos;
      ++at;
    }
    EXPECT_TRUE(found) << name << "\n" << text;
  }
  EXPECT_EQ(h->attach_metrics(reg, {{"kv_group", "x"}}).code(), StatusCode::kInvalidArgument);
}

TEST(HybridCache, BadInputIsAnErrorNamingTheValue) {
  auto expect_err = [](const Status& s, StatusCode code, const std::string& needle) {
    EXPECT_EQ(s.code(), code) << s.to_string();
    EXPECT_NE(s.message().find(needle), std::string::npos) << "'" << needle << "' not in: " << s.to_string();
  };
  // Configs.
  expect_err(HybridCache::create({}).status(), StatusCode::kInvalidArgument, "no KV group");
  HybridConfig c = jamba();
  c.groups[1].block_tokens = 0;
  expect_err(HybridCache::create(c).status(), StatusCode::kInvalidArgument, "KV group 1 (\"attn\"): block_tokens 0");
  c = three();
  c.groups[1].window_tokens = 0;
  expect_err(HybridCache::create(c).status(), StatusCode::kInvalidArgument,
             "sliding-window group with window_tokens 0");
  c = three();
  c.groups[0].window_tokens = 512;
  expect_err(HybridCache::create(c).status(), StatusCode::kInvalidArgument, "window_tokens 512 on a full group");
  c = three();
  c.groups[2].name = "full";
  expect_err(HybridCache::create(c).status(), StatusCode::kInvalidArgument, "KV group 2 is named \"full\"");
  c = three();
  c.groups[1].name.clear();
  expect_err(HybridCache::create(c).status(), StatusCode::kInvalidArgument, "KV group 1 has an empty name");
  c = three();
  c.groups[2].cache.device_blocks = 0;
  expect_err(HybridCache::create(c).status(), StatusCode::kInvalidArgument, "KV group 2 (\"state\")");
  c = three();
  c.groups[0].block_tokens = 65521;  // prime, as are the next: the lcm passes 2^32
  c.groups[1].block_tokens = 65519;
  c.groups[2].block_tokens = 65497;
  expect_err(HybridCache::create(c).status(), StatusCode::kInvalidArgument, "lcm");

  // Requests.
  auto h = make(three());
  ASSERT_TRUE(h);
  Prompt a(*h, tokens(200, 1));
  HybridRequest r = a.request();
  r.chains.pop_back();
  expect_err(h->admit(r).status(), StatusCode::kInvalidArgument, "2 key chains for 3 KV groups");
  r = a.request();
  r.num_tokens = 220;  // the 32-token group wants 6 keys for 220 tokens, and has 6; the 16-token one wants 13
  expect_err(h->match(r).status(), StatusCode::kInvalidArgument,
             "KV group 0 (\"full\"): 12 chain keys for num_tokens 220 at block_tokens 16: want 13");
  r = a.request();
  r.save_states_at = {100};
  expect_err(h->admit(r).status(), StatusCode::kInvalidArgument,
             "save_states_at[0] = 100 is not a multiple of the hit granularity 64");
  r.save_states_at = {128, 160};  // 160: on the window group's 32-token grid, not on the 64-token one of hits
  expect_err(h->admit(r).status(), StatusCode::kInvalidArgument,
             "save_states_at[1] = 160 is not a multiple of the hit granularity 64");
  r.save_states_at = {256};
  expect_err(h->admit(r).status(), StatusCode::kInvalidArgument, "save_states_at[0] = 256");
  r = HybridRequest{};
  r.chains.resize(3);
  expect_err(h->admit(r).status(), StatusCode::kInvalidArgument, "nothing to admit");
  auto gem = make(gemma());
  ASSERT_TRUE(gem);
  Prompt g(*gem, tokens(64, 1));
  HybridRequest rg = g.request();
  rg.save_states_at = {64};
  expect_err(gem->admit(rg).status(), StatusCode::kInvalidArgument, "no KV group is a state group");

  // Calls.
  expect_err(h->commit(99, 10), StatusCode::kNotFound, "admission 99");
  expect_err(h->release(99), StatusCode::kNotFound, "admission 99");
  expect_err(h->admission_status(99).status(), StatusCode::kNotFound, "admission 99");
  auto adm = h->admit(a.request());
  ASSERT_TRUE(adm.ok());
  expect_err(h->commit(adm->id, 201), StatusCode::kInvalidArgument, "num_computed_tokens 201");
  expect_err(h->ack_plan(3, StepPlan{}, Status::Ok()), StatusCode::kOutOfRange, "group 3");
  expect_err(h->group_manager(3).status(), StatusCode::kOutOfRange, "group 3");
  HybridPlan wrong;
  wrong.groups.resize(2);
  expect_err(h->ack_plan(wrong, Status::Ok()), StatusCode::kInvalidArgument, "2 group plans for 3 KV groups");
  expect_err(h->reset(), StatusCode::kFailedPrecondition, "1 admission(s) open");
  FakePlanExecutor one;
  HybridPlanExecutor exec({&one, nullptr, nullptr});
  HybridPlan p = h->take_plan();
  p.groups[2].loads.push_back(BlockMove{0, 1, BlockKey{}});
  expect_err(exec.execute(p), StatusCode::kInvalidArgument, "group 2 has 1 moves and no executor");
  EXPECT_EQ(one.in_flight(), 0u) << "nothing submitted";
  ASSERT_OK(h->release(adm->id));
  ASSERT_OK(h->reset());
  EXPECT_HYBRID_INVARIANTS(*h);
}

// A group whose executor refuses its plan no longer keeps the groups after it from getting theirs (their moves were
// never submitted nor reported: in flight in their caches forever); the first error is returned.
TEST(HybridCache, EveryGroupGetsItsPlanAfterAnotherGroupsExecutorFails) {
  class Refusing final : public PlanExecutor {
   public:
    Status execute(const StepPlan&) override { return Unavailable("copy engine gone"); }
    std::vector<Completion> poll() override { return {}; }
  } refusing;
  FakePlanExecutor first, last;
  HybridPlanExecutor exec({&first, &refusing, &last});
  HybridPlan p;
  p.groups.resize(3);
  for (auto& g : p.groups) g.loads.push_back(BlockMove{0, 1, BlockKey{1, 2}});
  Status st = exec.execute(p);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("group 1"), std::string::npos) << st.to_string();
  EXPECT_EQ(first.in_flight(), 1u);
  EXPECT_EQ(last.in_flight(), 1u) << "the group after the failing one got its plan";
}

// Look-ahead: an announced request's blocks are prefetched from host in every group (the full group's chain,
// the window's blocks before the hit, the state at it, nothing else), stay through a flood of other requests
// while announced, and are left to the policies again once withdrawn.
TEST(HybridCache, AnnouncedRequestsArePrefetchedAndProtectedPerGroup) {
  HybridConfig cfg;
  cfg.groups.push_back(group("full", GroupKind::kFull, 16, 0, /*device=*/128, /*host=*/512));
  cfg.groups.push_back(group("swa", GroupKind::kSlidingWindow, 32, 64, /*device=*/64, /*host=*/512));
  cfg.groups.push_back(group("state", GroupKind::kState, 64, 0, /*device=*/8, /*host=*/128));
  auto h = make(cfg);
  ASSERT_TRUE(h);
  constexpr std::uint32_t kFullG = 0, kSwa = 1, kStateG = 2;
  Fakes f(h->num_groups());
  const Prompt a(*h, tokens(256, 1));
  serve(*h, *f.exec, a.request());
  // Others push every block of `a` off the device (write-back: to host).
  auto flood = [&](int first, int count) {
    for (int i = first; i < first + count; ++i) {
      serve(*h, *f.exec, Prompt(*h, tokens(256, 100 + i)).request());
      run_plan(*h, *f.exec);  // the evictions' acks
    }
  };
  flood(0, 12);
  auto on = [&](std::uint32_t g, std::uint32_t i, Tier t) {
    return keyset(cached_keys(*h, g, t)).count({a.key(*h, g, i).hi, a.key(*h, g, i).lo}) == 1;
  };
  for (std::uint32_t i = 0; i < 16; ++i) ASSERT_TRUE(on(kFullG, i, Tier::kHost)) << "full block " << i;
  for (std::uint32_t i = 0; i < 16; ++i) ASSERT_FALSE(on(kFullG, i, Tier::kDevice)) << "full block " << i;
  ASSERT_TRUE(on(kSwa, 6, Tier::kHost) && on(kSwa, 7, Tier::kHost) && on(kStateG, 3, Tier::kHost));

  auto q = h->announce(a.request());
  ASSERT_TRUE(q.ok()) << q.status().to_string();
  EXPECT_EQ(h->announced(), 1u);
  EXPECT_EQ(manager(*h, kFullG).stats().queued_requests, 1u);  // one chain
  EXPECT_EQ(manager(*h, kSwa).stats().queued_requests, 2u);    // one per window block
  EXPECT_EQ(manager(*h, kStateG).stats().queued_requests, 1u);
  for (int step = 0; step < 4; ++step) run_plan(*h, *f.exec);
  // The largest hit is 256 tokens: all 16 full blocks, the window's two blocks before it (positions 6 and 7
  // of 32 tokens, window 64), the state after 256 tokens (boundary 4: key position 3; the only one saved).
  for (std::uint32_t i = 0; i < 16; ++i) EXPECT_TRUE(on(kFullG, i, Tier::kDevice)) << "full block " << i;
  EXPECT_TRUE(on(kSwa, 6, Tier::kDevice) && on(kSwa, 7, Tier::kDevice));
  for (std::uint32_t i = 0; i < 6; ++i) EXPECT_FALSE(on(kSwa, i, Tier::kDevice)) << "window block " << i;
  EXPECT_TRUE(on(kStateG, 3, Tier::kDevice));
  // Protected while announced: a flood of other requests leaves them on device.
  flood(20, 12);
  for (std::uint32_t i = 0; i < 16; ++i) EXPECT_TRUE(on(kFullG, i, Tier::kDevice)) << "full block " << i;
  EXPECT_TRUE(on(kSwa, 6, Tier::kDevice) && on(kSwa, 7, Tier::kDevice) && on(kStateG, 3, Tier::kDevice));
  // Scheduled: withdrawn first, then admitted with the whole prompt served from device.
  ASSERT_OK(h->withdraw(*q));
  EXPECT_EQ(h->announced(), 0u);
  EXPECT_EQ(h->withdraw(*q).code(), StatusCode::kFailedPrecondition);  // withdrawn already (NotFound: never made)
  auto adm = h->admit(a.request());
  ASSERT_TRUE(adm.ok()) << adm.status().to_string();
  EXPECT_EQ(adm->hit_tokens, 256u);
  for (const GroupAdmission& g : adm->groups) EXPECT_EQ(g.loaded_blocks, 0u) << "group " << g.group;
  ASSERT_OK(h->release(adm->id));
  // No longer protected in any group: the policies decide again.
  for (std::uint32_t g = 0; g < h->num_groups(); ++g) {
    const CacheStats st = manager(*h, g).stats();
    EXPECT_EQ(st.queued_requests, 0u) << g;
    EXPECT_EQ(st.protected_blocks[static_cast<int>(Tier::kDevice)], 0u) << g;
    EXPECT_EQ(st.protected_blocks[static_cast<int>(Tier::kHost)], 0u) << g;
  }
  EXPECT_HYBRID_INVARIANTS(*h);
}

// Announcements of bad requests are refused naming the value, and leave nothing announced in any group.
TEST(HybridCache, BadAnnouncementsChangeNothing) {
  auto h = make(three());
  ASSERT_TRUE(h);
  const Prompt a(*h, tokens(128, 3));
  HybridRequest r = a.request();
  r.chains.pop_back();
  auto q = h->announce(r);
  EXPECT_EQ(q.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(q.status().message().find("hybrid announce"), std::string::npos) << q.status().to_string();
  r = a.request();
  r.num_tokens = 96;  // the chains are of 128 tokens
  EXPECT_EQ(h->announce(r).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(h->announced(), 0u);
  for (std::uint32_t g = 0; g < h->num_groups(); ++g) EXPECT_EQ(manager(*h, g).stats().queued_requests, 0u) << g;
  EXPECT_EQ(h->withdraw(12345).code(), StatusCode::kNotFound);
  // A request shorter than a state boundary announces no state; a hit limit below every block nothing at all.
  r = a.request();
  r.max_hit_tokens = 10;
  auto none = h->announce(r);
  ASSERT_TRUE(none.ok()) << none.status().to_string();
  for (std::uint32_t g = 0; g < h->num_groups(); ++g) EXPECT_EQ(manager(*h, g).stats().queued_requests, 0u) << g;
  ASSERT_OK(h->withdraw(*none));
  EXPECT_HYBRID_INVARIANTS(*h);
}

}  // namespace
}  // namespace kvtier::cache
