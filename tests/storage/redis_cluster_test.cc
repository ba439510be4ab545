// Redis-specific behaviour: AUTH, reconnect after the server dropped the
// connections, and Redis Cluster redirects (ASK during a slot migration, MOVED
// after it). Needs KVTIER_TEST_REDIS(_PASSWORD) / KVTIER_TEST_REDIS_CLUSTER.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <hiredis/hiredis.h>

#include <atomic>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "kvtier/storage/redis_backend.h"
#include "storage/object_format.h"
#include "storage/storage_test_util.h"

namespace kvtier::storage {
namespace {

using testing::fill_random;
using testing::key_of;

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

struct Ctx {
  redisContext* c = nullptr;
  explicit Ctx(const std::string& node, const char* password = nullptr) {
    auto hp = parse_host_port(node);
    if (!hp.ok()) return;
    c = redisConnect(hp->first.c_str(), hp->second);
    if (c && !c->err && password) cmd("AUTH %s", password);
  }
  ~Ctx() {
    if (c) redisFree(c);
  }
  bool ok() const { return c && !c->err; }
  template <typename... A>
  std::string cmd(const char* fmt, A... a) {
    auto* r = static_cast<redisReply*>(redisCommand(c, fmt, a...));
    if (!r) return "<io error>";
    std::string s;
    if (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS || r->type == REDIS_REPLY_ERROR)
      s.assign(r->str, r->len);
    else if (r->type == REDIS_REPLY_INTEGER)
      s = std::to_string(r->integer);
    freeReplyObject(r);
    return s;
  }
};

StorageOptions unique_options(const char* tag) {
  StorageOptions o;
  o.ns = fmt::format("redis-test-{}-{:x}", tag, testing::random_salt());
  o.layout_fingerprint = 77;
  return o;
}

std::string redis_key_for(const std::string& prefix, const StorageOptions& o, const StorageKey& k) {
  return fmt::format("{}:{:016x}-{:016x}:{}", prefix, format::namespace_digest(o.ns), o.layout_fingerprint,
                     k.to_string());
}

Result<std::unique_ptr<StorageBackend>> make(const std::string& endpoint, const StorageOptions& o, RedisMode mode,
                                             const char* password, std::uint32_t workers = 2) {
  RedisBackendConfig c;
  c.endpoints = {endpoint};
  c.mode = mode;
  c.workers = workers;
  c.key_prefix = "kvtier-test";
  c.ttl_seconds = 600;
  if (password) c.password = password;
  return create_redis_backend(c, o);
}

ItemResult one(StorageBackend& b, StorageOp op, const StorageKey& k, void* p = nullptr, std::uint64_t n = 0) {
  auto r = run_batch(b, StorageBatch{op, {{k, p, n}}});
  if (!r.ok()) return {r.status(), 0};
  return (*r)[0];
}

TEST(RedisSingle, AuthIsRequiredAndChecked) {
  const char* ep = env("KVTIER_TEST_REDIS");
  const char* pw = env("KVTIER_TEST_REDIS_PASSWORD");
  if (!ep || !pw) GTEST_SKIP() << "KVTIER_TEST_REDIS and KVTIER_TEST_REDIS_PASSWORD not set";
  auto o = unique_options("auth");
  auto bad = make(ep, o, RedisMode::kSingle, "wrong-password");
  EXPECT_EQ(bad.status().code(), StatusCode::kFailedPrecondition) << bad.status().to_string();
  auto good = make(ep, o, RedisMode::kSingle, pw);
  ASSERT_TRUE(good.ok()) << good.status().to_string();
  EXPECT_EQ((*good)->name(), "redis");
  EXPECT_TRUE((*good)->caps().shared);
  // Without a password the server refuses commands: detected at create, in every mode.
  for (RedisMode mode : {RedisMode::kSingle, RedisMode::kAuto}) {
    auto none = make(ep, o, mode, nullptr);
    EXPECT_EQ(none.status().code(), StatusCode::kFailedPrecondition) << none.status().to_string();
  }
}

void reconnect_body(const std::string& ep, const char* pw, RedisMode mode, const std::vector<std::string>& nodes) {
  auto o = unique_options("reconnect");
  // One worker: each worker keeps its own connections, so with two the get could
  // run on the worker that never connected to that node and open a fresh
  // connection; the dropped one would then never be detected (CI saw that 1 in
  // ~100 runs). With one worker the get must go through the killed connection.
  auto b = make(ep, o, mode, pw, /*workers=*/1);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  std::vector<std::byte> v(50000), dst(50000);
  fill_random(v.data(), v.size(), 1);
  for (int round = 0; round < 3; ++round) {
    ASSERT_TRUE(one(**b, StorageOp::kPut, key_of(2, round), v.data(), v.size()).status.ok());
    // Drop every normal client connection on every node (ours included).
    for (const auto& n : nodes) {
      Ctx admin(n, pw);
      ASSERT_TRUE(admin.ok());
      admin.cmd("CLIENT KILL TYPE normal SKIPME yes");
    }
    ItemResult r = one(**b, StorageOp::kGet, key_of(2, round), dst.data(), dst.size());
    ASSERT_TRUE(r.status.ok()) << r.status.to_string();
    EXPECT_EQ(dst, v);
  }
  EXPECT_GE((*b)->stats().reconnects, 1u) << "a dropped connection must have been detected and replaced";
}

TEST(RedisSingle, ReconnectsAfterServerDropsConnections) {
  const char* ep = env("KVTIER_TEST_REDIS");
  if (!ep) GTEST_SKIP() << "KVTIER_TEST_REDIS not set";
  reconnect_body(ep, env("KVTIER_TEST_REDIS_PASSWORD"), RedisMode::kSingle, {ep});
}

TEST(RedisSingle, UnreachableServerIsUnavailable) {
  RedisBackendConfig c;
  c.endpoints = {"127.0.0.1:1"};
  c.connect_timeout = std::chrono::milliseconds(200);
  EXPECT_EQ(create_redis_backend(c, StorageOptions{}).status().code(), StatusCode::kUnavailable);
}

struct NodeInfo {
  std::string id, addr;
  bool master = false;
  std::vector<std::pair<int, int>> slots;
};

std::vector<NodeInfo> cluster_nodes(Ctx& c) {
  std::vector<NodeInfo> out;
  std::istringstream in(c.cmd("CLUSTER NODES"));
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    NodeInfo n;
    std::string flags, master, ping, pong, epoch, state, tok;
    ls >> n.id >> n.addr >> flags >> master >> ping >> pong >> epoch >> state;
    n.addr = n.addr.substr(0, n.addr.find('@'));
    n.master = flags.find("master") != std::string::npos;
    while (ls >> tok) {
      if (tok[0] == '[') continue;
      auto dash = tok.find('-');
      int lo = std::stoi(tok.substr(0, dash));
      int hi = dash == std::string::npos ? lo : std::stoi(tok.substr(dash + 1));
      n.slots.emplace_back(lo, hi);
    }
    if (n.master) out.push_back(n);
  }
  return out;
}

const NodeInfo* owner_of(const std::vector<NodeInfo>& nodes, int slot) {
  for (const auto& n : nodes)
    for (auto [lo, hi] : n.slots)
      if (slot >= lo && slot <= hi) return &n;
  return nullptr;
}

// Moves `slot` from `from` to `to`, migrating its keys, and announces it to every master.
void move_slot(const std::vector<NodeInfo>& nodes, int slot, const NodeInfo& from, const NodeInfo& to) {
  Ctx src(from.addr), dst(to.addr);
  dst.cmd("CLUSTER SETSLOT %d IMPORTING %s", slot, from.id.c_str());
  src.cmd("CLUSTER SETSLOT %d MIGRATING %s", slot, to.id.c_str());
  auto hp = parse_host_port(to.addr).value();
  for (int iter = 0; iter < 100; ++iter) {
    auto* r = static_cast<redisReply*>(redisCommand(src.c, "CLUSTER GETKEYSINSLOT %d 100", slot));
    if (!r || r->type != REDIS_REPLY_ARRAY || r->elements == 0) {
      if (r) freeReplyObject(r);
      break;
    }
    for (std::size_t i = 0; i < r->elements; ++i)
      src.cmd("MIGRATE %s %d %b 0 5000 REPLACE", hp.first.c_str(), hp.second, r->element[i]->str,
              static_cast<std::size_t>(r->element[i]->len));
    freeReplyObject(r);
  }
  dst.cmd("CLUSTER SETSLOT %d NODE %s", slot, to.id.c_str());
  src.cmd("CLUSTER SETSLOT %d NODE %s", slot, to.id.c_str());
  for (const auto& n : nodes) {
    Ctx c(n.addr);
    c.cmd("CLUSTER SETSLOT %d NODE %s", slot, to.id.c_str());
  }
}

class RedisClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* ep = env("KVTIER_TEST_REDIS_CLUSTER");
    if (!ep) GTEST_SKIP() << "KVTIER_TEST_REDIS_CLUSTER not set; scripts/start-test-services.sh starts a cluster";
    ep_ = ep;
    Ctx seed(ep_);
    ASSERT_TRUE(seed.ok());
    nodes_ = cluster_nodes(seed);
    ASSERT_GE(nodes_.size(), 2u) << "need a cluster with >= 2 masters";
  }
  void TearDown() override {
    if (migrating_slot_ < 0) return;
    for (const auto& n : nodes_) {
      Ctx c(n.addr);
      c.cmd("CLUSTER SETSLOT %d STABLE", migrating_slot_);
    }
  }
  std::string ep_;
  std::vector<NodeInfo> nodes_;
  int migrating_slot_ = -1;
};

