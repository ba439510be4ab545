// CacheManager's request path: create(), match(), admit(), commit(),
// release(), admission_status(), prefetch() and take_plan() (with the
// watermark evictions), stats(), and the tier and write-policy names. The
// state they work on is CacheManager::Impl (cache_manager_impl.h); eviction
// is in cache_manager_eviction.cc, the ack_*() in cache_manager_acks.cc and
// check_invariants() in cache_manager_invariants.cc.
#include "kvtier/cache/cache_manager.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "cache/cache_manager_impl.h"
#include "kvtier/core/enum_names.h"

namespace kvtier::cache {

constexpr EnumName<Tier> kTierEntries[] = {
    {Tier::kDevice, "device"},
    {Tier::kHost, "host"},
    {Tier::kStorage, "storage"},
};
constexpr auto kTierNames = enum_table("tier", kTierEntries);
std::string_view tier_name(Tier tier) noexcept { return kTierNames.name(tier); }

constexpr EnumName<WritePolicy> kWritePolicyEntries[] = {
    {WritePolicy::kWriteThrough, "write_through"},
    {WritePolicy::kWriteThroughSelective, "write_through_selective"},
    {WritePolicy::kWriteBack, "write_back"},
};
constexpr auto kWritePolicyNames = enum_table("write policy", kWritePolicyEntries);
std::string_view write_policy_name(WritePolicy policy) noexcept { return kWritePolicyNames.name(policy); }

Result<WritePolicy> parse_write_policy(std::string_view name) { return kWritePolicyNames.parse(name); }

std::uint64_t index_memory_bytes(const CacheConfig& config) noexcept {
  // sizeof(Node) plus the key index entry, an owner slot, policy links and ghost entries, rounded up.
  constexpr std::uint64_t kBytesPerBlock = 256;
  const std::uint64_t blocks = std::uint64_t{config.device_blocks} + config.host_blocks + config.storage_blocks + 1;
  return blocks * kBytesPerBlock + (std::uint64_t{1} << 26);  // + the use history (at most 2^24 slots)
}

std::uint64_t physical_memory_bytes() noexcept {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return UINT64_MAX;
  return static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page);
}

// ---- CacheManager ------------------------------------------------------------

CacheManager::CacheManager(CacheConfig config) : config_(std::move(config)), impl_(std::make_unique<Impl>()) {}
CacheManager::~CacheManager() = default;

Result<std::unique_ptr<CacheManager>> CacheManager::create(CacheConfig config) {
  if (config.device_blocks == 0) return InvalidArgument("cache config: device_blocks is 0");
  if (config.device_blocks >= kNoBlock || config.host_blocks >= kNoBlock || config.storage_blocks >= kNoBlock)
    return InvalidArgument("cache config: a tier has >= 2^32-1 blocks");
  if (config.write_through_threshold == 0) return InvalidArgument("cache config: write_through_threshold is 0");
  // A value outside the enum (a cast, an uninitialized field) planned neither evictions nor backups: blocks dropped.
  if (write_policy_name(config.write_policy) == "?")
    return InvalidArgument(
        fmt::format("cache config: write_policy {} is none of write_back, write_through, "
                    "write_through_selective",
                    static_cast<int>(config.write_policy)));
  // Storage is written from host blocks and prefetched into them: without a host tier it took no block, silently.
  if (config.storage_blocks > 0 && config.host_blocks == 0)
    return InvalidArgument(fmt::format(
        "cache config: storage_blocks {} with host_blocks 0: the storage tier is written from and prefetched into "
        "host blocks (give the host tier blocks, or storage_blocks 0)",
        config.storage_blocks));
  if (const std::uint64_t need = index_memory_bytes(config), have = physical_memory_bytes(); need > have)
    return ResourceExhausted(fmt::format(
        "cache config: device_blocks {} + host_blocks {} + storage_blocks {} need about {} MiB of index memory, the "
        "machine has {} MiB",
        config.device_blocks, config.host_blocks, config.storage_blocks, need >> 20, have >> 20));
  for (const Watermarks* w : {&config.device_watermarks, &config.host_watermarks})
    if (!(w->low >= 0 && w->high <= 1 && w->low <= w->high))  // NaN fails every comparison: refused too
      return InvalidArgument(
          fmt::format("cache config: watermarks low {} high {} must satisfy 0 <= low <= high <= 1", w->low, w->high));
  if (!(config.lookahead_max_fraction >= 0 && config.lookahead_max_fraction <= 1))
    return InvalidArgument(
        fmt::format("cache config: lookahead_max_fraction {} must be in [0, 1]", config.lookahead_max_fraction));
  std::unique_ptr<CacheManager> m(new CacheManager(config));
  KVTIER_RETURN_IF_ERROR(init_state(*m->impl_, config));
  return m;
}

