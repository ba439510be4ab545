// The replay's queue model (label cpu): queue depth follows load, look-ahead turns a queued request's
// prefix that would be evicted before its admission into hits, the model is deterministic and, without
// look-ahead, serves a timestamp-ordered trace exactly as the replay without it; bad options are a Status
// naming the value.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "sim/replay.h"

namespace kvtier::cache {
namespace {

const std::string kSample = std::string(KVTIER_SOURCE_DIR) + "/data/traces/mooncake_sample.jsonl";

// One token per block, so a request's blocks are its hash ids and none is partial.
TraceRequest req(std::uint64_t ms, std::vector<std::uint64_t> ids, std::uint64_t output) {
  TraceRequest r;
  r.timestamp_ms = ms;
  r.input_length = ids.size();
  r.output_length = output;
  r.hash_ids = std::move(ids);
  return r;
}

ReplayOptions tiny(std::uint32_t device_blocks) {
  ReplayOptions o;
  o.device_blocks = device_blocks;
  o.host_blocks = 0;
  o.policy = "lru";
  o.block_tokens = 1;
  o.block_bytes = 1;
  o.queue_model = true;
  o.prefill_tokens_per_s = 1e6;  // prefill negligible: service time is the decode
  o.decode_tokens_per_s = 1;     // one output token per simulated second
  o.max_batch = 1;
  o.check_invariants_every = 1;
  return o;
}

TEST(QueueReplay, QueueDepthFollowsLoad) {
  // Six disjoint requests one second apart, each decoding for 10 s on a single slot.
  std::vector<TraceRequest> trace;
  for (std::uint64_t i = 0; i < 6; ++i) trace.push_back(req(i * 1000, {100 + 2 * i, 101 + 2 * i}, 10));
  ReplayOptions o = tiny(64);

  o.load_factor = 1;  // arrivals every 1 s, services of 10 s: they queue
  auto busy = replay_trace(trace, o);
  ASSERT_TRUE(busy.ok()) << busy.status().to_string();
  EXPECT_GT(busy->max_queue_depth, 0u);
  EXPECT_GT(busy->mean_queue_depth, 0.0);
  EXPECT_GT(busy->mean_wait_s, 0.0);
  EXPECT_EQ(busy->requests, 6u);
  // One slot, 60 s of service back to back from t = 0.
  EXPECT_NEAR(busy->simulated_seconds, 60.0, 1e-3);

  o.load_factor = 100;  // all six arrive within 50 ms: five wait behind the first
  auto burst = replay_trace(trace, o);
  ASSERT_TRUE(burst.ok()) << burst.status().to_string();
  EXPECT_EQ(burst->max_queue_depth, 5u);
  EXPECT_GT(burst->mean_queue_depth, busy->mean_queue_depth);

  o.load_factor = 0.001;  // arrivals 1000 s apart: each finishes long before the next arrives
  auto idle = replay_trace(trace, o);
  ASSERT_TRUE(idle.ok()) << idle.status().to_string();
  EXPECT_EQ(idle->max_queue_depth, 0u);
  EXPECT_EQ(idle->mean_queue_depth, 0.0);
  EXPECT_EQ(idle->mean_wait_s, 0.0);
  EXPECT_EQ(idle->requests, 6u);

  // A larger batch absorbs the same load.
  o.load_factor = 1;
  o.max_batch = 16;
  auto wide = replay_trace(trace, o);
  ASSERT_TRUE(wide.ok()) << wide.status().to_string();
  EXPECT_EQ(wide->max_queue_depth, 0u);
}

TEST(QueueReplay, LookaheadKeepsAQueuedRequestsPrefix) {
  // Capacity 5, one slot. A (blocks 1,2) runs first; X (20) and B (10,11,12) queue behind it, then C, which
  // re-reads A's chain (1,2,3). B's admission needs 3 blocks with 2 free: without look-ahead leaf-first LRU
  // evicts A's leaf 2 (older than X's 20), so C hits only block 1; with look-ahead C, announced since it
  // arrived, protects 1 and 2, and 20 goes instead: C hits both.
  const std::vector<TraceRequest> trace = {req(0, {1, 2}, 100), req(100, {20}, 100), req(1000, {10, 11, 12}, 100),
                                           req(2000, {1, 2, 3}, 1)};
  ReplayOptions o = tiny(5);
  auto plain = replay_trace(trace, o);
  ASSERT_TRUE(plain.ok()) << plain.status().to_string();
  o.lookahead = true;
  auto ahead = replay_trace(trace, o);
  ASSERT_TRUE(ahead.ok()) << ahead.status().to_string();

  EXPECT_EQ(plain->hit_blocks(), 1u);  // C's block 1: block 2 was evicted while C waited
  EXPECT_EQ(ahead->hit_blocks(), 2u);  // C's blocks 1 and 2
  EXPECT_EQ(plain->announced_requests, 0u);
  EXPECT_EQ(ahead->announced_requests, 4u);
  EXPECT_EQ(plain->failed_admissions, 0u);
  EXPECT_EQ(ahead->failed_admissions, 0u);
  // C waited behind A, X and B in both runs.
  EXPECT_EQ(plain->max_queue_depth, 3u);
  EXPECT_EQ(ahead->max_queue_depth, 3u);

  // With the load so low that C arrives after B ran, nothing waits and nothing is announced in time:
  // look-ahead cannot help, and the two runs agree.
  o.load_factor = 0.0001;  // arrivals 1,000 s or more apart, services of 100 s
  auto idle_ahead = replay_trace(trace, o);
  ASSERT_TRUE(idle_ahead.ok()) << idle_ahead.status().to_string();
  EXPECT_EQ(idle_ahead->max_queue_depth, 0u);
  EXPECT_EQ(idle_ahead->hit_blocks(), plain->hit_blocks());
}

TEST(QueueReplay, WithoutLookaheadMatchesTheReplayInOrderAndIsDeterministic) {
  auto trace = load_mooncake_trace(kSample, 600);
  ASSERT_TRUE(trace.ok()) << trace.status().to_string();
  ReplayOptions o;
  o.device_blocks = 300;
  o.host_blocks = 0;
  auto reference = replay_trace(*trace, o);
  ASSERT_TRUE(reference.ok()) << reference.status().to_string();
  o.queue_model = true;
  o.load_factor = 2;
  auto queued = replay_trace(*trace, o);
  ASSERT_TRUE(queued.ok()) << queued.status().to_string();
  // The sample is in timestamp order and the queue is FIFO: admissions come in file order, as without it.
  EXPECT_EQ(queued->hit_blocks(), reference->hit_blocks());
  EXPECT_EQ(queued->total_blocks, reference->total_blocks);
  EXPECT_GT(queued->max_queue_depth, 0u);

  o.lookahead = true;
  auto a1 = replay_trace(*trace, o);
  auto a2 = replay_trace(*trace, o);
  ASSERT_TRUE(a1.ok() && a2.ok());
  EXPECT_EQ(a1->hit_blocks(), a2->hit_blocks());
  EXPECT_EQ(a1->max_queue_depth, a2->max_queue_depth);
  EXPECT_EQ(a1->mean_queue_depth, a2->mean_queue_depth);
  EXPECT_EQ(a1->announced_requests, trace->size());
}

TEST(QueueReplay, BadOptionsAreRefusedNamingTheValue) {
  const std::vector<TraceRequest> trace = {req(0, {1, 2}, 1)};
  auto refused = [&](const ReplayOptions& o, const std::string& needle) {
    auto r = replay_trace(trace, o);
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().to_string();
  };
  ReplayOptions o = tiny(8);
  o.load_factor = 0;
  refused(o, "load_factor 0");
  o.load_factor = -2;
  refused(o, "load_factor -2");
  o.load_factor = std::numeric_limits<double>::quiet_NaN();
  refused(o, "load_factor nan");
  o = tiny(8);
  o.prefill_tokens_per_s = -5;
  refused(o, "prefill_tokens_per_s -5");
  o = tiny(8);
  o.decode_tokens_per_s = -1;
  refused(o, "decode_tokens_per_s -1");
  o.decode_tokens_per_s = std::numeric_limits<double>::infinity();
  refused(o, "decode_tokens_per_s inf");
  o = tiny(8);
  o.max_batch = 0;
  refused(o, "max_batch 0");
  o = tiny(8);
  o.queue_model = false;
  o.lookahead = true;
  refused(o, "lookahead needs queue_model");
  // Without the queue model its options are not used, so they are not checked.
  o.lookahead = false;
  o.load_factor = 0;
  EXPECT_TRUE(replay_trace(trace, o).ok());
}

}  // namespace
}  // namespace kvtier::cache