TEST_F(RedisClusterTest, BatchesSpreadOverEveryMaster) {
  auto o = unique_options("spread");
  auto b = make(ep_, o, RedisMode::kAuto, nullptr);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ((*b)->name(), "redis-cluster");
  std::set<std::string> owners;
  std::vector<std::vector<std::byte>> vals(64, std::vector<std::byte>(2048));
  StorageBatch puts{StorageOp::kPut, {}};
  for (int i = 0; i < 64; ++i) {
    fill_random(vals[i].data(), vals[i].size(), i);
    puts.items.push_back({key_of(4, i), vals[i].data(), vals[i].size()});
    owners.insert(owner_of(nodes_, redis_key_slot(redis_key_for("kvtier-test", o, key_of(4, i))))->addr);
  }
  EXPECT_EQ(owners.size(), nodes_.size());
  auto r = run_batch(**b, std::move(puts));
  ASSERT_TRUE(r.ok());
  for (auto& x : *r) ASSERT_TRUE(x.status.ok()) << x.status.to_string();
  // Each key is on the master that owns its slot.
  for (int i = 0; i < 64; ++i) {
    const std::string k = redis_key_for("kvtier-test", o, key_of(4, i));
    Ctx c(owner_of(nodes_, redis_key_slot(k))->addr);
    EXPECT_EQ(c.cmd("EXISTS %s", k.c_str()), "1") << k;
  }
}

