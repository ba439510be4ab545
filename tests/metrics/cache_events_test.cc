// A subscriber rebuilds the cache manager's index from its KV events: after every step of a replay of
// the Mooncake conversation trace (its committed sample), the set of (block, medium) built from the
// events, sent through the msgpack wire format, equals CacheManager::cached_blocks().
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "kvtier/cache/block_key.h"
#include "kvtier/cache/cache_manager.h"
#include "kvtier/metrics/kv_events.h"
#include "kvtier/metrics/registry.h"
#include "sim/replay.h"

namespace kvtier::cache {
namespace {

using metrics::BlockHash;
using metrics::Medium;
using Entry = std::pair<BlockHash, Medium>;

const std::string kTrace = std::string(KVTIER_SOURCE_DIR) + "/data/traces/mooncake_sample.jsonl";

Medium medium_of(Tier t) {
  return t == Tier::kDevice ? Medium::kGpu : t == Tier::kHost ? Medium::kCpu : Medium::kRemote;
}

class Subscriber {
 public:
  // Applies one batch as received over the wire; fails the test on an event that contradicts the state.
  void apply(const std::string& wire, std::uint64_t seq) {
    ASSERT_EQ(seq, next_seq_);
    ++next_seq_;
    auto batch = metrics::decode_msgpack(wire);
    ASSERT_TRUE(batch.ok()) << batch.status().to_string();
    for (const metrics::KvEvent& ev : batch->events) {
      if (const auto* s = std::get_if<metrics::BlockStored>(&ev)) {
        ASSERT_TRUE(s->medium.has_value());
        EXPECT_EQ(s->block_size, 512u);
        for (const BlockHash& h : s->block_hashes) EXPECT_TRUE(set_.insert({h, *s->medium}).second) << "stored twice";
        ++stored_;
      } else if (const auto* r = std::get_if<metrics::BlockRemoved>(&ev)) {
        ASSERT_TRUE(r->medium.has_value());
        for (const BlockHash& h : r->block_hashes) EXPECT_EQ(set_.erase({h, *r->medium}), 1u) << "removed unknown";
        ++removed_;
      } else {
        ASSERT_TRUE(std::holds_alternative<metrics::AllBlocksCleared>(ev));
        set_.clear();
        ++cleared_;
      }
    }
  }
  const std::set<Entry>& set() const { return set_; }
  std::uint64_t stored() const { return stored_; }
  std::uint64_t removed() const { return removed_; }
  std::uint64_t cleared() const { return cleared_; }