// Pools, policies and an index holding only the root.
Status CacheManager::init_state(Impl& s, const CacheConfig& config) {
  s.cfg = config;
  const std::uint32_t caps[kNumTiers] = {config.device_blocks, config.host_blocks, config.storage_blocks};
  const std::string* names[kNumTiers] = {&config.device_policy, &config.host_policy, &config.storage_policy};
  for (int t = 0; t < kNumTiers; ++t) {
    s.pools[t] = BlockPool(caps[t], std::string(tier_name(static_cast<Tier>(t))));
    s.owner[t].assign(caps[t], kNoNode);
    KVTIER_ASSIGN_OR_RETURN(s.policy[t],
                            make_policy(*names[t], std::max<std::uint32_t>(caps[t], 1), config.next_use_oracle));
  }
  std::size_t expect = std::size_t{config.device_blocks} + config.host_blocks + config.storage_blocks + 1;
  s.history = std::make_unique<UseHistory>(expect * 8);
  s.nodes.reserve(expect);
  s.map.reserve(expect);
  // The root: the namespace, always "on device", never evicted.
  s.host_drop.reserve(expect);
  s.nodes.emplace_back();
  s.host_drop.push_back(0);
  for (auto& told : s.told_blocked) {
    told.reserve(expect);
    told.push_back(0);
  }
  s.nodes[0].live = true;
  s.nodes[0].counted_tier = kDev;
  return Status::Ok();
}

Status CacheManager::reset() {
  ExportOnReturn exported(*this);
  Impl& s = *impl_;
  if (!s.admissions.empty())
    return FailedPrecondition(fmt::format("reset: {} admissions are open (release them first)", s.admissions.size()));
  if (s.plan.size() != 0) return FailedPrecondition("reset: moves are queued (take_plan() and ack them first)");
  if (!s.quarantine.empty())
    return FailedPrecondition(
        fmt::format("reset: {} device blocks of failed receives are quarantined (admission {} among them): "
                    "ack_receive_reclaimable() first",
                    s.quarantined_now, s.quarantine.begin()->first));
  for (std::size_t id = 1; id < s.nodes.size(); ++id)
    if (s.nodes[id].live && s.nodes[id].state != NodeState::kSettled)
      return FailedPrecondition(
          fmt::format("reset: block {} has a move in flight (ack it first)", s.nodes[id].key.hex()));
  auto fresh = std::make_unique<Impl>();
  KVTIER_RETURN_IF_ERROR(init_state(*fresh, s.cfg));
  fresh->next_admission = s.next_admission;
  fresh->st = s.st;
  ++fresh->st.resets;
  fresh->events_on = s.events_on;
  fresh->event_block_size = s.event_block_size;
  fresh->storage_medium = s.storage_medium;
  fresh->events = std::move(s.events);
  if (fresh->events_on) fresh->events.push_back(metrics::AllBlocksCleared{});
  // The engine's queue outlives the cached blocks: announcements stay, and protect what is cached again.
  fresh->announcements = std::move(s.announcements);
  fresh->queue_order = std::move(s.queue_order);
  fresh->expiry = std::move(s.expiry);
  fresh->retained_by_conversation = std::move(s.retained_by_conversation);
  fresh->wanted_keys = std::move(s.wanted_keys);
  fresh->step = s.step;
  fresh->epoch = s.epoch + 1;
  fresh->next_queued = s.next_queued;
  // The storage tier forgets every slot: their objects go too (the drops not taken yet, and one per slot held).
  fresh->plan.storage_drops = std::move(s.plan.storage_drops);
  for (BlockId b = 0; b < s.owner[kSto].size(); ++b)
    if (const NodeId id = s.owner[kSto][b]; id != kNoNode)
      fresh->plan.storage_drops.push_back(BlockMove{b, kNoBlock, s.nodes[id].key});
  impl_ = std::move(fresh);
  return Status::Ok();
}

MatchResult CacheManager::match(std::span<const BlockKey> keys) const { return impl_->match_nodes(keys, nullptr); }