TEST_F(RedisClusterTest, FollowsAskDuringMigrationAndMovedAfterIt) {
  auto o = unique_options("redirect");
  auto b = make(ep_, o, RedisMode::kCluster, nullptr);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  const StorageKey k1 = key_of(6, 0);
  const std::string rk1 = redis_key_for("kvtier-test", o, k1);
  const int slot = redis_key_slot(rk1);
  // A second key in the same slot.
  StorageKey k2;
  for (std::uint64_t i = 1;; ++i) {
    k2 = key_of(6, i);
    if (redis_key_slot(redis_key_for("kvtier-test", o, k2)) == slot) break;
  }
  const NodeInfo* from = owner_of(nodes_, slot);
  ASSERT_NE(from, nullptr);
  const NodeInfo* to = from == &nodes_[0] ? &nodes_[1] : &nodes_[0];
  std::vector<std::byte> v1(10000), v2(20000), dst(20000);
  fill_random(v1.data(), v1.size(), 1);
  fill_random(v2.data(), v2.size(), 2);
  ASSERT_TRUE(one(**b, StorageOp::kPut, k1, v1.data(), v1.size()).status.ok());

  // Migration in progress: k1 still on `from`, new keys go to `to` through ASK.
  migrating_slot_ = slot;
  {
    Ctx src(from->addr), dst_node(to->addr);
    ASSERT_EQ(dst_node.cmd("CLUSTER SETSLOT %d IMPORTING %s", slot, from->id.c_str()), "OK");
    ASSERT_EQ(src.cmd("CLUSTER SETSLOT %d MIGRATING %s", slot, to->id.c_str()), "OK");
  }
  ASSERT_TRUE(one(**b, StorageOp::kPut, k2, v2.data(), v2.size()).status.ok());
  {
    Ctx dst_node(to->addr);
    dst_node.cmd("ASKING");
    EXPECT_EQ(dst_node.cmd("EXISTS %s", redis_key_for("kvtier-test", o, k2).c_str()), "1") << "k2 not on the target";
  }
  ItemResult r = one(**b, StorageOp::kGet, k2, dst.data(), dst.size());
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  EXPECT_EQ(std::memcmp(dst.data(), v2.data(), v2.size()), 0);
  EXPECT_EQ((*b)->stats().redirects, 2u) << "one ASK for the put and one for the get of k2";
  r = one(**b, StorageOp::kGet, k1, dst.data(), dst.size());
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  EXPECT_EQ(std::memcmp(dst.data(), v1.data(), v1.size()), 0);

  // Finish the migration: the backend's map is stale, `from` answers MOVED.
  move_slot(nodes_, slot, *from, *to);
  migrating_slot_ = -1;
  const std::uint64_t before = (*b)->stats().redirects;
  for (const StorageKey* k : {&k1, static_cast<const StorageKey*>(&k2)}) {
    r = one(**b, StorageOp::kGet, *k, dst.data(), dst.size());
    ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  }
  EXPECT_EQ((*b)->stats().redirects, before + 1) << "one MOVED, then the refreshed map routes directly";
  EXPECT_EQ(std::memcmp(dst.data(), v2.data(), v2.size()), 0);
  EXPECT_TRUE(one(**b, StorageOp::kDelete, k1).status.ok());
  EXPECT_EQ(one(**b, StorageOp::kExists, k1).status.code(), StatusCode::kNotFound);

  // Put the slot back where it was.
  Ctx seed(ep_);
  move_slot(cluster_nodes(seed), slot, *to, *from);
  r = one(**b, StorageOp::kGet, k2, dst.data(), dst.size());
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
}

