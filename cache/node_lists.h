// Private to the eviction policies (cache/eviction_policy.cc): NodeLists, the intrusive recency lists over node ids
// that LRU, ARC, LRFU (one list per use class), S3-FIFO and SIEVE order a tier by, with the blocked copies that
// EvictionPolicy::set_blocked names parked out of the victim walks.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "kvtier/backend/eviction_policy.h"

namespace kvtier::cache {

// Several intrusive doubly linked lists over node ids; a node is in at most one. Each list runs from its head (the
// newest push) to its tail, and a node keeps the stamp of its push, so a list is in stamp order.
//
// Blocked nodes stay members of their lists (list_of, size, move_head as usual), and a victim walk (skip_blocked)
// passes them without asking the caller's predicate. The first walk that passes one also parks it: takes it out of
// the chain that tail() / prev() follow, so later walks do not pass it again. Unblocked, a parked node goes back to
// the place its stamp gives it, so the chain is always the list's order with the parked nodes taken out, and a walk
// meets the others in the same order as before. Parking is lazy because it pays only where walks go: a policy whose
// victim() is never asked (an expert of a duel that does not lead) parks nothing, and one that walks parks the blocked
// nodes near its tail, whose places, when they are unblocked (a parent whose last child went), are near the tail
// again. The place is looked for from both ends at once; unpark_all() puts every parked node back in one merge (for a
// duel's expert that stops leading: its walks end, and its parked nodes' places drift away from both ends).
//
// Stamps are 32 bits, so a node's links and stamp share 12 bytes (the lists are walked and pushed on every admission;
// their footprint is the cost). When the clock would pass `stamp_limit`, every member is renumbered in order.
class NodeLists {
 public:
  static constexpr std::uint8_t kNone = 0xFF;
  explicit NodeLists(int num_lists, std::uint32_t stamp_limit = UINT32_MAX)
      : head_(num_lists, kNoNode), tail_(num_lists, kNoNode), size_(num_lists, 0), stamp_limit_(stamp_limit) {}

  void grow(NodeId n) {
    if (n >= link_.size()) {
      const std::size_t sz = std::max<std::size_t>(std::size_t{n} + 1, link_.size() * 2);
      link_.resize(sz);
      tag_.resize(sz);
    }
  }
  std::uint8_t list_of(NodeId n) const { return n < tag_.size() ? tag_[n].list : kNone; }
  bool blocked(NodeId n) const {
    if (shared_blocked_ != nullptr) return n < shared_blocked_->size() && ((*shared_blocked_)[n] & shared_mask_);
    return n < tag_.size() && (tag_[n].flags & kBlocked);
  }
  bool parked(NodeId n) const { return n < tag_.size() && (tag_[n].flags & kParked); }
  // Blocked nodes are those whose byte in *flags has a bit of `mask` (the bytes owned by the caller, who keeps them as
  // set_blocked would, and calls set_blocked(n, false) only to put a parked n back), not those set_blocked names. A
  // duel shares one vector among its experts: a block costs a bit, not a call and a cache miss per expert.
  void follow_blocked(const std::vector<std::uint8_t>* flags, std::uint8_t mask) {
    shared_blocked_ = flags;
    shared_mask_ = mask;
  }
  // n joins list l at its head (n in no list), unblocked.
  void push_head(int l, NodeId n) {
    grow(n);
    tag_[n].list = static_cast<std::uint8_t>(l);
    tag_[n].flags = 0;
    link_[n].stamp = next_stamp();
    chain(n, kNoNode);
    ++size_[l];
  }
  // n leaves its list.
  void unlink(NodeId n) {
    const int l = tag_[n].list;
    if (tag_[n].flags & kParked)
      --num_parked_;
    else
      unchain(n);
    tag_[n].flags = 0;
    tag_[n].list = kNone;
    --size_[l];
  }
  // n (in a list) moves to the head of list l, blocked or not as before; a parked n stays out of the chain.
  void move_head(int l, NodeId n) {
    const bool in_chain = !(tag_[n].flags & kParked);
    if (in_chain) unchain(n);
    --size_[tag_[n].list];
    tag_[n].list = static_cast<std::uint8_t>(l);
    ++size_[l];
    link_[n].stamp = next_stamp();
    if (in_chain) chain(n, kNoNode);
  }
  // No-op if n is in no list.
  void set_blocked(NodeId n, bool blocked) {
    if (list_of(n) == kNone) return;
    std::uint8_t& flags = tag_[n].flags;
    if (shared_blocked_ != nullptr) {  // the blocks are kept outside: only a parked node's return is ours
      if (!blocked && (flags & kParked)) {
        unpark(n);
        flags = 0;
      }
      return;
    }
    if (((flags & kBlocked) != 0) == blocked) return;
    if (blocked) {
      flags |= kBlocked;
      return;
    }
    if (flags & kParked) unpark(n);
    flags = 0;
  }
  // The first node from n toward the head that is not blocked (kNoNode: none), parking the blocked ones passed.
  NodeId skip_blocked(NodeId n) {
    while (n != kNoNode && blocked(n)) {
      const NodeId toward_head = link_[n].prev;
      unchain(n);
      tag_[n].flags |= kParked;
      ++num_parked_;
      n = toward_head;
    }
    return n;
  }
  // Every parked node back in its chain: per list, the parked ones in stamp order merged into it.
  void unpark_all() {
    if (num_parked_ == 0) return;
    std::vector<std::pair<std::uint32_t, NodeId>> parked;
    parked.reserve(num_parked_);
    for (NodeId n = 0; n < tag_.size(); ++n)
      if (tag_[n].flags & kParked) parked.emplace_back(link_[n].stamp, n);
    std::sort(parked.begin(), parked.end());
    // Per list, the oldest chained node newer than the parked node at hand (kNoNode: none, it goes to the head).
    // Oldest first, each goes in just behind it, so the cursor only moves toward the head.
    std::vector<NodeId> newer(head_.size(), kNoNode);
    std::vector<std::uint8_t> started(head_.size(), 0);
    for (const auto& [stamp, n] : parked) {
      const int l = tag_[n].list;
      if (!started[l]) {
        newer[l] = tail_[l];
        started[l] = 1;
      }
      while (newer[l] != kNoNode && link_[newer[l]].stamp < stamp) newer[l] = link_[newer[l]].prev;
      tag_[n].flags &= static_cast<std::uint8_t>(~kParked);
      chain(n, newer[l]);
    }
    num_parked_ = 0;
  }
  NodeId head(int l) const { return head_[l]; }
  NodeId tail(int l) const { return tail_[l]; }
  NodeId prev(NodeId n) const { return link_[n].prev; }  // toward the head
  NodeId next(NodeId n) const { return link_[n].next; }  // toward the tail
  std::uint32_t stamp(NodeId n) const { return link_[n].stamp; }
  std::size_t size(int l) const { return size_[l]; }
  std::size_t num_parked() const { return num_parked_; }