// Keys of one request are a hash chain: no key repeats, and every indexed key sits right below the
// previous one (a request's first key below the root). Anything else would pin, load or index one
// block twice.
Status CacheManager::Impl::check_chain(std::span<const BlockKey> keys, std::string_view what, NodeId prev,
                                       std::size_t first_pos) const {
  if (keys.size() > 1) {
    std::vector<std::pair<BlockKey, std::size_t>> sorted;
    sorted.reserve(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) sorted.emplace_back(keys[i], first_pos + i);
    std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) {
      return a.first.hi != b.first.hi   ? a.first.hi < b.first.hi
             : a.first.lo != b.first.lo ? a.first.lo < b.first.lo
                                        : a.second < b.second;
    });
    for (std::size_t i = 1; i < sorted.size(); ++i)
      if (sorted[i].first == sorted[i - 1].first)
        return InvalidArgument(fmt::format("{}: key {} repeats (positions {} and {}): keys must form a hash chain",
                                           what, sorted[i].first.hex(), sorted[i - 1].second, sorted[i].second));
  }
  for (std::size_t i = 0; i < keys.size(); ++i) {
    NodeId found = map.find(keys[i]);
    if (found != kNoNode && nodes[found].parent != prev) {
      const std::size_t pos = first_pos + i;
      if (pos == 0)
        return InvalidArgument(fmt::format(
            "{}: first key {} is indexed below another block, not at a request's start: keys must form a hash "
            "chain",
            what, keys[i].hex()));
      if (i == 0)
        return InvalidArgument(fmt::format(
            "{}: key {} (position {}) is indexed below another block than the chain's previous key: keys must "
            "form a hash chain",
            what, keys[i].hex(), pos));
      return InvalidArgument(fmt::format(
          "{}: key {} (position {}) is indexed below another block than key {} (position {}): keys must form a "
          "hash chain",
          what, keys[i].hex(), pos, keys[i - 1].hex(), pos - 1));
    }
    prev = found;
  }
  return Status::Ok();
}

