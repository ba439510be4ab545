// CacheManager's KV events: announce() turns the change of a node's indexed settled copies into
// BlockStored / BlockRemoved events, merging consecutive blocks of one chain and medium.
#include <fmt/format.h>

#include <iterator>

#include "cache/cache_manager_impl.h"

namespace kvtier::cache {

namespace {
metrics::BlockHash hash_of(const BlockKey& k) { return metrics::BlockHash{k.hi, k.lo}; }
}  // namespace

void CacheManager::Impl::announce_slow(NodeId id) {
  Node& n = nodes[id];
  const std::uint8_t want = n.live && !n.detached ? n.present : 0;
  const auto removed = static_cast<std::uint8_t>(n.announced & ~want);
  const auto added = static_cast<std::uint8_t>(want & ~n.announced);
  n.announced = want;
  if (!removed && !added) return;
  auto medium = [&](int t) {
    return t == kDev ? metrics::Medium::kGpu : t == kHst ? metrics::Medium::kCpu : storage_medium;
  };
  const metrics::BlockHash h = hash_of(n.key);
  for (int t = 0; t < kNumTiers; ++t) {
    if (!(removed & bit(t))) continue;
    auto* last = events.empty() ? nullptr : std::get_if<metrics::BlockRemoved>(&events.back());
    if (last && last->medium == medium(t))
      last->block_hashes.push_back(h);
    else
      events.push_back(metrics::BlockRemoved{{h}, medium(t)});
  }
  std::optional<metrics::BlockHash> parent;
  if (n.parent != kNoNode && n.parent != kRoot) parent = hash_of(nodes[n.parent].key);
  for (int t = 0; t < kNumTiers; ++t) {
    if (!(added & bit(t))) continue;
    auto* last = events.empty() ? nullptr : std::get_if<metrics::BlockStored>(&events.back());
    // One event per chain: this block's parent is the last block of the previous event.
    if (last && last->medium == medium(t) && parent && last->block_hashes.back() == *parent) {
      last->block_hashes.push_back(h);
    } else {
      events.push_back(metrics::BlockStored{{h}, parent, {}, event_block_size, std::nullopt, medium(t)});
    }
  }
}

Status CacheManager::enable_kv_events(std::uint32_t block_size, metrics::Medium storage_medium) {
  Impl& s = *impl_;
  if (block_size == 0) return InvalidArgument("enable_kv_events: block_size 0 (tokens per block)");
  if (s.events_on) {
    if (block_size == s.event_block_size && storage_medium == s.storage_medium) return Status::Ok();
    return FailedPrecondition(fmt::format(
        "enable_kv_events: already on with block_size {} and storage medium {}; block_size {} and medium {} would "
        "report blocks stored on one medium as removed from another",
        s.event_block_size, metrics::medium_name(s.storage_medium), block_size, metrics::medium_name(storage_medium)));
  }
  s.event_block_size = block_size;
  s.storage_medium = storage_medium;
  s.events_on = true;
  // Announce what is indexed now, parents before children (preorder), so chains merge.
  std::vector<NodeId> stack;
  for (NodeId c = s.nodes[Impl::kRoot].first_child; c != kNoNode; c = s.nodes[c].next_sib) stack.push_back(c);
  while (!stack.empty()) {
    NodeId x = stack.back();
    stack.pop_back();
    s.announce(x);
    for (NodeId c = s.nodes[x].first_child; c != kNoNode; c = s.nodes[c].next_sib) stack.push_back(c);
  }
  return Status::Ok();
}

std::vector<metrics::KvEvent> CacheManager::take_events() {
  std::vector<metrics::KvEvent> out;
  out.swap(impl_->events);
  return out;
}

void CacheManager::return_events(std::vector<metrics::KvEvent> events) {
  if (events.empty()) return;
  std::vector<metrics::KvEvent>& queued = impl_->events;
  events.insert(events.end(), std::make_move_iterator(queued.begin()), std::make_move_iterator(queued.end()));
  queued.swap(events);
}

std::vector<CacheManager::CachedBlock> CacheManager::cached_blocks() const {
  const Impl& s = *impl_;
  std::vector<CachedBlock> out;
  for (std::size_t id = 1; id < s.nodes.size(); ++id) {
    const Node& n = s.nodes[id];
    if (!n.live || n.detached) continue;
    for (int t = 0; t < kNumTiers; ++t)
      if (n.present & bit(t)) out.push_back(CachedBlock{n.key, static_cast<Tier>(t)});
  }
  return out;
}

}  // namespace kvtier::cache
