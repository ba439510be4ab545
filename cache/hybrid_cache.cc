// HybridCache: several KV groups (full, sliding window, state) per request, one
// CacheManager per group. This file decides the common hit, plans each group's
// CacheManager admissions, and keeps them together (all or nothing, commit and
// release across groups). The contract is in include/kvtier/cache/hybrid_cache.h.
#include "kvtier/cache/hybrid_cache.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <tuple>

#include "cache/canonical_key.h"
#include "core/byte_codec.h"
#include "kvtier/core/enum_names.h"

namespace kvtier::cache {

namespace {

// What a group's CacheManager admission is for.
enum class Role : std::uint8_t {
  kChain,      // full group: the whole chain of keyed blocks (plus unkeyed tail and decode space)
  kBlock,      // sliding window: one block position (its own root-level entry)
  kStateIn,    // state: the state at the hit
  kStateSave,  // state: a boundary whose state the forward saves
  kExtra,      // unkeyed blocks (window tail and decode space, the state's working block)
};

// Where one key stands in a group's CacheManager now.
enum class Standing : std::uint8_t { kMissing, kHost, kDevice, kInFlight };

Standing standing_of(const MatchResult& m) {
  if (m.device_blocks > 0) return Standing::kDevice;
  if (m.host_blocks > 0) return Standing::kHost;
  return m.stopped_at_in_flight ? Standing::kInFlight : Standing::kMissing;
}

std::string group_label(const KvGroupConfig& g, std::uint32_t index) {
  return fmt::format("KV group {} (\"{}\")", index, g.name);
}

std::uint32_t ceil_div(std::uint64_t a, std::uint64_t b) { return static_cast<std::uint32_t>((a + b - 1) / b); }

// The first token a window of W tokens reaches from position p: p attends to [p - W + 1, p], itself included (the
// sliding_window of Hugging Face's and vLLM's models: vLLM keeps cdiv(W - 1, block) blocks before a hit). So a
// hit at h needs the tokens [window_start(h, W), h), and a block ending at or before window_start(n, W) is read
// by no token from n on.
std::uint32_t window_start(std::uint32_t p, std::uint32_t W) { return p >= W ? p - W + 1 : 0; }

}  // namespace

constexpr EnumName<GroupKind> kGroupKindEntries[] = {
    {GroupKind::kFull, "full"},
    {GroupKind::kSlidingWindow, "sliding_window"},
    {GroupKind::kState, "state"},
};
constexpr auto kGroupKindNames = enum_table("group kind", kGroupKindEntries, "unknown");
std::string_view group_kind_name(GroupKind kind) noexcept { return kGroupKindNames.name(kind); }

BlockKey group_block_key(const BlockKey& chain_key, std::uint32_t group, GroupKind kind) noexcept {
  static constexpr char kTag[] = "kvtier.group.v1";
  // On the stack (noexcept, per block): the fields at their fixed offsets (core/byte_codec.h).
  constexpr std::size_t kTagBytes = sizeof(kTag) - 1;
  std::byte buf[kTagBytes + 16 + 4 + 1];
  std::memcpy(buf, kTag, kTagBytes);
  const auto c = canonical(chain_key);
  std::memcpy(buf + kTagBytes, c.data(), 16);
  codec::store_le<std::uint32_t>(buf + kTagBytes + 16, group);
  buf[kTagBytes + 20] = static_cast<std::byte>(kind);
  XXH128_hash_t h = XXH3_128bits(buf, sizeof(buf));
  return BlockKey{h.high64, h.low64};
}

bool HybridPlan::empty() const noexcept {
  return std::all_of(groups.begin(), groups.end(), [](const StepPlan& p) { return p.empty(); });
}

std::size_t HybridPlan::size() const noexcept {
  std::size_t n = 0;
  for (const StepPlan& p : groups) n += p.size();
  return n;
}

struct HybridCache::Sub {
  Role role = Role::kExtra;
  // kBlock: block position; kStateIn / kStateSave: the boundary in tokens.
  std::uint32_t pos = 0;
  BlockKey key;             // kBlock, kStateIn, kStateSave
  std::uint32_t extra = 0;  // kChain, kExtra
  std::uint32_t hits = 0;   // served positions: planned, then as admitted (kChain: blocks; others: 0 or 1)
  bool device_hit = false;  // kBlock / kStateIn: the hit is on device
  AdmissionId id = 0;
  bool open = false;
  bool committed = false;  // kBlock / kStateSave: indexed by commit()
  Admission admission;     // as admitted
};

struct HybridCache::GroupRec {
  std::vector<Sub> subs;
  std::vector<BlockKey> chain_keys;  // full: the group keys of every keyed position
  std::uint32_t chain_device_hits = 0;
  std::uint32_t chain_pinned = 0;   // full: leading chain keys counted in pins_ (hits, then committed)
  std::uint32_t need = 0;           // device blocks the group's admissions allocate
  std::uint32_t num_keyed = 0;      // num_tokens / block_tokens
  std::uint32_t num_positions = 0;  // ceil((num_tokens + extra_tokens) / block_tokens)
  std::uint32_t first_block = 0;
};

struct HybridCache::Rec {
  std::uint32_t num_tokens = 0, extra_tokens = 0, hit_tokens = 0, committed_tokens = 0;
  // A hit's load failed in some group: every token past the hit was computed on its bytes, in every group.
  // Sticky: admission_status() keeps reporting it after the window or state that held the failed block moved on
  // (its sub-admission closed).
  bool load_failed = false;
  std::uint32_t failed_group = 0;
  std::vector<GroupRec> groups;
};

struct HybridCache::Plan {
  HybridMatch match;
  Rec rec;
};

HybridCache::HybridCache(HybridConfig config) : config_(std::move(config)) {}
HybridCache::~HybridCache() = default;

Result<std::unique_ptr<HybridCache>> HybridCache::create(HybridConfig config) {
  if (config.groups.empty()) return InvalidArgument("hybrid cache: no KV group (HybridConfig::groups is empty)");
  std::uint64_t lcm = 1;
  for (std::uint32_t g = 0; g < config.groups.size(); ++g) {
    const KvGroupConfig& c = config.groups[g];
    if (c.name.empty()) return InvalidArgument(fmt::format("hybrid cache: KV group {} has an empty name", g));
    for (std::uint32_t k = 0; k < g; ++k)
      if (config.groups[k].name == c.name)
        return InvalidArgument(fmt::format(
            "hybrid cache: KV group {} is named \"{}\" like KV group {}: names must be unique", g, c.name, k));
    if (c.kind != GroupKind::kFull && c.kind != GroupKind::kSlidingWindow && c.kind != GroupKind::kState)
      return InvalidArgument(
          fmt::format("hybrid cache: {}: unknown kind {}", group_label(c, g), static_cast<unsigned>(c.kind)));
    if (c.block_tokens == 0)
      return InvalidArgument(fmt::format("hybrid cache: {}: block_tokens 0, must be >= 1", group_label(c, g)));
    if (c.kind == GroupKind::kSlidingWindow && c.window_tokens == 0)
      return InvalidArgument(
          fmt::format("hybrid cache: {}: sliding-window group with window_tokens 0, must be >= 1", group_label(c, g)));
    if (c.kind != GroupKind::kSlidingWindow && c.window_tokens != 0)
      return InvalidArgument(
          fmt::format("hybrid cache: {}: window_tokens {} on a {} group: only sliding-window groups have a window",
                      group_label(c, g), c.window_tokens, group_kind_name(c.kind)));
    lcm = std::lcm(lcm, std::uint64_t{c.block_tokens});
    if (lcm > 0xFFFFFFFFull)
      return InvalidArgument(fmt::format(
          "hybrid cache: the lcm of the groups' block sizes exceeds 2^32 at {}, block_tokens {}: hits could "
          "never be a multiple of every block size",
          group_label(c, g), c.block_tokens));
  }
  std::unique_ptr<HybridCache> h(new HybridCache(std::move(config)));
  h->granularity_ = static_cast<std::uint32_t>(lcm);
  for (std::uint32_t g = 0; g < h->config_.groups.size(); ++g) {
    auto m = CacheManager::create(h->config_.groups[g].cache);
    if (!m.ok()) return m.status().with_context(fmt::format("hybrid cache: {}", group_label(h->config_.groups[g], g)));
    h->managers_.push_back(std::move(m).value());
  }
  h->pins_.resize(h->config_.groups.size());
  return h;
}

Status HybridCache::validate(const HybridRequest& r) const {
  if (r.chains.size() != config_.groups.size())
    return InvalidArgument(fmt::format("hybrid request: {} key chains for {} KV groups (one per group)",
                                       r.chains.size(), config_.groups.size()));
  if (std::uint64_t{r.num_tokens} + r.extra_tokens == 0)
    return InvalidArgument("hybrid request: num_tokens 0 and extra_tokens 0: nothing to admit");
  if (std::uint64_t{r.num_tokens} + r.extra_tokens > 0xFFFFFFFFull)
    return InvalidArgument(
        fmt::format("hybrid request: num_tokens {} + extra_tokens {} exceeds 2^32 - 1", r.num_tokens, r.extra_tokens));
  bool has_state = false;
  for (std::uint32_t g = 0; g < config_.groups.size(); ++g) {
    const KvGroupConfig& c = config_.groups[g];
    const std::uint32_t want = r.num_tokens / c.block_tokens;
    if (r.chains[g].size() != want)
      return InvalidArgument(fmt::format(
          "hybrid request: {}: {} chain keys for num_tokens {} at block_tokens {}: want {} (one per full block)",
          group_label(c, g), r.chains[g].size(), r.num_tokens, c.block_tokens, want));
    has_state |= c.kind == GroupKind::kState;
    // A full group's chain is checked by its CacheManager's admit; window and state keys are admitted one by one,
    // where a repeat is not seen: one block would be served for several positions (or states).
    if (c.kind != GroupKind::kFull && r.chains[g].size() > 1) {
      std::vector<std::tuple<std::uint64_t, std::uint64_t, std::uint32_t>> sorted;  // (hi, lo, position)
      sorted.reserve(r.chains[g].size());
      for (std::uint32_t i = 0; i < r.chains[g].size(); ++i)
        sorted.emplace_back(r.chains[g][i].hi, r.chains[g][i].lo, i);
      std::sort(sorted.begin(), sorted.end());
      for (std::size_t i = 1; i < sorted.size(); ++i) {
        const auto& [hi, lo, at] = sorted[i];
        const auto& [prev_hi, prev_lo, prev_at] = sorted[i - 1];
        if (hi == prev_hi && lo == prev_lo)
          return InvalidArgument(
              fmt::format("hybrid request: {}: key {} repeats (positions {} and {}): keys must form a hash chain",
                          group_label(c, g), BlockKey{hi, lo}.hex(), prev_at, at));
      }
    }
  }
  if (!r.save_states_at.empty() && !has_state)
    return InvalidArgument(fmt::format("hybrid request: save_states_at has {} entries but no KV group is a state group",
                                       r.save_states_at.size()));
  for (std::size_t i = 0; i < r.save_states_at.size(); ++i) {
    const std::uint32_t t = r.save_states_at[i];
    if (t == 0 || t > r.num_tokens)
      return InvalidArgument(
          fmt::format("hybrid request: save_states_at[{}] = {}: must be in [1, num_tokens {}]", i, t, r.num_tokens));
    if (i > 0 && t <= r.save_states_at[i - 1])
      return InvalidArgument(fmt::format("hybrid request: save_states_at[{}] = {} after {}: must increase", i, t,
                                         r.save_states_at[i - 1]));
    // A hit ends on a multiple of the granularity (so on a boundary of every group's blocks): a state saved
    // elsewhere could never be read.
    if (t % granularity_ != 0)
      return InvalidArgument(fmt::format(
          "hybrid request: save_states_at[{}] = {} is not a multiple of the hit granularity {} (the lcm of the "
          "groups' block sizes): no hit could start from it",
          i, t, granularity_));
  }
  return Status::Ok();
}

// Probes every group (CacheManager::match, no side effects), picks the common hit, and lays out each group's
// admissions for it.
Result<HybridCache::Plan> HybridCache::plan(const HybridRequest& r) const {
  KVTIER_RETURN_IF_ERROR(validate(r));
  const std::uint32_t num_groups = this->num_groups();
  const std::uint32_t L = granularity_;
  std::uint32_t limit = std::min(r.num_tokens, r.max_hit_tokens);
  limit -= limit % L;
  const std::uint32_t K = limit / L;  // candidate hits: c * L for c in [0, K]

  Plan p;
  p.rec.num_tokens = r.num_tokens;
  p.rec.extra_tokens = r.extra_tokens;
  p.rec.groups.resize(num_groups);
  p.match.groups.resize(num_groups);
  // ok[c]: every group serves hit c * L; okf[c]: it would once the blocks in flight settle.
  std::vector<std::uint8_t> ok(K + 1, 1), okf(K + 1, 1);
  // Per group, the standing of every key a candidate hit may need (positions / boundaries below the limit).
  std::vector<std::vector<Standing>> standing(num_groups);
  for (std::uint32_t g = 0; g < num_groups; ++g) {
    const KvGroupConfig& c = config_.groups[g];
    const CacheManager& m = *managers_[g];
    const std::uint32_t B = c.block_tokens;
    const std::span<const BlockKey> chain = r.chains[g];
    GroupRec& gr = p.rec.groups[g];
    gr.num_keyed = static_cast<std::uint32_t>(chain.size());
    gr.num_positions = ceil_div(std::uint64_t{r.num_tokens} + r.extra_tokens, B);
    std::vector<std::uint8_t> gok(K + 1, 1), gokf(K + 1, 1);
    switch (c.kind) {
      case GroupKind::kFull: {
        gr.chain_keys.reserve(chain.size());
        for (const BlockKey& k : chain) gr.chain_keys.push_back(group_block_key(k, g, c.kind));
        const std::uint32_t lim_blocks = limit / B;
        MatchResult mr = m.match(std::span<const BlockKey>(gr.chain_keys).first(lim_blocks));
        const std::uint32_t served = mr.device_blocks + mr.host_blocks;
        // A chain match stops at the first key in flight: what lies past it is not known, so in flight counts as
        // the whole rest (CacheManager::match's stopped_at_in_flight says the same).
        const std::uint32_t served_f = mr.stopped_at_in_flight ? lim_blocks : served;
        gr.chain_device_hits = mr.device_blocks;
        for (std::uint32_t i = 0; i <= K; ++i) {
          gok[i] = i * L / B <= served;
          gokf[i] = i * L / B <= served_f;
        }
        break;
      }
      case GroupKind::kSlidingWindow: {
        const std::uint32_t W = c.window_tokens;
        const std::uint32_t n = limit / B;
        standing[g].resize(n);
        // bad[j]: keys before position j not served now; badf[j]: of those, the ones not even in flight.
        std::vector<std::uint32_t> bad(n + 1, 0), badf(n + 1, 0);
        for (std::uint32_t j = 0; j < n; ++j) {
          const BlockKey key = group_block_key(chain[j], g, c.kind);
          standing[g][j] = standing_of(m.match(std::span<const BlockKey>(&key, 1)));
          const bool served = standing[g][j] == Standing::kDevice || standing[g][j] == Standing::kHost;
          bad[j + 1] = bad[j] + (served ? 0 : 1);
          badf[j + 1] = badf[j] + (served || standing[g][j] == Standing::kInFlight ? 0 : 1);
        }
        for (std::uint32_t i = 0; i <= K; ++i) {
          const std::uint32_t h = i * L;
          const std::uint32_t s = window_start(h, W) / B, e = h / B;
          gok[i] = bad[e] == bad[s];
          gokf[i] = badf[e] == badf[s];
        }
        break;
      }
      case GroupKind::kState: {
        // Only the boundaries a candidate hit can end at are looked up.
        standing[g].resize(K + 1, Standing::kMissing);
        for (std::uint32_t i = 1; i <= K; ++i) {
          const BlockKey key = group_block_key(chain[i * L / B - 1], g, c.kind);
          standing[g][i] = standing_of(m.match(std::span<const BlockKey>(&key, 1)));
          gok[i] = standing[g][i] == Standing::kDevice || standing[g][i] == Standing::kHost;
          gokf[i] = gok[i] || standing[g][i] == Standing::kInFlight;
        }
        break;
      }
    }
    std::uint32_t alone = 0, alone_f = 0;
    for (std::uint32_t i = 0; i <= K; ++i) {
      ok[i] &= gok[i];
      okf[i] &= gokf[i];
      if (gok[i]) alone = i;
      if (gokf[i]) alone_f = i;
    }
    p.match.groups[g].alone_hit_tokens = alone * L;
    p.match.groups[g].in_flight = alone_f > alone;
  }
  std::uint32_t hit = 0, hit_f = 0;
  for (std::uint32_t i = 0; i <= K; ++i) {
    if (ok[i]) hit = i;
    if (okf[i]) hit_f = i;
  }
  const std::uint32_t h = hit * L;
  p.match.hit_tokens = h;
  p.match.stopped_at_in_flight = hit_f > hit;
  std::uint32_t weakest = limit;
  for (std::uint32_t g = 0; g < num_groups; ++g)
    if (p.match.groups[g].alone_hit_tokens < weakest) {
      weakest = p.match.groups[g].alone_hit_tokens;
      p.match.limited_by = g;
    }
  p.rec.hit_tokens = h;

  // Each group's admissions for hit h, in the order they are made: hits first (device, then host), so that no
  // eviction made for this request's own fresh blocks can take a block it is about to serve; then fresh keyed
  // blocks; then unkeyed ones.
  for (std::uint32_t g = 0; g < num_groups; ++g) {
    const KvGroupConfig& c = config_.groups[g];
    const std::uint32_t B = c.block_tokens;
    const std::span<const BlockKey> chain = r.chains[g];
    GroupRec& gr = p.rec.groups[g];
    const std::uint32_t extra = gr.num_positions - gr.num_keyed;
    switch (c.kind) {
      case GroupKind::kFull: {
        Sub s;
        s.role = Role::kChain;
        s.hits = h / B;
        s.extra = extra;
        gr.chain_device_hits = std::min(gr.chain_device_hits, s.hits);
        gr.need = (s.hits - gr.chain_device_hits) + (gr.num_keyed - s.hits) + extra;
        gr.subs.push_back(s);
        break;
      }
      case GroupKind::kSlidingWindow: {
        const std::uint32_t W = c.window_tokens;
        const std::uint32_t first = window_start(h, W) / B, end = h / B;
        gr.first_block = first;
        for (Standing want : {Standing::kDevice, Standing::kHost})
          for (std::uint32_t j = first; j < end; ++j)
            if (standing[g][j] == want) {
              Sub s;
              s.role = Role::kBlock;
              s.pos = j;
              s.key = group_block_key(chain[j], g, c.kind);
              s.hits = 1;
              s.device_hit = want == Standing::kDevice;
              if (!s.device_hit) ++gr.need;
              gr.subs.push_back(s);
            }
        for (std::uint32_t j = end; j < gr.num_keyed; ++j) {
          Sub s;
          s.role = Role::kBlock;
          s.pos = j;
          s.key = group_block_key(chain[j], g, c.kind);
          gr.subs.push_back(s);
          ++gr.need;
        }
        if (extra > 0) {
          Sub s;
          s.role = Role::kExtra;
          s.extra = extra;
          gr.subs.push_back(s);
          gr.need += extra;
        }
        break;
      }
      case GroupKind::kState: {
        if (h > 0) {
          Sub s;
          s.role = Role::kStateIn;
          s.pos = h;
          s.key = group_block_key(chain[h / B - 1], g, c.kind);
          s.hits = 1;
          s.device_hit = standing[g][hit] == Standing::kDevice;
          if (!s.device_hit) ++gr.need;
          gr.subs.push_back(s);
        }
        std::vector<std::uint32_t> saves = r.save_states_at;
        // By default the last boundary a hit can end at (a multiple of the granularity, so of B too).
        if (saves.empty() && r.num_tokens >= L) saves.push_back(r.num_tokens / L * L);
        for (std::uint32_t t : saves) {
          if (t <= h) continue;  // the state at the hit, or before it: already cached, or past
          Sub s;
          s.role = Role::kStateSave;
          s.pos = t;
          s.key = group_block_key(chain[t / B - 1], g, c.kind);
          gr.subs.push_back(s);
          ++gr.need;
        }
        Sub w;  // the running state
        w.role = Role::kExtra;
        w.extra = 1;
        gr.subs.push_back(w);
        ++gr.need;
        gr.num_positions = 0;
        break;
      }
    }
  }
  return p;
}

Result<HybridMatch> HybridCache::match(const HybridRequest& request) const {
  // Nothing to look up is a match of nothing (admit and announce refuse it: they would hold no block).
  if (std::uint64_t{request.num_tokens} + request.extra_tokens == 0 && request.chains.size() == config_.groups.size() &&
      request.save_states_at.empty() &&
      std::all_of(request.chains.begin(), request.chains.end(), [](const auto& c) { return c.empty(); })) {
    HybridMatch none;
    none.groups.resize(config_.groups.size());
    return none;
  }
  KVTIER_ASSIGN_OR_RETURN(Plan p, plan(request));
  return std::move(p.match);
}

void HybridCache::pin(std::uint32_t group, const BlockKey& key) { ++pins_[group][key]; }

void HybridCache::unpin(std::uint32_t group, const BlockKey& key) {
  auto it = pins_[group].find(key);
  if (it == pins_[group].end()) return;  // check_invariants() reports the mismatch
  if (--it->second == 0) pins_[group].erase(it);
}

Status HybridCache::close(std::uint32_t group, GroupRec& gr, Sub& s) {
  Status st = managers_[group]->release(s.id);
  s.open = false;
  if (s.role == Role::kChain) {
    for (std::uint32_t i = 0; i < gr.chain_pinned; ++i) unpin(group, gr.chain_keys[i]);
    gr.chain_pinned = 0;
  } else if (s.hits > 0 || s.committed) {
    unpin(group, s.key);
  }
  return st;
}

void HybridCache::release_subs(Rec& rec) {
  for (std::uint32_t g = 0; g < rec.groups.size(); ++g)
    for (Sub& s : rec.groups[g].subs)
      if (s.open) close(g, rec.groups[g], s).ignore_error();  // our own open admission: cannot be NotFound
}

Result<HybridAdmission> HybridCache::admit(const HybridRequest& request) {
  KVTIER_ASSIGN_OR_RETURN(Plan p, plan(request));
  Rec& rec = p.rec;
  const std::uint32_t num_groups = this->num_groups();

  // Before anything is admitted: can every group give its blocks? Free blocks, plus the ones evictions could
  // free, less this request's own device hits that are counted there now (they are unpinned; admitting pins
  // them). A pin by another open admission is known from pins_, so a prefix shared with a running request is
  // not counted twice.
  for (std::uint32_t g = 0; g < num_groups; ++g) {
    const GroupRec& gr = rec.groups[g];
    const CacheManager& m = *managers_[g];
    const TierStats dev = m.stats().tiers[static_cast<int>(Tier::kDevice)];
    if (gr.need > dev.capacity) {
      ++stats_.refusals;
      return ResourceExhausted(fmt::format("hybrid admit: {}: needs {} device blocks, its pool has {}",
                                           group_label(config_.groups[g], g), gr.need, dev.capacity));
    }
    const std::uint32_t free_now = dev.capacity - dev.used;
    if (gr.need <= free_now) continue;
    // Only hits counted as reclaimable now are taken from that count: a hit with a move in flight below it (a
    // backup, a storage write, a load) was never in it, and subtracting it too refused requests the group could
    // serve.
    std::vector<BlockKey> own;
    for (const Sub& s : gr.subs) {
      if (s.role == Role::kChain)
        own.insert(own.end(), gr.chain_keys.begin(), gr.chain_keys.begin() + gr.chain_device_hits);
      else if (s.device_hit)
        own.push_back(s.key);
    }
    const std::uint32_t own_unpinned = m.reclaimable_device_blocks_of(own);
    const std::uint32_t reclaimable = m.reclaimable_device_blocks();
    const std::uint32_t evictable = reclaimable > own_unpinned ? reclaimable - own_unpinned : 0;
    if (free_now + evictable < gr.need) {
      ++stats_.refusals;
      return ResourceExhausted(fmt::format(
          "hybrid admit: {}: needs {} device blocks: {} free, {} more evictable (the rest pinned or in flight)",
          group_label(config_.groups[g], g), gr.need, free_now, evictable));
    }
  }

  // Admit every group; any failure releases what this call admitted.
  for (std::uint32_t g = 0; g < num_groups; ++g) {
    GroupRec& gr = rec.groups[g];
    CacheManager& m = *managers_[g];
    // The group's host hits are admitted one key at a time: each call's evictions leave the others' host copies
    // in place (a demotion for the first could take the host block of the next, a hit planned and then gone).
    std::vector<BlockKey> host_hits;
    for (const Sub& s : gr.subs)
      if (s.role != Role::kChain && s.hits > 0 && !s.device_hit) host_hits.push_back(s.key);
    for (Sub& s : gr.subs) {
      Result<Admission> a = [&]() -> Result<Admission> {
        switch (s.role) {
          case Role::kChain: return m.admit(gr.chain_keys, s.extra, s.hits);
          case Role::kExtra: return m.admit({}, s.extra);
          default: return m.admit(std::span<const BlockKey>(&s.key, 1), 0, s.hits, host_hits);
        }
      }();
      Status failed;
      if (!a.ok()) {
        failed = a.status().with_context(fmt::format("hybrid admit: {}", group_label(config_.groups[g], g)));
      } else {
        s.id = a->id;
        s.open = true;
        s.admission = *a;
        const std::uint32_t planned = s.hits;
        s.hits = a->device_hit_blocks + a->host_hit_blocks;
        if (s.role == Role::kChain) {
          for (std::uint32_t i = 0; i < s.hits; ++i) pin(g, gr.chain_keys[i]);
          gr.chain_pinned = s.hits;
        } else if (s.hits > 0) {
          pin(g, s.key);
        }
        // A planned hit that is gone: only this request's own evictions, made since the match, can have taken
        // it (a host copy dropped for want of host blocks). Serving less than planned would hand the forward a
        // block it does not compute and nobody filled.
        if (s.hits != planned)
          failed = ResourceExhausted(fmt::format(
              "hybrid admit: {}: {} served block(s) planned at position {}, {} found after this request's own "
              "evictions (host tier full): retry after the plan's acks",
              group_label(config_.groups[g], g), planned, s.pos, s.hits));
      }
      if (!failed.ok()) {
        bool admitted_some = false;
        for (const GroupRec& x : rec.groups)
          for (const Sub& y : x.subs) admitted_some |= y.open;
        release_subs(rec);
        if (failed.code() == StatusCode::kResourceExhausted) {
          ++stats_.refusals;
          if (admitted_some) ++stats_.rollbacks;
        }
        return failed;
      }
    }
  }

  HybridAdmission out;
  out.id = next_id_++;
  out.hit_tokens = rec.hit_tokens;
  out.limited_by = p.match.limited_by;
  out.stopped_at_in_flight = p.match.stopped_at_in_flight;
  for (std::uint32_t g = 0; g < num_groups; ++g) {
    const KvGroupConfig& c = config_.groups[g];
    const GroupRec& gr = rec.groups[g];
    GroupAdmission ga;
    ga.group = g;
    ga.kind = c.kind;
    ga.first_block = gr.first_block;
    if (c.kind != GroupKind::kState) ga.device_blocks.assign(gr.num_positions, kNoBlock);
    for (const Sub& s : gr.subs) {
      const Admission& a = s.admission;
      ga.hit_blocks += a.device_hit_blocks + a.host_hit_blocks;
      ga.loaded_blocks += a.host_hit_blocks;
      ga.new_blocks += a.new_blocks;
      ga.extra_blocks += a.extra_blocks;
      switch (s.role) {
        case Role::kChain: ga.device_blocks = a.device_blocks; break;
        case Role::kBlock: ga.device_blocks[s.pos] = a.device_blocks[0]; break;
        case Role::kStateIn: ga.state_in = a.device_blocks[0]; break;
        case Role::kStateSave: ga.state_saves.push_back(StateSave{s.pos, a.device_blocks[0]}); break;
        case Role::kExtra:
          if (c.kind == GroupKind::kState)
            ga.state_work = a.device_blocks[0];
          else
            std::copy(a.device_blocks.begin(), a.device_blocks.end(), ga.device_blocks.begin() + gr.num_keyed);
          break;
      }
    }
    out.groups.push_back(std::move(ga));
  }
  ++stats_.admissions;
  stats_.lookup_tokens += request.num_tokens;
  stats_.hit_tokens += rec.hit_tokens;
  admissions_.emplace(out.id, std::make_unique<Rec>(std::move(rec)));
  return out;
}

Status HybridCache::commit(HybridAdmissionId id, std::uint32_t num_computed_tokens) {
  auto it = admissions_.find(id);
  if (it == admissions_.end()) return NotFound(fmt::format("hybrid commit: admission {} not found", id));
  Rec& rec = *it->second;
  const std::uint64_t span = std::uint64_t{rec.num_tokens} + rec.extra_tokens;
  if (num_computed_tokens > span)
    return InvalidArgument(
        fmt::format("hybrid commit: num_computed_tokens {} > num_tokens {} + extra_tokens {} of admission {}",
                    num_computed_tokens, rec.num_tokens, rec.extra_tokens, id));
  if (num_computed_tokens <= rec.committed_tokens) return Status::Ok();
  // Tokens past the hit were computed on the hit's bytes in every group, so they join the index only once every
  // group's loads have landed. (A CacheManager breaks the chain below a failed load by itself; window and state
  // blocks are entries of their own, and the groups do not see each other's failures.)
  if (num_computed_tokens > rec.hit_tokens && !rec.load_failed) {
    KVTIER_ASSIGN_OR_RETURN(HybridAdmissionStatus st, admission_status(id));
    if (st.failed) {
      rec.load_failed = true;
      rec.failed_group = st.failed_group;
    } else if (st.loading_blocks > 0) {
      return FailedPrecondition(
          fmt::format("hybrid commit: admission {}: {} hit blocks are still loading; commit tokens past the hit ({}) "
                      "once admission_status() is ready",
                      id, st.loading_blocks, rec.hit_tokens));
    }
  }
  rec.committed_tokens = num_computed_tokens;
  const bool index = !rec.load_failed;
  const std::uint32_t n = num_computed_tokens;
  const std::uint32_t keyed_tokens = std::min(n, rec.num_tokens);
  for (std::uint32_t g = 0; g < rec.groups.size(); ++g) {
    const KvGroupConfig& c = config_.groups[g];
    auto wrap = [&](Status st) {
      return st.ok() ? st : st.with_context(fmt::format("hybrid commit: {}", group_label(c, g)));
    };
    CacheManager& m = *managers_[g];
    GroupRec& gr = rec.groups[g];
    const std::uint32_t B = c.block_tokens;
    for (Sub& s : gr.subs) {
      if (!s.open) continue;
      switch (s.role) {
        case Role::kChain: {
          if (!index) break;
          const std::uint32_t blocks = keyed_tokens / B;
          KVTIER_RETURN_IF_ERROR(wrap(m.commit(s.id, blocks)));
          for (; gr.chain_pinned < blocks; ++gr.chain_pinned) pin(g, gr.chain_keys[gr.chain_pinned]);
          break;
        }
        case Role::kBlock:
          if (index && s.hits == 0 && !s.committed && s.pos < keyed_tokens / B) {
            KVTIER_RETURN_IF_ERROR(wrap(m.commit_all(s.id)));
            s.committed = true;
            pin(g, s.key);
          }
          // No token from n on attends to a block that ends at or before window_start(n, W): it leaves the request.
          if (s.pos < window_start(n, c.window_tokens) / B) KVTIER_RETURN_IF_ERROR(wrap(close(g, gr, s)));
          break;
        case Role::kStateIn:
          // The forward read it when it started from the hit: the request holds the running state now.
          if (n > rec.hit_tokens) KVTIER_RETURN_IF_ERROR(wrap(close(g, gr, s)));
          break;
        case Role::kStateSave:
          // Written when the forward passed it: index it, and let it go (the request does not read it again).
          if (s.pos <= keyed_tokens) {
            if (index) KVTIER_RETURN_IF_ERROR(wrap(m.commit_all(s.id)));
            KVTIER_RETURN_IF_ERROR(wrap(m.release(s.id)));
            s.committed = index;
            s.open = false;
          }
          break;
        case Role::kExtra: break;
      }
    }
  }
  return Status::Ok();
}

Status HybridCache::release(HybridAdmissionId id) {
  auto it = admissions_.find(id);
  if (it == admissions_.end()) return NotFound(fmt::format("hybrid release: admission {} not found", id));
  release_subs(*it->second);
  admissions_.erase(it);
  return Status::Ok();
}

Result<HybridAdmissionStatus> HybridCache::admission_status(HybridAdmissionId id) const {
  auto it = admissions_.find(id);
  if (it == admissions_.end()) return NotFound(fmt::format("hybrid admission_status: admission {} not found", id));
  HybridAdmissionStatus out;
  const Rec& rec = *it->second;
  for (std::uint32_t g = 0; g < rec.groups.size(); ++g)
    for (const Sub& s : rec.groups[g].subs) {
      if (!s.open || s.admission.host_hit_blocks == 0) continue;  // only loads can be pending or fail
      KVTIER_ASSIGN_OR_RETURN(AdmissionStatus st, managers_[g]->admission_status(s.id));
      out.loading_blocks += st.loading_blocks;
      if (st.failed && !out.failed) {
        out.failed = true;
        out.failed_group = g;
      }
    }
  if (rec.load_failed && !out.failed) {
    out.failed = true;
    out.failed_group = rec.failed_group;
  }
  out.ready = !out.failed && out.loading_blocks == 0;
  return out;
}

HybridPlan HybridCache::take_plan() {
  HybridPlan p;
  p.groups.reserve(managers_.size());
  for (auto& m : managers_) p.groups.push_back(m->take_plan());
  return p;
}

Status HybridCache::ack_plan(std::uint32_t group, const StepPlan& plan, const Status& status) {
  if (group >= managers_.size())
    return OutOfRange(fmt::format("hybrid ack_plan: group {} >= {} KV groups", group, managers_.size()));
  return managers_[group]
      ->ack_plan(plan, status)
      .with_context(fmt::format("hybrid ack_plan: {}", group_label(config_.groups[group], group)));
}

Status HybridCache::ack_plan(const HybridPlan& plan, const Status& status) {
  if (plan.groups.size() != managers_.size())
    return InvalidArgument(
        fmt::format("hybrid ack_plan: plan has {} group plans for {} KV groups", plan.groups.size(), managers_.size()));
  Status first = Status::Ok();  // every group acknowledged; the first error returned
  for (std::uint32_t g = 0; g < plan.groups.size(); ++g) {
    Status s = ack_plan(g, plan.groups[g], status);
    if (!s.ok() && first.ok()) first = std::move(s);
  }
  return first;
}

Status HybridCache::apply_completions(std::span<const GroupCompletion> completions) {
  for (std::size_t i = 0; i < completions.size(); ++i)
    if (completions[i].group >= managers_.size())
      return OutOfRange(fmt::format("hybrid apply_completions: completion {} names group {} of {} KV groups", i,
                                    completions[i].group, managers_.size()));
  std::vector<std::vector<Completion>> per_group(managers_.size());
  for (const GroupCompletion& c : completions) per_group[c.group].push_back(c.completion);
  Status first = Status::Ok();  // every group's completions applied; the first error returned
  for (std::uint32_t g = 0; g < per_group.size(); ++g)
    if (!per_group[g].empty()) {
      Status s = cache::apply_completions(*managers_[g], per_group[g]);
      if (!s.ok() && first.ok())
        first = s.with_context(fmt::format("hybrid ack: {}", group_label(config_.groups[g], g)));
    }
  return first;
}

HybridStats HybridCache::stats() const {
  HybridStats s = stats_;
  s.groups.clear();
  for (const auto& m : managers_) s.groups.push_back(m->stats());
  return s;
}

Status HybridCache::check_invariants() const {
  for (std::uint32_t g = 0; g < managers_.size(); ++g)
    KVTIER_RETURN_IF_ERROR(managers_[g]->check_invariants().with_context(
        fmt::format("hybrid cache: {}", group_label(config_.groups[g], g))));
  // pins_ is exactly what the open admissions pin.
  std::vector<std::unordered_map<BlockKey, std::uint32_t, BlockKeyHash>> want(managers_.size());
  for (const auto& [id, rec] : admissions_)
    for (std::uint32_t g = 0; g < rec->groups.size(); ++g) {
      const GroupRec& gr = rec->groups[g];
      for (const Sub& s : gr.subs) {
        if (!s.open) continue;
        auto st = managers_[g]->admission_status(s.id);
        if (!st.ok())
          return Internal(fmt::format("hybrid cache: admission {} holds {} admission {} its manager does not know", id,
                                      group_label(config_.groups[g], g), s.id));
        if (s.role == Role::kChain)
          for (std::uint32_t i = 0; i < gr.chain_pinned; ++i) ++want[g][gr.chain_keys[i]];
        else if (s.hits > 0 || s.committed)
          ++want[g][s.key];
      }
    }
  for (std::uint32_t g = 0; g < managers_.size(); ++g)
    if (want[g] != pins_[g])
      return Internal(fmt::format("hybrid cache: {}: {} keys counted pinned, the open admissions pin {}",
                                  group_label(config_.groups[g], g), pins_[g].size(), want[g].size()));
  return Status::Ok();
}

Result<const CacheManager*> HybridCache::group_manager(std::uint32_t group) const {
  if (group >= managers_.size())
    return OutOfRange(fmt::format("hybrid cache: group {} >= {} KV groups", group, managers_.size()));
  return static_cast<const CacheManager*>(managers_[group].get());
}

Status HybridCache::enable_kv_events(metrics::Medium storage_medium) {
  // Every group or none: the groups share one medium, so a change is refused by the first (group 0) already.
  for (std::uint32_t g = 0; g < managers_.size(); ++g)
    KVTIER_RETURN_IF_ERROR(managers_[g]
                               ->enable_kv_events(config_.groups[g].block_tokens, storage_medium)
                               .with_context(fmt::format("hybrid {}", group_label(config_.groups[g], g))));
  return Status::Ok();
}

std::vector<GroupEvent> HybridCache::take_events() {
  std::vector<GroupEvent> out;
  for (std::uint32_t g = 0; g < managers_.size(); ++g)
    for (metrics::KvEvent& e : managers_[g]->take_events()) out.push_back(GroupEvent{g, std::move(e)});
  return out;
}

Status HybridCache::attach_metrics(metrics::Registry& registry, const metrics::Labels& labels) {
  for (const auto& [name, value] : labels)
    if (name == "kv_group")
      return InvalidArgument(fmt::format(
          "hybrid attach_metrics: label kv_group=\"{}\" given: the hybrid cache sets it to each group's name", value));
  for (std::uint32_t g = 0; g < managers_.size(); ++g)
    KVTIER_RETURN_IF_ERROR(
        managers_[g]
            ->attach_metrics(registry, metrics::with_labels(labels, {{"kv_group", config_.groups[g].name}}))
            .with_context(fmt::format("hybrid attach_metrics: {}", group_label(config_.groups[g], g))));
  return Status::Ok();
}

Status HybridCache::reset() {
  if (!admissions_.empty())
    return FailedPrecondition(
        fmt::format("hybrid reset: {} admission(s) open: release them first", admissions_.size()));
  for (std::uint32_t g = 0; g < managers_.size(); ++g)
    KVTIER_RETURN_IF_ERROR(
        managers_[g]->reset().with_context(fmt::format("hybrid reset: {}", group_label(config_.groups[g], g))));
  return Status::Ok();
}

Result<HybridQueuedId> HybridCache::announce(const HybridRequest& request, const RequestHints& hints) {
  KVTIER_RETURN_IF_ERROR(validate(request).with_context("hybrid announce"));
  // The largest hit the request can have: what admit() would serve if every group held it.
  std::uint32_t h = std::min(request.num_tokens, request.max_hit_tokens);
  h -= h % granularity_;
  std::vector<std::pair<std::uint32_t, QueuedId>> made;
  auto undo = [&] {
    for (const auto& [g, q] : made)
      // Announced by this call a moment ago: nothing can refuse it. Taken back, not scheduled: no retention.
      managers_[g]->withdraw(q, /*retain=*/false).ignore_error();
  };
  std::vector<BlockKey> keys;
  for (std::uint32_t g = 0; g < num_groups(); ++g) {
    const KvGroupConfig& c = config_.groups[g];
    const std::span<const BlockKey> chain = request.chains[g];
    const std::uint32_t B = c.block_tokens;
    // One CacheManager announcement per chain: a full group's blocks form one; a window's blocks and a state
    // are root-level entries, each a chain of one.
    std::vector<std::pair<std::uint32_t, std::uint32_t>> spans;  // [first, end) of `chain`, announced together
    switch (c.kind) {
      case GroupKind::kFull:
        if (h / B > 0) spans.emplace_back(0, h / B);
        break;
      case GroupKind::kSlidingWindow: {
        const std::uint32_t W = c.window_tokens;
        for (std::uint32_t j = window_start(h, W) / B; j < h / B; ++j) spans.emplace_back(j, j + 1);
        break;
      }
      case GroupKind::kState:
        if (h / B > 0) spans.emplace_back(h / B - 1, h / B);
        break;
    }
    for (const auto& [first, end] : spans) {
      keys.clear();
      for (std::uint32_t j = first; j < end; ++j) keys.push_back(group_block_key(chain[j], g, c.kind));
      auto q = managers_[g]->announce(keys, hints);
      if (!q.ok()) {
        undo();
        return q.status().with_context(fmt::format("hybrid announce: {}", group_label(c, g)));
      }
      made.emplace_back(g, *q);
    }
  }
  const HybridQueuedId id = next_queued_++;
  announced_.emplace(id, std::move(made));
  return id;
}

Status HybridCache::withdraw(HybridQueuedId id) {
  auto it = announced_.find(id);
  if (it == announced_.end()) {
    // As CacheManager::withdraw tells them apart: an id never handed out, or one withdrawn before.
    if (id == 0 || id >= next_queued_)
      return NotFound(fmt::format("hybrid withdraw: announcement {} was never made", id));
    return FailedPrecondition(fmt::format("hybrid withdraw: announcement {} was withdrawn already", id));
  }
  const auto made = std::move(it->second);
  announced_.erase(it);
  Status first;
  for (const auto& [g, q] : made) {
    Status s = managers_[g]->withdraw(q);
    if (!s.ok() && first.ok())
      first = s.with_context(fmt::format("hybrid withdraw: {}", group_label(config_.groups[g], g)));
  }
  return first;
}

Status HybridPlanExecutor::execute(const HybridPlan& plan) {
  if (plan.groups.size() != executors_.size())
    return InvalidArgument(fmt::format("hybrid executor: plan has {} group plans for {} executors", plan.groups.size(),
                                       executors_.size()));
  for (std::uint32_t g = 0; g < plan.groups.size(); ++g)
    if (!plan.groups[g].empty() && executors_[g] == nullptr)
      return InvalidArgument(
          fmt::format("hybrid executor: group {} has {} moves and no executor", g, plan.groups[g].size()));
  // Every group gets its plan even after another's execute() failed: each executor reports its own moves (failed
  // ones included) at a later poll(), and a group left out never would. The first error is returned.
  Status first = Status::Ok();
  for (std::uint32_t g = 0; g < plan.groups.size(); ++g)
    if (!plan.groups[g].empty()) {
      Status s = executors_[g]->execute(plan.groups[g]);
      if (!s.ok() && first.ok()) first = s.with_context(fmt::format("hybrid executor: group {}", g));
    }
  return first;
}

std::vector<GroupCompletion> HybridPlanExecutor::poll() {
  std::vector<GroupCompletion> out;
  for (std::uint32_t g = 0; g < executors_.size(); ++g) {
    if (executors_[g] == nullptr) continue;
    for (Completion& c : executors_[g]->poll()) out.push_back(GroupCompletion{g, std::move(c)});
  }
  return out;
}

}  // namespace kvtier::cache