namespace {

// admit() and admit_receive(): match (unless `match` is false) + pin + allocate + queue loads/evictions.
Result<Admission> admit_in(CacheManager::Impl& s, std::span<const BlockKey> keys, std::uint32_t extra_blocks,
                           bool match, AdmissionRec::Recv recv, std::uint32_t received_extra,
                           std::uint32_t max_hit_blocks = kNoHitLimit) {
  s.refused_for_host_room = false;
  KVTIER_RETURN_IF_ERROR(s.check_chain(keys, "admit"));
  ++s.clock;
  ++s.st.admissions;
  std::vector<NodeId> matched;
  MatchResult m = match ? s.match_nodes(keys, &matched) : MatchResult{};
  if (m.total() > max_hit_blocks) {
    // The keys past the limit are computed into fresh blocks even where a copy is cached: the caller's
    // forward pass writes them (a hybrid model's other groups served less), and a cached block may be
    // read by other requests. commit() keeps the cached copy (ours becomes its device copy only where it has
    // none) and frees ours at release().
    m.device_blocks = std::min(m.device_blocks, max_hit_blocks);
    m.host_blocks = std::min(m.host_blocks, max_hit_blocks - m.device_blocks);
    m.storage_blocks = std::min(m.storage_blocks, max_hit_blocks - m.device_blocks - m.host_blocks);
    m.stopped_at_in_flight = false;
  }
  const std::uint32_t hits = m.device_blocks + m.host_blocks;
  matched.resize(hits);  // storage hits are recomputed here (prefetch() brings them to host)
  const std::uint32_t num_keys = static_cast<std::uint32_t>(keys.size());
  const std::uint64_t need64 = std::uint64_t{m.host_blocks} + (keys.size() - hits) + extra_blocks;
  if (need64 > s.pools[kDev].capacity()) {
    ++s.st.admission_failures;
    return ResourceExhausted(
        fmt::format("admission needs {} device blocks, the device tier has {}", need64, s.pools[kDev].capacity()));
  }
  const auto need = static_cast<std::uint32_t>(need64);
  for (NodeId id : matched) s.pin(id);
  auto unpin = [&] {
    for (NodeId id : matched) s.unpin(id);
  };
  // Transactional: nothing is evicted unless enough can be, so a failed admission leaves the index,
  // the pools and the policies as they were.
  const std::uint32_t free_now = s.pools[kDev].num_free();
  if (free_now < need) {
    const std::uint32_t reclaimable = s.reclaimable_now;  // counts the pins just taken
    if (free_now + reclaimable < need) {
      unpin();
      ++s.st.admission_failures;
      return ResourceExhausted(fmt::format(
          "admission needs {} free device blocks: {} free, {} more evictable (the rest pinned or in flight)", need,
          free_now, reclaimable));
    }
  }
  if (!s.ensure_device_free(need)) {
    unpin();
    ++s.st.admission_failures;
    s.refused_for_host_room = true;
    return ResourceExhausted(fmt::format(
        "admission needs {} free device blocks, {} free: the evictable ones wait for host blocks (in flight or "
        "being written to storage)",
        need, s.pools[kDev].num_free()));
  }
  AdmissionRec rec;
  rec.keys.assign(keys.begin(), keys.end());
  rec.pos_node.assign(num_keys, kNoNode);
  rec.blocks.assign(num_keys + extra_blocks, kNoBlock);
  rec.owned.assign(num_keys + extra_blocks, 0);
  rec.pinned = matched;
  rec.hit_blocks = hits;
  rec.committed = hits;
  if (recv == AdmissionRec::Recv::kReceiving) {
    rec.recv = recv;
    rec.recv_begin = hits;
    rec.recv_end = num_keys + received_extra;
    s.st.received_blocks += rec.recv_end - rec.recv_begin;
    s.receiving_now += rec.recv_end - rec.recv_begin;
  }
  for (std::uint32_t i = 0; i < hits; ++i) {
    NodeId id = matched[i];
    Node& n = s.nodes[id];
    rec.pos_node[i] = id;
    s.history->bump(n.key);
    ++n.hits;
    if (i < m.device_blocks) {
      rec.blocks[i] = n.block[kDev];
    } else {
      BlockId db = *s.pools[kDev].allocate();  // ensured above
      s.queue_move(s.plan.loads, BlockMove{n.block[kHst], db, n.key}, n);
      s.set_block(id, kDev, db);
      n.state = NodeState::kLoading;
      s.retier(id);
      ++s.st.loads_h2d;
      rec.blocks[i] = db;
    }
  }
  // Deepest first: parents end up more recent than their children.
  for (std::uint32_t i = hits; i-- > 0;) {
    NodeId id = matched[i];
    s.track_touch(id, i < m.device_blocks ? kDev : kHst);
  }
  for (std::uint32_t i = hits; i < num_keys + extra_blocks; ++i) {
    rec.blocks[i] = *s.pools[kDev].allocate();
    rec.owned[i] = 1;
  }
  if (s.cfg.write_policy == WritePolicy::kWriteThroughSelective)
    for (std::uint32_t i = 0; i < m.device_blocks; ++i)
      if (s.nodes[matched[i]].hits >= s.cfg.write_through_threshold) s.backup(matched[i]);

  if (match) s.st.lookup_blocks += num_keys;
  s.st.hit_blocks[kDev] += m.device_blocks;
  s.st.hit_blocks[kHst] += m.host_blocks;
  s.st.hit_blocks[kSto] += m.storage_blocks;
  Admission a;
  a.id = s.next_admission++;
  a.device_hit_blocks = m.device_blocks;
  a.host_hit_blocks = m.host_blocks;
  a.storage_hit_blocks = m.storage_blocks;
  a.new_blocks = num_keys - hits;
  a.extra_blocks = extra_blocks;
  a.stopped_at_in_flight = m.stopped_at_in_flight;
  a.device_blocks = rec.blocks;
  a.receive_begin = rec.recv_begin;
  a.receive_blocks = rec.recv_end - rec.recv_begin;
  s.admissions.emplace(a.id, std::move(rec));
  return a;
}

// commit()'s indexing of key positions [rec.committed, num_computed) (checked by the caller); returns how many
// blocks joined the index.
std::uint32_t commit_in(CacheManager::Impl& s, AdmissionRec& rec, std::uint32_t num_computed) {
  using Impl = CacheManager::Impl;
  std::vector<NodeId> added;
  for (std::uint32_t pos = rec.committed; pos < num_computed; ++pos) s.history->prefetch(rec.keys[pos]);
  for (std::uint32_t pos = rec.committed; pos < num_computed; ++pos) {
    rec.committed = pos + 1;
    if (rec.chain_broken) continue;
    NodeId parent = pos == 0 ? Impl::kRoot : rec.pos_node[pos - 1];
    if (parent == kNoNode || s.nodes[parent].detached) {
      rec.chain_broken = true;
      continue;
    }
    const BlockKey& key = rec.keys[pos];
    NodeId found = s.map.find(key);
    NodeId nid;
    if (found == kNoNode) {
      nid = s.new_node(key, parent);
      std::uint32_t past = s.history->bump(key) - 1;
      s.nodes[nid].hits = parent == Impl::kRoot ? past : std::min(past, s.nodes[parent].hits);
      s.set_block(nid, kDev, rec.blocks[pos]);
      s.nodes[nid].present = bit(kDev);
      s.announce(nid);
      s.retier(nid);
      rec.owned[pos] = 0;
      added.push_back(nid);
    } else {
      nid = found;
      Node& n = s.nodes[nid];
      if (n.parent != parent) {  // a key collision or a caller mixing namespaces: do not index
        rec.chain_broken = true;
        continue;
      }
      if (n.state == NodeState::kSettled && !(n.present & bit(kDev))) {
        s.set_block(nid, kDev, rec.blocks[pos]);
        n.present |= bit(kDev);
        s.announce(nid);
        s.retier(nid);
        rec.owned[pos] = 0;
        added.push_back(nid);
      } else if (s.eventual_tier(n) != kDev) {  // in flight away from the device
        rec.chain_broken = true;
        continue;
      }
      // else: another request computed it first; ours is freed at release.
    }
    s.pin(nid);
    rec.pinned.push_back(nid);
    rec.pos_node[pos] = nid;
  }
  for (auto a = added.rbegin(); a != added.rend(); ++a) s.track_insert(*a, kDev);
  if (s.cfg.write_policy == WritePolicy::kWriteThrough)
    for (NodeId nid : added) s.backup(nid);
  return static_cast<std::uint32_t>(added.size());
}

}  // namespace