 private:
  std::set<Entry> set_;
  std::uint64_t cleared_ = 0;
  std::uint64_t next_seq_ = 0, stored_ = 0, removed_ = 0;
};

std::set<Entry> index_of(const CacheManager& cm) {
  std::set<Entry> out;
  for (const auto& b : cm.cached_blocks()) out.insert({BlockHash{b.key.hi, b.key.lo}, medium_of(b.tier)});
  return out;
}

void check_rebuild(const std::vector<TraceRequest>& trace, CacheConfig cfg, int fail_every) {
  auto cm = CacheManager::create(cfg);
  ASSERT_TRUE(cm.ok()) << cm.status().to_string();
  CacheManager& c = **cm;
  ASSERT_TRUE(c.enable_kv_events(512, Medium::kRemote).ok());
  KeyNamespace ns;
  ns.model_id = "test/model";
  ns.block_tokens = 512;
  auto hasher = KeyHasher::create(ns);
  ASSERT_TRUE(hasher.ok());
  Subscriber sub;
  std::uint64_t seq = 0, steps = 0, acks = 0;
  std::uint64_t removed_in_index = 0, resets = 0;
  auto step = [&](const char* where, std::size_t req) {
    ++steps;
    std::vector<metrics::KvEvent> events = c.take_events();
    if (!events.empty()) {
      metrics::EventBatch b{metrics::unix_time_now(), std::move(events), std::nullopt};
      sub.apply(metrics::encode_msgpack(b), seq++);
    }
    ASSERT_EQ(sub.set(), index_of(c)) << "after " << where << " of request " << req;
  };
  // Acks a step's plan; every fail_every-th plan fails (invalidations, retries on host copies).
  auto drive = [&](std::size_t req) {
    for (int round = 0; round < 4; ++round) {
      StepPlan p = c.take_plan();
      if (p.empty()) return;
      ++acks;
      const bool fail = fail_every > 0 && acks % fail_every == 0;
      ASSERT_TRUE(c.ack_plan(p, fail ? Unavailable("injected") : Status::Ok()).ok());
      step("acks", req);
    }
  };
  for (std::size_t i = 0; i < trace.size(); ++i) {
    const TraceRequest& r = trace[i];
    const std::size_t full = std::min<std::size_t>(r.hash_ids.size(), r.input_length / 512);
    std::vector<BlockKey> keys = hasher->keys_for_ids(std::span<const std::uint64_t>(r.hash_ids.data(), full));
    if (keys.size() + 1 > cfg.device_blocks) keys.resize(cfg.device_blocks - 1);
    if (cfg.storage_blocks > 0 && c.match(keys).storage_blocks > 0) {
      ASSERT_TRUE(c.prefetch(keys).ok());
      step("prefetch", i);
      drive(i);
    }
    auto adm = c.admit(keys, 1);
    step("admit", i);
    if (!adm.ok()) {
      drive(i);
      continue;
    }
    drive(i);
    auto st = c.admission_status(adm->id);
    ASSERT_TRUE(st.ok());
    if (!st->failed) {
      ASSERT_TRUE(c.commit_all(adm->id).ok());
      step("commit", i);
    }
    ASSERT_TRUE(c.release(adm->id).ok());
    step("release", i);
    drive(i);
    // Now and then the engine resets its prefix cache: one AllBlocksCleared, and the subscriber's set empties.
    if (i % 150 == 149) {
      for (StepPlan q; !(q = c.take_plan()).empty();) ASSERT_TRUE(c.ack_plan(q, Status::Ok()).ok());
      step("acks before reset", i);
      ASSERT_TRUE(c.reset().ok());
      ++resets;
      step("reset", i);
      EXPECT_TRUE(sub.set().empty());
    }
    if (::testing::Test::HasFatalFailure()) return;
  }
  EXPECT_EQ(resets, trace.size() / 150);
  EXPECT_EQ(resets, sub.cleared());
  removed_in_index = sub.removed();
  ASSERT_TRUE(c.check_invariants().ok());
  // The replay exercised every medium and both event kinds.
  std::set<Medium> media;
  for (const auto& e : sub.set()) media.insert(e.second);
  EXPECT_GT(sub.stored(), 0u);
  EXPECT_GT(removed_in_index, 0u);
  EXPECT_TRUE(media.count(Medium::kGpu) && media.count(Medium::kCpu)) << "media seen: " << media.size();
  if (cfg.storage_blocks > 0) {
    EXPECT_TRUE(media.count(Medium::kRemote));
  }
  EXPECT_GT(steps, trace.size());
}

std::vector<TraceRequest> trace_head(std::size_t n) {
  auto t = load_mooncake_trace(kTrace, n);
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  return t.ok() ? *t : std::vector<TraceRequest>{};
}

CacheConfig three_tiers(WritePolicy w) {
  CacheConfig cfg;
  cfg.device_blocks = 96;
  cfg.host_blocks = 192;
  cfg.storage_blocks = 384;
  cfg.write_policy = w;
  return cfg;
}

TEST(CacheKvEvents, RebuildEqualsIndexEveryStepWriteBack) {
  auto trace = trace_head(400);
  ASSERT_FALSE(trace.empty());
  check_rebuild(trace, three_tiers(WritePolicy::kWriteBack), 0);
}

TEST(CacheKvEvents, RebuildEqualsIndexEveryStepWriteThroughWithFailures) {
  auto trace = trace_head(400);
  ASSERT_FALSE(trace.empty());
  check_rebuild(trace, three_tiers(WritePolicy::kWriteThrough), 7);
}

TEST(CacheKvEvents, RebuildEqualsIndexEveryStepWriteBackWithFailures) {
  auto trace = trace_head(400);
  ASSERT_FALSE(trace.empty());
  check_rebuild(trace, three_tiers(WritePolicy::kWriteBack), 5);
}

// Events a consumer refused go back in front of the manager's queue: the next take returns them first, then what
// happened since, so a publisher that refused a batch loses nothing (Python's publish_events does this).
TEST(CacheKvEvents, ReturnedEventsComeBackFirstInOrder) {
  auto cm = CacheManager::create(three_tiers(WritePolicy::kWriteThrough));
  ASSERT_TRUE(cm.ok()) << cm.status().to_string();
  ASSERT_TRUE((*cm)->enable_kv_events(512, Medium::kDisk).ok());
  KeyNamespace ns;
  ns.model_id = "test/model";
  ns.block_tokens = 512;
  auto hasher = KeyHasher::create(ns);
  auto store = [&](std::uint64_t first) {
    const std::uint64_t ids[] = {first, first + 1};
    auto keys = hasher->keys_for_ids(ids);
    auto adm = (*cm)->admit(keys, 0);
    ASSERT_TRUE(adm.ok()) << adm.status().to_string();
    ASSERT_TRUE((*cm)->commit_all(adm->id).ok());
    ASSERT_TRUE((*cm)->release(adm->id).ok());
  };
  store(100);
  std::vector<metrics::KvEvent> first = (*cm)->take_events();
  ASSERT_FALSE(first.empty());
  store(200);
  std::vector<metrics::KvEvent> second = (*cm)->take_events();
  ASSERT_FALSE(second.empty());
  (*cm)->return_events(second);  // refused later, returned first: the order is the caller's
  (*cm)->return_events(first);
  store(300);
  std::vector<metrics::KvEvent> expected = first;
  expected.insert(expected.end(), second.begin(), second.end());
  const std::vector<metrics::KvEvent> all = (*cm)->take_events();
  ASSERT_GT(all.size(), expected.size());  // the third chain's events follow
  EXPECT_TRUE(std::equal(expected.begin(), expected.end(), all.begin()));
  (*cm)->return_events({});
  EXPECT_TRUE((*cm)->take_events().empty());
}

// Enabling events on a warm cache announces what is already indexed.
TEST(CacheKvEvents, EnableOnAWarmCacheAnnouncesTheIndex) {
  CacheConfig cfg = three_tiers(WritePolicy::kWriteThrough);
  auto cm = CacheManager::create(cfg);
  ASSERT_TRUE(cm.ok());
  KeyNamespace ns;
  ns.model_id = "test/model";
  ns.block_tokens = 512;
  auto hasher = KeyHasher::create(ns);
  const std::uint64_t ids[] = {1, 2, 3, 4};
  auto keys = hasher->keys_for_ids(ids);
  auto adm = (*cm)->admit(keys, 0);
  ASSERT_TRUE(adm.ok());
  ASSERT_TRUE((*cm)->commit_all(adm->id).ok());
  ASSERT_TRUE((*cm)->release(adm->id).ok());
  EXPECT_TRUE((*cm)->take_events().empty());  // off by default
  ASSERT_TRUE((*cm)->enable_kv_events(512, Medium::kRemote).ok());
  auto ev = (*cm)->take_events();
  ASSERT_EQ(ev.size(), 1u);  // one chain, one medium: one event
  const auto& s = std::get<metrics::BlockStored>(ev[0]);
  ASSERT_EQ(s.block_hashes.size(), 4u);
  EXPECT_FALSE(s.parent_block_hash.has_value());
  for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(s.block_hashes[i], (BlockHash{keys[i].hi, keys[i].lo}));
  EXPECT_EQ(s.medium, Medium::kGpu);
  // Again with the same arguments: nothing changes (no second announcement); with another medium or block size:
  // refused, and the stream keeps its medium (a block stored on DISK was reported removed from REMOTE).
  ASSERT_TRUE((*cm)->enable_kv_events(512, Medium::kRemote).ok());
  EXPECT_TRUE((*cm)->take_events().empty());
  const Status other_medium = (*cm)->enable_kv_events(512, Medium::kDisk);
  EXPECT_EQ(other_medium.code(), StatusCode::kFailedPrecondition) << other_medium.to_string();
  EXPECT_NE(other_medium.message().find("REMOTE"), std::string::npos) << other_medium.to_string();
  EXPECT_EQ((*cm)->enable_kv_events(16, Medium::kRemote).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*cm)->enable_kv_events(0, Medium::kRemote).code(), StatusCode::kInvalidArgument);
  CacheConfig storage_only = three_tiers(WritePolicy::kWriteThrough);
  storage_only.device_blocks = 4;
  storage_only.host_blocks = 4;
  storage_only.storage_blocks = 16;
  auto st = CacheManager::create(storage_only);
  ASSERT_TRUE(st.ok()) << st.status().to_string();
  ASSERT_TRUE((*st)->enable_kv_events(512, Medium::kRemote).ok());
  EXPECT_FALSE((*st)->enable_kv_events(512, Medium::kDisk).ok());
  for (std::uint64_t round = 0; round < 3; ++round) {
    const std::uint64_t chain[] = {100 + round, 200 + round, 300 + round, 400 + round};
    auto a = (*st)->admit(hasher->keys_for_ids(chain), 0);
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    for (int r = 0; r < 4; ++r) {
      StepPlan p = (*st)->take_plan();
      if (p.empty()) break;
      ASSERT_TRUE((*st)->ack_plan(p, Status::Ok()).ok());
    }
    ASSERT_TRUE((*st)->commit_all(a->id).ok());
    ASSERT_TRUE((*st)->release(a->id).ok());
    for (int r = 0; r < 4; ++r) {
      StepPlan p = (*st)->take_plan();
      if (p.empty()) break;
      ASSERT_TRUE((*st)->ack_plan(p, Status::Ok()).ok());
    }
  }
  std::size_t storage_events = 0;
  for (const auto& e : (*st)->take_events()) {
    if (const auto* stored = std::get_if<metrics::BlockStored>(&e)) {
      EXPECT_NE(stored->medium, Medium::kDisk);
      storage_events += stored->medium == Medium::kRemote;
    }
    if (const auto* removed = std::get_if<metrics::BlockRemoved>(&e)) EXPECT_NE(removed->medium, Medium::kDisk);
  }
  EXPECT_GT(storage_events, 0u) << "the write-through storage copies are announced on the medium first given";
}

// Two managers attached with the same labels add up, as their counters do (each used to overwrite the other's
// gauges at every export: a scrape showed whichever called last), and a manager that goes takes its share out.
TEST(CacheMetrics, ManagersWithTheSameLabelsAddUpAndLeaveWithTheirShare) {
  metrics::Registry reg;  // outlives the managers
  CacheConfig small = three_tiers(WritePolicy::kWriteBack);
  small.device_blocks = 8;
  small.host_blocks = 8;
  CacheConfig large = small;
  large.device_blocks = 32;
  large.host_blocks = 16;
  auto a = CacheManager::create(small);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE((*a)->attach_metrics(reg, {{"engine", "e0"}}).ok());
  KeyNamespace ns;
  ns.model_id = "test/model";
  ns.block_tokens = 512;
  auto hasher = KeyHasher::create(ns);
  auto admit_and_commit = [&](CacheManager& c, std::vector<std::uint64_t> ids) {
    auto adm = c.admit(hasher->keys_for_ids(ids), 0);
    ASSERT_TRUE(adm.ok()) << adm.status().to_string();
    ASSERT_TRUE(c.ack_plan(c.take_plan(), Status::Ok()).ok());
    ASSERT_TRUE(c.commit_all(adm->id).ok());
    ASSERT_TRUE(c.release(adm->id).ok());
  };
  admit_and_commit(**a, {1, 2, 3});
  auto has = [&](const std::string& line) {
    const std::string text = reg.expose();
    return text.find(line + "\n") != std::string::npos;
  };
  {
    auto b = CacheManager::create(large);
    ASSERT_TRUE(b.ok());
    ASSERT_TRUE((*b)->attach_metrics(reg, {{"engine", "e0"}}).ok());
    admit_and_commit(**b, {7, 8, 9, 10, 11});
    admit_and_commit(**a, {1, 2, 3, 4});  // a exports after b
    EXPECT_TRUE(has("kvtier_cache_pool_capacity_blocks{engine=\"e0\",tier=\"device\"} 40")) << reg.expose();
    EXPECT_TRUE(has("kvtier_cache_pool_capacity_blocks{engine=\"e0\",tier=\"host\"} 24")) << reg.expose();
    const std::uint64_t nodes = (*a)->stats().nodes + (*b)->stats().nodes;
    EXPECT_EQ(nodes, 9u);
    EXPECT_TRUE(has("kvtier_cache_index_blocks{engine=\"e0\"} " + std::to_string(nodes))) << reg.expose();
    // Both follow lrfu: the lead series counts the managers that follow each expert.
    EXPECT_TRUE(has("kvtier_cache_policy_lead{engine=\"e0\",tier=\"device\",policy=\"adaptive\",expert=\"lrfu\"} 2"))
        << reg.expose();
    EXPECT_TRUE(has("kvtier_cache_lookup_blocks_total{engine=\"e0\"} 12")) << reg.expose();
  }
  // b is gone: its share left the gauges (its counts stay in the counters, which only grow).
  EXPECT_TRUE(has("kvtier_cache_pool_capacity_blocks{engine=\"e0\",tier=\"device\"} 8")) << reg.expose();
  EXPECT_TRUE(has("kvtier_cache_index_blocks{engine=\"e0\"} " + std::to_string((*a)->stats().nodes))) << reg.expose();
  EXPECT_TRUE(has("kvtier_cache_policy_lead{engine=\"e0\",tier=\"device\",policy=\"adaptive\",expert=\"lrfu\"} 1"))
      << reg.expose();
  std::move(a).value().reset();
  EXPECT_TRUE(has("kvtier_cache_pool_capacity_blocks{engine=\"e0\",tier=\"device\"} 0")) << reg.expose();
}

}  // namespace
}  // namespace kvtier::cache

