// CacheManager's look-ahead (cache_manager.h, "Look-ahead"): announce(),
// extend_announced(), withdraw() and the retentions hinted at, the per-key
// counts that protect announced blocks (a protected copy is parked outside
// its tier's policy, in Impl::parked, until its protection ends), and
// take_plan()'s prefetch of the queued chains' blocks to faster tiers.
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "cache/cache_manager_impl.h"
#include "kvtier/core/enum_names.h"

namespace kvtier::cache {

constexpr EnumName<Continuation> kContinuationEntries[] = {
    {Continuation::kUnknown, "unknown"},
    {Continuation::kContinues, "continues"},
    {Continuation::kLastTurn, "last_turn"},
};
constexpr auto kContinuationNames = enum_table("continuation", kContinuationEntries);
std::string_view continuation_name(Continuation c) noexcept { return kContinuationNames.name(c); }

// ---- protection ----------------------------------------------------------------

void CacheManager::Impl::set_wanted(NodeId id, std::uint32_t count, Rank rank) {
  const Node& n = nodes[id];
  const bool was = wanted(id) > 0, now = count > 0;
  if (!was && !now) return;
  NodeWant& w = want_of(id);
  if (was && now && Rank{w.priority, w.seq} == rank) {
    w.count = count;
    return;
  }
  for (int t = 0; t < kNumTiers; ++t) {
    if (!resident_in(n, t)) continue;
    if (was)
      parked[t].erase(park_key(id));
    else
      policy[t]->erase(id);
  }
  w = now ? NodeWant{count, rank.priority, rank.seq} : NodeWant{};
  // Unparked copies re-enter their policy as just used: a withdrawn request is usually admitted next.
  for (int t = 0; t < kNumTiers; ++t)
    if (resident_in(n, t)) track_insert(id, t, /*accessed=*/false);
}

void CacheManager::Impl::hold_key(const BlockKey& key, Rank rank) {
  KeyWant& w = wanted_keys.find_or_claim(key);
  if (w.count == 0 || rank.better_than(w.rank)) w.rank = rank;
  ++w.count;
  const NodeId id = map.find(key);
  if (id != kNoNode) set_wanted(id, w.count, w.rank);
}

void CacheManager::Impl::unhold_key(const BlockKey& key) {
  KeyWant* w = wanted_keys.find(key);
  if (w == nullptr) return;  // cannot happen while the counts are balanced (check_invariants)
  const std::uint32_t count = w->count - 1;
  const Rank rank = w->rank;
  if (count == 0)
    wanted_keys.erase(key);  // found by its count: erased before the count reads as a free slot
  else
    w->count = count;
  const NodeId id = map.find(key);
  if (id != kNoNode) set_wanted(id, count, count ? rank : Rank{});
}

void CacheManager::Impl::drop_announcement(QueuedId id) {
  auto it = announcements.find(id);
  if (it == announcements.end()) return;
  Announcement& a = it->second;
  if (a.queued) {
    queue_order.erase({-static_cast<std::int64_t>(a.hints.priority), id});
  } else {
    for (auto [e, end] = expiry.equal_range(a.expires_at); e != end; ++e)
      if (e->second == id) {
        expiry.erase(e);
        break;
      }
    if (a.hints.conversation_id != 0) {
      auto c = retained_by_conversation.find(a.hints.conversation_id);
      if (c != retained_by_conversation.end()) {
        std::erase(c->second, id);
        if (c->second.empty()) retained_by_conversation.erase(c);
      }
    }
  }
  // Deepest first: unparked copies re-enter their policies parents last, as the policies expect.
  for (auto k = a.keys.rbegin(); k != a.keys.rend(); ++k) unhold_key(*k);
  announcements.erase(it);
}

void CacheManager::Impl::expire_retentions() {
  while (!expiry.empty() && expiry.begin()->first <= step) drop_announcement(expiry.begin()->second);
}

// ---- API -----------------------------------------------------------------------

Result<QueuedId> CacheManager::announce(std::span<const BlockKey> keys, const RequestHints& hints) {
  ExportOnReturn exported(*this);
  Impl& s = *impl_;
  if (hints.continuation != Continuation::kUnknown && hints.continuation != Continuation::kContinues &&
      hints.continuation != Continuation::kLastTurn)
    return InvalidArgument(
        fmt::format("announce: continuation {} is not one of unknown (0), continues (1), "
                    "last_turn (2)",
                    static_cast<int>(hints.continuation)));
  KVTIER_RETURN_IF_ERROR(s.check_chain(keys, "announce"));
  const QueuedId id = s.next_queued++;
  Impl::Announcement a;
  a.keys.assign(keys.begin(), keys.end());
  a.hints = hints;
  const Impl::Rank rank = a.rank(id);
  for (const BlockKey& k : a.keys) s.hold_key(k, rank);
  Impl::Announcement& stored = s.announcements.emplace(id, std::move(a)).first->second;
  s.queue_order.emplace(std::tuple{-static_cast<std::int64_t>(hints.priority), id}, &stored);
  // A new request of the conversation holds its chain now: earlier retentions of it end (after the hold
  // above, so that shared blocks stay protected throughout).
  if (hints.conversation_id != 0) {
    auto c = s.retained_by_conversation.find(hints.conversation_id);
    if (c != s.retained_by_conversation.end()) {
      const std::vector<QueuedId> old = c->second;
      for (QueuedId r : old) s.drop_announcement(r);
    }
  }
  return id;
}

namespace {

Status unknown_queued(const CacheManager::Impl& s, std::string_view what, QueuedId id) {
  if (id == 0 || id >= s.next_queued)
    return NotFound(fmt::format("{}: queued request {} was never announced", what, id));
  return FailedPrecondition(
      fmt::format("{}: queued request {} was withdrawn already (and its retention, if any, ended)", what, id));
}

}  // namespace

Status CacheManager::extend_announced(QueuedId id, std::span<const BlockKey> more_keys) {
  ExportOnReturn exported(*this);
  Impl& s = *impl_;
  auto it = s.announcements.find(id);
  if (it == s.announcements.end()) return unknown_queued(s, "extend_announced", id);
  Impl::Announcement& a = it->second;
  if (!a.queued)
    return FailedPrecondition(
        fmt::format("extend_announced: queued request {} was withdrawn (its chain is retained for {} more steps)", id,
                    a.expires_at - s.step));
  // Repeats within the new keys and breaks of the chain are refused; a new key repeating an older one that is
  // not indexed is not seen here, and harmless: it is counted twice and uncounted twice.
  const NodeId prev = a.keys.empty() ? Impl::kRoot : s.map.find(a.keys.back());
  KVTIER_RETURN_IF_ERROR(s.check_chain(more_keys, "extend_announced", prev, a.keys.size()));
  const Impl::Rank rank = a.rank(id);
  for (const BlockKey& k : more_keys) {
    s.hold_key(k, rank);
    a.keys.push_back(k);
  }
  return Status::Ok();
}

Status CacheManager::withdraw(QueuedId id, bool retain_per_hints) {
  ExportOnReturn exported(*this);
  Impl& s = *impl_;
  auto it = s.announcements.find(id);
  if (it == s.announcements.end()) return unknown_queued(s, "withdraw", id);
  Impl::Announcement& a = it->second;
  if (!a.queued)
    return FailedPrecondition(
        fmt::format("withdraw: queued request {} was withdrawn already (its chain is retained for {} more steps)", id,
                    a.expires_at - s.step));
  const RequestHints& h = a.hints;
  std::uint64_t retain = 0;
  if (retain_per_hints && h.continuation != Continuation::kLastTurn)
    retain = h.ttl_steps > 0                              ? h.ttl_steps
             : h.continuation == Continuation::kContinues ? s.cfg.lookahead_retain_steps
                                                          : 0;
  if (retain == 0 || a.keys.empty()) {
    s.drop_announcement(id);
    return Status::Ok();
  }
  s.queue_order.erase({-static_cast<std::int64_t>(h.priority), id});
  a.queued = false;
  a.expires_at = s.step + retain;
  s.expiry.emplace(a.expires_at, id);
  if (h.conversation_id != 0) s.retained_by_conversation[h.conversation_id].push_back(id);
  return Status::Ok();
}

Result<AnnouncementInfo> CacheManager::announcement(QueuedId id) const {
  const Impl& s = *impl_;
  auto it = s.announcements.find(id);
  if (it == s.announcements.end()) return unknown_queued(s, "announcement", id);
  const Impl::Announcement& a = it->second;
  AnnouncementInfo out;
  out.hints = a.hints;
  out.keys = static_cast<std::uint32_t>(a.keys.size());
  out.queued = a.queued;
  out.retained_steps = a.queued ? 0 : static_cast<std::uint32_t>(a.expires_at - s.step);
  return out;
}

// ---- prefetch ------------------------------------------------------------------

bool CacheManager::Impl::lookahead_load(NodeId id) {
  if (pools[kDev].num_free() == 0 && !evict_one_device()) return false;
  Node& n = nodes[id];
  // The eviction took an unprotected victim: this block and its parent (protected) are as they were.
  if (n.detached || n.state != NodeState::kSettled || lowest_tier(n.present) != kHst) return false;
  auto db = pools[kDev].allocate();
  if (!db.ok()) return false;
  queue_move(plan.loads, BlockMove{n.block[kHst], *db, n.key}, n);
  set_block(id, kDev, *db);
  n.state = NodeState::kLoading;
  n.lookahead_move = true;
  ++lookahead_in_flight[kDev];
  retier(id);
  ++st.loads_h2d;
  ++st.lookahead_loads;
  return true;
}

bool CacheManager::Impl::lookahead_fetch(NodeId id) {
  auto hb = take_host_block();
  if (!hb.ok()) return false;
  Node& n = nodes[id];
  const bool parent_ok = n.parent == kRoot || eventual_tier(nodes[n.parent]) <= kHst;
  if (n.detached || n.state != NodeState::kSettled || n.present != bit(kSto) || !parent_ok) {
    pools[kHst].free(*hb).ignore_error();
    return false;
  }
  queue_move(plan.storage_prefetches, BlockMove{n.block[kSto], *hb, n.key}, n);
  set_block(id, kHst, *hb);
  n.state = NodeState::kFetching;
  n.lookahead_move = true;
  ++lookahead_in_flight[kHst];
  retier(id);
  ++st.storage_prefetches;
  ++st.lookahead_fetches;
  return true;
}

void CacheManager::Impl::lookahead_prefetch() {
  if (!has_tier(kHst)) return;  // nothing below the device
  std::uint32_t budget = cfg.lookahead_prefetch_blocks;
  // Keys looked at per call, at most: half from the head of the queue (highest rank first), half from where the
  // last call's walk stopped (lookahead_resume), so a long queue is walked over several calls and announcements
  // behind many uncached ones (each costs a key to find uncached, every call) are reached too.
  const std::uint64_t scan_limit = std::max<std::uint64_t>(256, 16 * std::uint64_t{budget});
  std::uint64_t scan = 0;
  auto room = [&](int t) {
    return static_cast<double>(parked[t].size() + lookahead_in_flight[t] + 1) <=
           cfg.lookahead_max_fraction * static_cast<double>(pools[t].capacity());
  };
  bool loads_ok = true, fetches_ok = has_tier(kSto);
  auto stopped = [&] { return budget == 0 || scan == 0 || (!loads_ok && !fetches_ok); };
  auto visit = [&](Announcement& a) {
    if (a.cursor_epoch == epoch && a.cursor == a.keys.size()) return;  // all on (or loading to) the device
    if (a.cursor_epoch != epoch) {
      a.cursor = 0;
      a.cursor_node = kRoot;
      a.cursor_epoch = epoch;
    }
    NodeId prev = a.cursor_node;
    bool on_device_so_far = true;
    for (std::size_t pos = a.cursor; pos < a.keys.size() && budget > 0 && scan > 0; ++pos) {
      --scan;
      const NodeId id = map.find(a.keys[pos]);
      if (id == kNoNode || nodes[id].parent != prev) break;  // not cached (yet) from here on
      const Node& n = nodes[id];
      if (eventual_tier(n) != kDev) {
        if (!servable(n.state)) break;  // on its way between lower tiers: after the ack
        const int t = lowest_tier(n.present);
        if (t == kHst) {
          // A host copy being written to storage is not loaded (match() treats it as in flight), and a
          // device copy needs its parent on the device.
          const bool parent_on_device = prev == kRoot || eventual_tier(nodes[prev]) == kDev;
          if (n.state == NodeState::kSettled && parent_on_device && loads_ok) {
            if (room(kDev) && lookahead_load(id))
              --budget;
            else
              loads_ok = false;
          }
        } else if (t == kSto) {
          if (!fetches_ok) break;
          if (!room(kHst) || !lookahead_fetch(id)) {
            fetches_ok = false;
            break;
          }
          --budget;
        } else {
          break;
        }
      }
      if (on_device_so_far && eventual_tier(nodes[id]) == kDev) {
        a.cursor = static_cast<std::uint32_t>(pos + 1);
        a.cursor_node = id;
      } else {
        on_device_so_far = false;
      }
      prev = id;
    }
  };
  shield_protected = true;  // a prefetch takes room from unprotected, unpinned blocks only
  speculative = true;       // ... that have another copy
  scan = scan_limit / 2;
  for (auto it = queue_order.begin(); it != queue_order.end() && !stopped(); ++it) visit(*it->second);
  // The rest from where the last call stopped, once around the queue at most.
  scan += scan_limit - scan_limit / 2;
  auto from = lookahead_resume ? queue_order.upper_bound(*lookahead_resume) : queue_order.begin();
  std::optional<QueueKey> last;
  bool wrapped = false;
  for (auto it = from; !stopped();) {
    if (it == queue_order.end()) {
      if (wrapped || from == queue_order.begin()) break;
      wrapped = true;
      it = queue_order.begin();
      continue;
    }
    if (wrapped && it == from) break;
    visit(*it->second);
    last = it->first;
    ++it;
  }
  // Stopped on the scan limit: the next call goes on after the last announcement visited; otherwise from the head.
  lookahead_resume = scan == 0 ? last : std::nullopt;
  shield_protected = false;
  speculative = false;
}

}  // namespace kvtier::cache