 private:
  static constexpr std::uint8_t kBlocked = 1, kParked = 2;
  struct Link {
    NodeId prev = kNoNode;  // toward the head
    NodeId next = kNoNode;  // toward the tail
    std::uint32_t stamp = 0;
  };

  std::uint32_t next_stamp() {
    if (clock_ >= stamp_limit_) renumber();
    return ++clock_;
  }
  // Stamps 1..members in the same order (parked members included), so the clock starts again far from the limit.
  void renumber() {
    std::vector<std::pair<std::uint32_t, NodeId>> members;
    for (NodeId n = 0; n < tag_.size(); ++n)
      if (tag_[n].list != kNone) members.emplace_back(link_[n].stamp, n);
    std::sort(members.begin(), members.end());
    clock_ = 0;
    for (const auto& member : members) link_[member.second].stamp = ++clock_;
  }
  // Back in the chain at its stamp's place: from both ends, one step each in turn, so the cost is the distance to
  // the nearer end.
  void unpark(NodeId n) {
    const int l = tag_[n].list;
    const std::uint32_t s = link_[n].stamp;
    NodeId from_tail = tail_[l], from_head = head_[l];
    for (;;) {
      if (from_tail == kNoNode || link_[from_tail].stamp > s) {  // n goes just behind from_tail (toward the tail)
        chain(n, from_tail);
        break;
      }
      if (from_head == kNoNode || link_[from_head].stamp < s) {  // n goes just ahead of from_head (toward the head)
        chain(n, from_head == kNoNode ? tail_[l] : link_[from_head].prev);
        break;
      }
      from_tail = link_[from_tail].prev;
      from_head = link_[from_head].next;
    }
    --num_parked_;
  }
  // Links n into the chain of its list just behind `newer` (toward the tail; kNoNode: n becomes the head).
  void chain(NodeId n, NodeId newer) {
    const int l = tag_[n].list;
    const NodeId older = newer == kNoNode ? head_[l] : link_[newer].next;
    link_[n].prev = newer;
    link_[n].next = older;
    if (newer != kNoNode)
      link_[newer].next = n;
    else
      head_[l] = n;
    if (older != kNoNode)
      link_[older].prev = n;
    else
      tail_[l] = n;
  }
  void unchain(NodeId n) {
    const int l = tag_[n].list;
    const Link& x = link_[n];
    if (x.prev != kNoNode)
      link_[x.prev].next = x.next;
    else
      head_[l] = x.next;
    if (x.next != kNoNode)
      link_[x.next].prev = x.prev;
    else
      tail_[l] = x.prev;
  }

  std::vector<NodeId> head_, tail_;
  std::vector<std::size_t> size_;
  struct Tag {
    std::uint8_t list = kNone;
    std::uint8_t flags = 0;  // kBlocked (unless shared_blocked_), kParked (only while blocked)
  };
  std::vector<Link> link_;
  std::vector<Tag> tag_;
  const std::vector<std::uint8_t>* shared_blocked_ = nullptr;
  std::uint8_t shared_mask_ = 0;
  std::uint32_t clock_ = 0;
  std::uint32_t stamp_limit_;
  std::size_t num_parked_ = 0;
};

}  // namespace kvtier::cache