namespace kvtier::cache {
namespace {

// reset() refuses while anything is open or in flight, then empties the index with one AllBlocksCleared.
TEST(CacheReset, RefusedWhileBusyThenClearsEverythingAndKeepsCounting) {
  CacheConfig cfg = three_tiers(WritePolicy::kWriteThrough);
  cfg.device_blocks = 8;
  auto cm = CacheManager::create(cfg);
  ASSERT_TRUE(cm.ok());
  CacheManager& c = **cm;
  ASSERT_TRUE(c.enable_kv_events(512, Medium::kRemote).ok());
  KeyNamespace ns;
  ns.model_id = "test/model";
  ns.block_tokens = 512;
  auto hasher = KeyHasher::create(ns);
  const std::uint64_t ids[] = {1, 2, 3, 4, 5, 6};
  auto keys = hasher->keys_for_ids(ids);
  auto adm = c.admit(keys, 0);
  ASSERT_TRUE(adm.ok());
  ASSERT_TRUE(c.commit_all(adm->id).ok());
  Status busy = c.reset();
  EXPECT_EQ(busy.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(busy.message().find("admissions are open"), std::string::npos) << busy.to_string();
  ASSERT_TRUE(c.release(adm->id).ok());
  for (StepPlan q; !(q = c.take_plan()).empty();) ASSERT_TRUE(c.ack_plan(q, Status::Ok()).ok());
  // Moves queued by a second request (write-through backups): refused until they are acked.
  const std::uint64_t other[] = {7, 8, 9, 10, 11, 12};
  auto adm2 = c.admit(hasher->keys_for_ids(other), 0);
  ASSERT_TRUE(adm2.ok());
  ASSERT_TRUE(c.commit_all(adm2->id).ok());
  ASSERT_TRUE(c.release(adm2->id).ok());
  StepPlan p = c.take_plan();
  ASSERT_FALSE(p.empty());
  busy = c.reset();
  EXPECT_EQ(busy.code(), StatusCode::kFailedPrecondition) << busy.to_string();
  EXPECT_NE(busy.message().find("in flight"), std::string::npos) << busy.to_string();
  ASSERT_TRUE(c.ack_plan(p, Status::Ok()).ok());
  while (!(p = c.take_plan()).empty()) ASSERT_TRUE(c.ack_plan(p, Status::Ok()).ok());
  ASSERT_FALSE(c.cached_blocks().empty());
  (void)c.take_events();
  const CacheStats before = c.stats();
  ASSERT_TRUE(c.reset().ok());
  auto ev = c.take_events();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_TRUE(std::holds_alternative<metrics::AllBlocksCleared>(ev[0]));
  EXPECT_TRUE(c.cached_blocks().empty());
  const CacheStats after = c.stats();
  EXPECT_EQ(after.tiers[0].used, 0u);
  EXPECT_EQ(after.tiers[1].used, 0u);
  EXPECT_EQ(after.nodes, 0u);
  EXPECT_EQ(after.admissions, before.admissions);  // counters keep counting
  EXPECT_EQ(after.resets, 1u);
  EXPECT_EQ(c.match(keys).total(), 0u);
  ASSERT_TRUE(c.check_invariants().ok());
  // The cache works as new: a request misses, then hits.
  auto again = c.admit(keys, 0);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->new_blocks, 6u);
  EXPECT_GT(again->id, adm2->id);  // admission ids are never reused
  ASSERT_TRUE(c.commit_all(again->id).ok());
  ASSERT_TRUE(c.release(again->id).ok());
  EXPECT_EQ(c.match(keys).device_blocks, 6u);
}

// attach_metrics: the series follow stats() after every public call, without a scrape-time read.
TEST(CacheMetrics, SeriesFollowTheManagersStats) {
  CacheConfig cfg = three_tiers(WritePolicy::kWriteBack);
  cfg.device_blocks = 8;
  cfg.host_blocks = 8;
  metrics::Registry reg;  // outlives the manager, as attach_metrics requires
  auto cm = CacheManager::create(cfg);
  ASSERT_TRUE(cm.ok());
  CacheManager& c = **cm;
  ASSERT_TRUE(c.attach_metrics(reg, {{"engine", "e0"}}).ok());
  EXPECT_EQ(c.attach_metrics(reg).code(), StatusCode::kFailedPrecondition);
  KeyNamespace ns;
  ns.model_id = "test/model";
  ns.block_tokens = 512;
  auto hasher = KeyHasher::create(ns);
  for (std::uint64_t round = 0; round < 6; ++round) {
    std::vector<std::uint64_t> ids = {1, 2, 3, 10 + round, 20 + round};
    auto adm = c.admit(hasher->keys_for_ids(ids), 1);
    ASSERT_TRUE(adm.ok()) << adm.status().to_string();
    StepPlan p = c.take_plan();
    ASSERT_TRUE(c.ack_plan(p, round == 3 ? Unavailable("injected") : Status::Ok()).ok());
    auto st = c.admission_status(adm->id);
    if (st.ok() && !st->failed) {
      ASSERT_TRUE(c.commit_all(adm->id).ok());
    }
    ASSERT_TRUE(c.release(adm->id).ok());
  }
  // A refused admission (more blocks than the device has) is counted too.
  const std::uint64_t big[] = {100, 101, 102, 103, 104, 105, 106, 107, 108};
  EXPECT_EQ(c.admit(hasher->keys_for_ids(big), 0).status().code(), StatusCode::kResourceExhausted);
  const CacheStats s = c.stats();
  const std::string text = reg.expose();
  auto has = [&](const std::string& line) { return text.find(line + "\n") != std::string::npos; };
  auto num = [](std::uint64_t v) { return std::to_string(v); };
  EXPECT_TRUE(has("kvtier_cache_lookup_blocks_total{engine=\"e0\"} " + num(s.lookup_blocks))) << text;
  EXPECT_EQ(s.lookup_blocks, 30u);
  EXPECT_GT(s.hit_blocks[0], 0u);
  EXPECT_TRUE(has("kvtier_cache_hit_blocks_total{engine=\"e0\",tier=\"device\"} " + num(s.hit_blocks[0]))) << text;
  EXPECT_TRUE(has("kvtier_cache_hit_blocks_total{engine=\"e0\",tier=\"host\"} " + num(s.hit_blocks[1]))) << text;
  EXPECT_TRUE(has("kvtier_cache_miss_blocks_total{engine=\"e0\"} " +
                  num(s.lookup_blocks - s.hit_blocks[0] - s.hit_blocks[1] - s.hit_blocks[2])))
      << text;
  EXPECT_TRUE(has("kvtier_cache_admissions_total{engine=\"e0\"} " + num(s.admissions))) << text;
  EXPECT_TRUE(has("kvtier_cache_admission_refusals_total{engine=\"e0\"} " + num(s.admission_failures))) << text;
  EXPECT_EQ(s.admission_failures, 1u);
  EXPECT_GT(s.evictions_d2h, 0u);
  EXPECT_TRUE(has("kvtier_cache_evictions_total{engine=\"e0\",tier=\"device\",policy=\"" + cfg.device_policy +
                  "\",action=\"moved\"} " + num(s.evictions_d2h)))
      << text;
  EXPECT_GT(s.failed_transfers, 0u);
  EXPECT_TRUE(has("kvtier_cache_failed_transfers_total{engine=\"e0\"} " + num(s.failed_transfers))) << text;
  EXPECT_TRUE(has("kvtier_cache_moves_total{engine=\"e0\",kind=\"load\"} " + num(s.loads_h2d))) << text;
  EXPECT_TRUE(has("kvtier_cache_pool_used_blocks{engine=\"e0\",tier=\"device\"} " + num(s.tiers[0].used))) << text;
  EXPECT_TRUE(has("kvtier_cache_pool_capacity_blocks{engine=\"e0\",tier=\"host\"} 8")) << text;
  EXPECT_TRUE(has("kvtier_cache_index_blocks{engine=\"e0\"} " + num(s.nodes))) << text;
  // The device tier's duel: a 0/1 series per expert for the one that leads, and its lead changes; the host tier's
  // lru is its own one expert.
  ASSERT_EQ(cfg.device_policy, "adaptive");
  EXPECT_EQ(s.tiers[0].policy_expert, 0u);  // lrfu: a few dozen accesses are no window
  EXPECT_TRUE(has("kvtier_cache_policy_lead{engine=\"e0\",tier=\"device\",policy=\"adaptive\",expert=\"lrfu\"} 1"))
      << text;
  EXPECT_TRUE(has("kvtier_cache_policy_lead{engine=\"e0\",tier=\"device\",policy=\"adaptive\",expert=\"arc\"} 0"))
      << text;
  EXPECT_TRUE(has("kvtier_cache_policy_lead{engine=\"e0\",tier=\"device\",policy=\"adaptive\",expert=\"lru\"} 0"))
      << text;
  EXPECT_TRUE(has("kvtier_cache_policy_switches_total{engine=\"e0\",tier=\"device\",policy=\"adaptive\"} " +
                  num(s.tiers[0].policy_switches)))
      << text;
  EXPECT_TRUE(has("kvtier_cache_policy_lead{engine=\"e0\",tier=\"host\",policy=\"" + cfg.host_policy + "\",expert=\"" +
                  cfg.host_policy + "\"} 1"))
      << text;
}

}  // namespace
}  // namespace kvtier::cache