Result<Admission> CacheManager::admit(std::span<const BlockKey> keys, std::uint32_t extra_blocks,
                                      std::uint32_t max_hit_blocks, std::span<const BlockKey> hold) {
  ExportOnReturn exported(*this);
  Impl& s = *impl_;
  std::vector<NodeId> held;
  held.reserve(hold.size());
  for (const BlockKey& k : hold)
    if (const NodeId id = s.map.find(k); id != kNoNode && s.nodes[id].live && !s.nodes[id].detached) {
      s.pin(id);
      held.push_back(id);
    }
  Result<Admission> out = admit_in(s, keys, extra_blocks, /*match=*/true, AdmissionRec::Recv::kNone, 0, max_hit_blocks);
  // A refusal no ack or release can end: the device victims wait for host blocks, every host block in use is one of
  // this request's own host hits, pinned by it (no move in flight holds one), and no other admission is open or
  // quarantined (whose release would free device blocks). Served without its host hits (recomputed: their host
  // copies may then be demoted to make room) rather than refused at every retry; one admission and one refusal are
  // counted for the call.
  if (!out.ok() && s.refused_for_host_room && s.has_tier(kHst) && s.admissions.empty() && s.quarantine.empty()) {
    const MatchResult m = s.match_nodes(keys, nullptr);
    const std::uint32_t host_hits = std::min(m.host_blocks, max_hit_blocks - std::min(max_hit_blocks, m.device_blocks));
    if (host_hits > 0 && host_hits >= s.pools[kHst].num_used()) {
      --s.st.admissions;
      --s.st.admission_failures;
      Result<Admission> without_host_hits =
          admit_in(s, keys, extra_blocks, /*match=*/true, AdmissionRec::Recv::kNone, 0, m.device_blocks);
      out = std::move(without_host_hits);
    }
  }
  for (NodeId id : held) {
    s.unpin(id);
    s.reclaim_if_dead(id);
  }
  return out;
}

Result<Admission> CacheManager::admit_receive(std::span<const BlockKey> keys, const ReceiveOptions& options) {
  ExportOnReturn exported(*this);
  if (options.received_extra_blocks > options.extra_blocks)
    return InvalidArgument(fmt::format("admit_receive: received_extra_blocks {} > extra_blocks {}",
                                       options.received_extra_blocks, options.extra_blocks));
  return admit_in(*impl_, keys, options.extra_blocks, options.match_prefix, AdmissionRec::Recv::kReceiving,
                  options.received_extra_blocks);
}