// Traffic while the cluster is being operated: two threads put and get their
// own keys while a third kills every client connection and moves a slot that
// holds some of those keys back and forth (ASK during each migration, MOVED
// after it). The contract, whatever the timing:
//   - every item completes Ok or Unavailable (retryable), never anything else;
//   - a get that completes Ok returns exactly the bytes of the last put of
//     that key, or of a later put whose outcome was Unavailable (it may have
//     been applied);
//   - once the disruption ends, every key reads back such a version.
TEST_F(RedisClusterTest, TrafficDuringClientKillsAndSlotMigrationsKeepsTheContract) {
  auto o = unique_options("disrupt");
  auto b = make(ep_, o, RedisMode::kCluster, nullptr);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  constexpr int kThreads = 2, kKeysPerThread = 12, kRounds = 6;
  // Keys 0..3 of each thread share one slot, which the disruptor migrates.
  const int slot = redis_key_slot(redis_key_for("kvtier-test", o, key_of(8, 0)));
  std::vector<std::vector<StorageKey>> keys(kThreads);
  for (std::uint64_t i = 0, in_slot = 0, other = 0; in_slot < 4 * kThreads || other < 8 * kThreads; ++i) {
    const StorageKey k = key_of(8, i);
    const bool same = redis_key_slot(redis_key_for("kvtier-test", o, k)) == slot;
    if (same && in_slot < 4 * kThreads)
      keys[in_slot++ % kThreads].push_back(k);
    else if (!same && other < 8 * kThreads)
      keys[other++ % kThreads].push_back(k);
  }
  for (const auto& k : keys) ASSERT_EQ(k.size(), static_cast<std::size_t>(kKeysPerThread));
  const NodeInfo* from = owner_of(nodes_, slot);
  ASSERT_NE(from, nullptr);
  const NodeInfo* to = from == &nodes_[0] ? &nodes_[1] : &nodes_[0];
  const NodeInfo from_copy = *from, to_copy = *to;

  auto value_of = [](const StorageKey& k, int version) {
    std::vector<std::byte> v(3000 + static_cast<std::size_t>(StorageKeyHash{}(k) % 5000));
    fill_random(v.data(), v.size(), StorageKeyHash{}(k) ^ (static_cast<std::uint64_t>(version) << 48));
    return v;
  };
  std::atomic<bool> stop{false};
  std::atomic<int> violations{0}, ok_ops{0}, unavailable_ops{0};
  std::mutex log_mu;
  std::vector<std::string> log;
  auto violation = [&](std::string what) {
    ++violations;
    std::lock_guard<std::mutex> lk(log_mu);
    if (log.size() < 10) log.push_back(std::move(what));
  };
  // Per key: versions a get may legally return (last acked + later unknown).
  std::vector<std::map<std::size_t, std::set<int>>> allowed(kThreads);
  auto traffic = [&](int t) {
    std::vector<int> version(keys[t].size(), 0);
    std::vector<std::byte> dst(8192);
    for (int iter = 0; !stop.load() || iter < 2; ++iter) {
      for (std::size_t i = 0; i < keys[t].size(); ++i) {
        const StorageKey& k = keys[t][i];
        const int ver = ++version[i];
        auto v = value_of(k, ver);
        ItemResult p = one(**b, StorageOp::kPut, k, v.data(), v.size());
        if (p.status.ok()) {
          ++ok_ops;
          allowed[t][i] = {ver};
        } else if (p.status.code() == StatusCode::kUnavailable) {
          ++unavailable_ops;
          allowed[t][i].insert(ver);
        } else {
          violation(fmt::format("put {}: {}", k.to_string(), p.status.to_string()));
        }
        ItemResult g = one(**b, StorageOp::kGet, k, dst.data(), dst.size());
        if (g.status.code() == StatusCode::kUnavailable) {
          ++unavailable_ops;
          continue;
        }
        if (!g.status.ok()) {
          if (!allowed[t][i].empty()) violation(fmt::format("get {}: {}", k.to_string(), g.status.to_string()));
          continue;
        }
        ++ok_ops;
        bool match = false;
        for (int a : allowed[t][i]) {
          auto want = value_of(k, a);
          match |= g.bytes == want.size() && std::memcmp(dst.data(), want.data(), want.size()) == 0;
        }
        if (!match) violation(fmt::format("get {}: bytes of no version put", k.to_string()));
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(traffic, t);
  migrating_slot_ = slot;
  for (int round = 0; round < kRounds; ++round) {
    for (const auto& n : nodes_) {
      Ctx admin(n.addr);
      admin.cmd("CLIENT KILL TYPE normal SKIPME yes");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    Ctx seed(ep_);
    const auto nodes = cluster_nodes(seed);
    if (round % 2 == 0)
      move_slot(nodes, slot, from_copy, to_copy);
    else
      move_slot(nodes, slot, to_copy, from_copy);
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  }
  migrating_slot_ = -1;
  stop = true;
  for (auto& th : threads) th.join();
  EXPECT_EQ(violations.load(), 0) << fmt::format("{}", fmt::join(log, "\n"));
  EXPECT_GT(ok_ops.load(), 0);
  // After the disruption every key reads back a version it may hold.
  std::vector<std::byte> dst(8192);
  for (int t = 0; t < kThreads; ++t)
    for (std::size_t i = 0; i < keys[t].size(); ++i) {
      ItemResult g = one(**b, StorageOp::kGet, keys[t][i], dst.data(), dst.size());
      ASSERT_TRUE(g.status.ok()) << keys[t][i].to_string() << ": " << g.status.to_string();
      bool match = false;
      for (int a : allowed[t][i]) {
        auto want = value_of(keys[t][i], a);
        match |= g.bytes == want.size() && std::memcmp(dst.data(), want.data(), want.size()) == 0;
      }
      EXPECT_TRUE(match) << keys[t][i].to_string();
    }
  RecordProperty("ok_ops", ok_ops.load());
  RecordProperty("unavailable_ops", unavailable_ops.load());
  std::printf("ok ops %d, unavailable %d, reconnects %llu, redirects %llu\n", ok_ops.load(), unavailable_ops.load(),
              static_cast<unsigned long long>((*b)->stats().reconnects),
              static_cast<unsigned long long>((*b)->stats().redirects));
}

TEST_F(RedisClusterTest, ReconnectsAfterNodesDropConnections) {
  std::vector<std::string> addrs;
  for (const auto& n : nodes_) addrs.push_back(n.addr);
  reconnect_body(ep_, nullptr, RedisMode::kCluster, addrs);
}

}  // namespace
}  // namespace kvtier::storage
