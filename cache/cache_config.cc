#include "kvtier/cache/cache_config.h"

#include <vector>

#include "kvtier/backend/eviction_policy.h"

namespace kvtier::cache {
namespace {

// A policy name is valid when make_policy builds it; belady is given a dummy
// oracle here because the real one is set in code (CacheManager::create
// rejects belady without it).
Status validate_policy(std::string_view name) {
  NextUseOracle dummy = [](const BlockKey&, std::uint64_t) -> std::uint64_t { return 0; };
  auto policy = make_policy(name, 1, name == "belady" ? dummy : NextUseOracle{});
  return policy.ok() ? Status::Ok() : policy.status();
}

// The lower tiers' policies: online ones only (belady needs the next-use oracle that only the offline replay sets,
// and only on the device tier: CacheManager::create refused it later without naming the knob).
Status validate_lower_tier_policy(std::string_view name) {
  if (name == "belady")
    return InvalidArgument("policy 'belady' is the offline replay's device policy (it needs a next-use oracle)");
  return validate_policy(name);
}

}  // namespace

void bind_cache_config(ConfigTable& t, CacheConfig& c, const std::string& p) {
  t.add(p + ".device_blocks", &c.device_blocks, "device tier capacity in blocks (required >= 1)");
  t.add(p + ".host_blocks", &c.host_blocks, "host tier capacity in blocks (0: no host tier)");
  t.add(p + ".storage_blocks", &c.storage_blocks, "storage tier capacity in blocks (0: no storage tier)");
  t.add(p + ".device_policy", &c.device_policy,
        "eviction policy of the device tier: adaptive, lru, s3fifo, sieve, arc, lrfu[:boost], duel:A+B[+...]",
        validate_policy);
  t.add(p + ".host_policy", &c.host_policy, "eviction policy of the host tier", validate_lower_tier_policy);
  t.add(p + ".storage_policy", &c.storage_policy, "eviction policy of the storage tier", validate_lower_tier_policy);
  const std::vector<WritePolicy> write_policies{WritePolicy::kWriteThrough, WritePolicy::kWriteThroughSelective,
                                                WritePolicy::kWriteBack};
  t.add_enum(p + ".write_policy", &c.write_policy, parse_write_policy, write_policy_name, write_policies,
             "when committed blocks are copied to the next tier (see cache_manager.h)");
  t.add(p + ".write_through_threshold", &c.write_through_threshold,
        "hits before a write_through_selective backup (>= 1)");
  t.add(p + ".device_watermarks.low", &c.device_watermarks.low, "device free fraction that starts proactive eviction",
        0.0, 1.0);
  t.add(p + ".device_watermarks.high", &c.device_watermarks.high,
        "device free fraction proactive eviction restores (0/0: off)", 0.0, 1.0);
  t.add(p + ".host_watermarks.low", &c.host_watermarks.low, "host free fraction that starts demotion to storage", 0.0,
        1.0);
  t.add(p + ".host_watermarks.high", &c.host_watermarks.high, "host free fraction demotion restores (0/0: off)", 0.0,
        1.0);
  t.add(p + ".contiguous_host_runs", &c.contiguous_host_runs,
        "take an eviction batch's host blocks as one contiguous run when one exists");
  t.add(p + ".lookahead_prefetch_blocks", &c.lookahead_prefetch_blocks,
        "moves per plan that prefetch announced blocks to a faster tier (0: protection only)");
  t.add(p + ".lookahead_max_fraction", &c.lookahead_max_fraction,
        "fraction of a tier that protected copies and look-ahead moves may fill by prefetch", 0.0, 1.0);
  t.add(p + ".lookahead_retain_steps", &c.lookahead_retain_steps,
        "plans a withdrawn request hinted 'continues' (no ttl) keeps its chain protected");
}

}  // namespace kvtier::cache