Status CacheManager::commit(AdmissionId id, std::uint32_t num_computed) {
  ExportOnReturn exported(*this);
  Impl& s = *impl_;
  auto it = s.admissions.find(id);
  if (it == s.admissions.end()) return NotFound(fmt::format("commit: admission {} not found", id));
  AdmissionRec& rec = it->second;
  if (num_computed > rec.keys.size())
    return InvalidArgument(
        fmt::format("commit: num_computed {} > {} keys of admission {}", num_computed, rec.keys.size(), id));
  // A block a peer is writing (or may still write) is never reported loaded.
  const std::uint32_t guard = rec.guard_begin();
  if (num_computed > std::max(rec.committed, guard)) {
    const std::uint32_t pos = std::max(rec.committed, guard);
    if (rec.recv == AdmissionRec::Recv::kReceiving)
      return FailedPrecondition(
          fmt::format("commit: key position {} (device block {}) of admission {} is being received from a peer: "
                      "complete_receive() reports what landed",
                      pos, rec.blocks[pos], id));
    if (rec.recv == AdmissionRec::Recv::kQuarantined)
      return FailedPrecondition(
          fmt::format("commit: key position {} (device block {}) of admission {} is quarantined after a failed "
                      "receive (a late write of the peer may still land): ack_receive_reclaimable() first, or "
                      "release and admit again",
                      pos, rec.blocks[pos], id));
  }
  // What the forward computed past the hit rests on the hit's loads: committed before their acks, a block computed
  // on a load that then failed would stay indexed (in whatever tier it went to since) and be served.
  if (num_computed > std::max(rec.committed, rec.hit_blocks))
    for (std::uint32_t i = 0; i < rec.hit_blocks; ++i)
      if (s.nodes[rec.pos_node[i]].state == NodeState::kLoading) {
        std::uint32_t loading = 0;
        for (std::uint32_t j = i; j < rec.hit_blocks; ++j)
          loading += s.nodes[rec.pos_node[j]].state == NodeState::kLoading ? 1 : 0;
        return FailedPrecondition(fmt::format(
            "commit: {} hit blocks of admission {} are still loading (key position {} first): ack the loads "
            "(admission_status() ready) before committing blocks computed on them",
            loading, id, i));
      }
  commit_in(s, rec, num_computed);
  return Status::Ok();
}

Status CacheManager::commit_all(AdmissionId id) {
  auto it = impl_->admissions.find(id);
  if (it == impl_->admissions.end()) return NotFound(fmt::format("commit: admission {} not found", id));
  return commit(id, static_cast<std::uint32_t>(it->second.keys.size()));
}

Status CacheManager::release(AdmissionId id) {
  ExportOnReturn exported(*this);
  Impl& s = *impl_;
  auto it = s.admissions.find(id);
  if (it == s.admissions.end()) return NotFound(fmt::format("release: admission {} not found", id));
  AdmissionRec& rec = it->second;
  for (NodeId nid : rec.pinned) {
    s.unpin(nid);
    s.reclaim_if_dead(nid);
  }
  // Receive blocks a peer may still write go to quarantine, never to the pool (fail closed).
  const std::uint32_t guard = rec.guard_begin();
  std::vector<BlockId> held;
  for (std::size_t i = 0; i < rec.blocks.size(); ++i) {
    if (!rec.owned[i]) continue;
    if (i >= guard && i < rec.recv_end)
      held.push_back(rec.blocks[i]);
    else
      s.free_block(kDev, rec.blocks[i]);
  }
  if (rec.recv == AdmissionRec::Recv::kReceiving) {
    const std::uint32_t n = rec.recv_end - rec.recv_begin;
    s.receiving_now -= n;
    s.st.quarantined_blocks += n;
    s.quarantined_now += n;
  }
  if (!held.empty()) s.quarantine.emplace(id, std::move(held));
  s.admissions.erase(it);
  return Status::Ok();
}

Status CacheManager::complete_receive(AdmissionId id, std::uint32_t loaded_blocks, bool reclaimable) {
  ExportOnReturn exported(*this);
  Impl& s = *impl_;
  auto it = s.admissions.find(id);
  if (it == s.admissions.end()) {
    if (s.quarantine.count(id))
      return FailedPrecondition(fmt::format(
          "complete_receive: admission {} was released while receiving: its {} blocks are quarantined until "
          "ack_receive_reclaimable({})",
          id, s.quarantine[id].size(), id));
    return NotFound(fmt::format("complete_receive: admission {} not found", id));
  }
  AdmissionRec& rec = it->second;
  if (rec.recv != AdmissionRec::Recv::kReceiving)
    return FailedPrecondition(
        fmt::format("complete_receive: admission {} is not receiving ({})", id,
                    rec.recv == AdmissionRec::Recv::kNone ? "admitted by admit()" : "its receive was completed"));
  const std::uint32_t n = rec.recv_end - rec.recv_begin;
  if (loaded_blocks > n)
    return InvalidArgument(fmt::format("complete_receive: loaded_blocks {} > the {} receive blocks of admission {}",
                                       loaded_blocks, n, id));
  s.receiving_now -= n;
  s.st.received_loaded_blocks += loaded_blocks;
  rec.recv_loaded = loaded_blocks;
  rec.recv = AdmissionRec::Recv::kDone;
  const std::uint32_t num_keys = static_cast<std::uint32_t>(rec.keys.size());
  const std::uint32_t indexed_end = std::min(rec.recv_begin + loaded_blocks, num_keys);
  if (indexed_end > rec.committed) s.st.received_committed_blocks += commit_in(s, rec, indexed_end);
  if (!reclaimable && loaded_blocks < n) {
    rec.recv = AdmissionRec::Recv::kQuarantined;
    s.st.quarantined_blocks += n - loaded_blocks;
    s.quarantined_now += n - loaded_blocks;
  }
  return Status::Ok();
}

Status CacheManager::ack_receive_reclaimable(AdmissionId id) {
  ExportOnReturn exported(*this);
  Impl& s = *impl_;
  if (auto it = s.admissions.find(id); it != s.admissions.end()) {
    AdmissionRec& rec = it->second;
    if (rec.recv == AdmissionRec::Recv::kReceiving)
      return FailedPrecondition(
          fmt::format("ack_receive_reclaimable: admission {} is still receiving: complete_receive() first", id));
    if (rec.recv != AdmissionRec::Recv::kQuarantined)
      return FailedPrecondition(fmt::format("ack_receive_reclaimable: admission {} holds no quarantined block", id));
    s.quarantined_now -= rec.recv_end - rec.guard_begin();
    rec.recv = AdmissionRec::Recv::kDone;
    return Status::Ok();
  }
  auto q = s.quarantine.find(id);
  if (q == s.quarantine.end())
    return NotFound(fmt::format("ack_receive_reclaimable: admission {} not found (open or quarantined)", id));
  for (BlockId b : q->second) s.free_block(kDev, b);
  s.quarantined_now -= static_cast<std::uint32_t>(q->second.size());
  s.quarantine.erase(q);
  return Status::Ok();
}

Result<AdmissionStatus> CacheManager::admission_status(AdmissionId id) const {
  const Impl& s = *impl_;
  auto it = s.admissions.find(id);
  if (it == s.admissions.end()) return NotFound(fmt::format("admission {} not found", id));
  const AdmissionRec& rec = it->second;
  AdmissionStatus out;
  bool ready = true;
  for (std::uint32_t i = 0; i < rec.hit_blocks; ++i) {
    const Node& n = s.nodes[rec.pos_node[i]];
    if (n.detached) out.failed = true;
    if (n.state == NodeState::kLoading) ++out.loading_blocks;
    ready = ready && !n.detached && (n.present & bit(kDev));
    if (ready) ++out.ready_blocks;
  }
  if (rec.recv == AdmissionRec::Recv::kReceiving) out.receiving_blocks = rec.recv_end - rec.recv_begin;
  if (rec.recv == AdmissionRec::Recv::kQuarantined) out.quarantined_blocks = rec.recv_end - rec.guard_begin();
  return out;
}

Result<std::uint32_t> CacheManager::prefetch(std::span<const BlockKey> keys) {
  ExportOnReturn exported(*this);
  Impl& s = *impl_;
  if (!s.has_tier(kSto) || !s.has_tier(kHst)) return std::uint32_t{0};
  std::vector<NodeId> matched;
  MatchResult m = s.match_nodes(keys, &matched);
  std::uint32_t queued = 0;
  for (std::uint32_t i = m.device_blocks + m.host_blocks; i < matched.size(); ++i) {
    NodeId id = matched[i];
    Node& n = s.nodes[id];
    auto hb = s.take_host_block();
    if (!hb.ok()) {
      // Write-back: dirty host blocks are being written to storage to make room. Make room for the
      // rest of the segment too, so that a call after their acks can queue it all.
      if (s.write_back_to_storage())
        for (std::size_t rest = matched.size() - i - 1; rest > 0; --rest)
          if (s.make_host_room() == Impl::Room::kNone) break;
      break;
    }
    // Taking a host block may have dropped the host copy of the parent (one also held in
    // storage): a host block below a storage-only parent would break the tier order.
    const NodeId parent = n.parent;
    if (n.detached || (parent != Impl::kRoot && s.eventual_tier(s.nodes[parent]) > kHst)) {
      s.pools[kHst].free(*hb).ignore_error();
      break;
    }
    s.queue_move(s.plan.storage_prefetches, BlockMove{n.block[kSto], *hb, n.key}, n);
    s.set_block(id, kHst, *hb);
    n.state = NodeState::kFetching;
    s.retier(id);
    ++s.st.storage_prefetches;
    ++queued;
  }
  return queued;
}

StepPlan CacheManager::take_plan() {
  ExportOnReturn exported(*this);
  Impl& s = *impl_;
  auto below = [](const BlockPool& p, double frac) {
    return static_cast<double>(p.num_free()) < frac * static_cast<double>(p.capacity());
  };
  ++s.step;
  if (!s.expiry.empty()) s.expire_retentions();
  // The watermarks evict on the cache's own account: never a protected copy.
  s.shield_protected = true;
  const Watermarks& dw = s.cfg.device_watermarks;
  if (dw.high > 0 && below(s.pools[kDev], dw.low)) {
    auto target = static_cast<std::uint32_t>(dw.high * s.pools[kDev].capacity() + 0.999999);
    (void)s.ensure_device_free(std::min(target, s.pools[kDev].capacity()));
  }
  const Watermarks& hw = s.cfg.host_watermarks;
  if (hw.high > 0 && s.has_tier(kHst) &&
      static_cast<double>(s.pools[kHst].num_free() + s.pending_demotions) <
          hw.low * static_cast<double>(s.pools[kHst].capacity())) {
    double target = hw.high * s.pools[kHst].capacity();
    while (static_cast<double>(s.pools[kHst].num_free() + s.pending_demotions) < target)
      if (!s.evict_one_host_background()) break;
  }
  s.shield_protected = false;
  if (!s.queue_order.empty() && s.cfg.lookahead_prefetch_blocks > 0) s.lookahead_prefetch();
  StepPlan out = std::move(s.plan);
  s.plan = StepPlan{};
  const auto handed_out = [&](const std::vector<BlockMove>& moves, int dst_tier) {
    for (const BlockMove& m : moves)
      if (const NodeId id = s.owner[dst_tier][m.dst]; id != kNoNode) s.nodes[id].untaken = false;
  };
  handed_out(out.evictions, kHst);
  handed_out(out.backups, kHst);
  handed_out(out.loads, kDev);
  handed_out(out.storage_writes, kSto);
  handed_out(out.storage_prefetches, kHst);
  return out;
}

std::uint32_t CacheManager::reclaimable_device_blocks() const { return impl_->reclaimable_now; }

std::uint32_t CacheManager::reclaimable_device_blocks_of(std::span<const BlockKey> keys) const {
  const Impl& s = *impl_;
  std::uint32_t n = 0;
  for (const BlockKey& k : keys)
    if (const NodeId id = s.map.find(k);
        id != kNoNode && s.nodes[id].live && !s.nodes[id].detached && counts_reclaimable(s.nodes[id]))
      ++n;
  return n;
}

CacheStats CacheManager::stats() const {
  const Impl& s = *impl_;
  CacheStats out = s.st;
  for (int t = 0; t < kNumTiers; ++t) {
    out.tiers[t].capacity = s.pools[t].capacity();
    out.tiers[t].used = s.pools[t].num_used();
    out.tiers[t].resident = static_cast<std::uint32_t>(s.policy[t]->size() + s.parked[t].size());
    const EvictionPolicy::Lead lead = s.policy[t]->lead();
    out.tiers[t].policy_expert = lead.expert;
    out.tiers[t].policy_switches = lead.switches;
    out.protected_blocks[t] = static_cast<std::uint32_t>(s.parked[t].size());
  }
  out.queued_requests = static_cast<std::uint32_t>(s.queue_order.size());
  out.retained_requests = static_cast<std::uint32_t>(s.expiry.size());
  out.nodes = s.map.size();
  out.receiving_device_blocks = s.receiving_now;
  out.quarantined_device_blocks = s.quarantined_now;
  return out;
}

}  // namespace kvtier::cache
