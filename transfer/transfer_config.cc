#include "kvtier/transfer/transfer_config.h"

#include <fmt/format.h>

#include <vector>

#include "kvtier/copy/copy_config.h"
#include "kvtier/core/enum_names.h"

namespace kvtier {

constexpr EnumName<StreamPriority> kStreamPriorityEntries[] = {
    {StreamPriority::kNormal, "normal"},
    {StreamPriority::kHigh, "high"},
};
constexpr auto kStreamPriorityNames = enum_table("stream priority", kStreamPriorityEntries);
std::string_view stream_priority_name(StreamPriority priority) noexcept { return kStreamPriorityNames.name(priority); }

Result<StreamPriority> parse_stream_priority(std::string_view name) { return kStreamPriorityNames.parse(name); }

void bind_transfer_manager_config(ConfigTable& t, TransferManagerConfig& c, const std::string& p) {
  std::vector<CopyStrategy> strategies;
  for (int i = 0; i < kNumCopyStrategies; ++i) strategies.push_back(static_cast<CopyStrategy>(i));
  t.add_enum(p + ".evict_strategy", &c.evict_strategy, parse_copy_strategy, copy_strategy_name, strategies,
             "CopyEngine strategy of evictions (device->host)");
  t.add_enum(p + ".load_strategy", &c.load_strategy, parse_copy_strategy, copy_strategy_name, strategies,
             "CopyEngine strategy of loads (host->device)");
  bind_copy_engine_options(t, c.copy_engine, p + ".copy_engine");
  const std::vector<StreamPriority> priorities{StreamPriority::kNormal, StreamPriority::kHigh};
  t.add_enum(p + ".input_priority", &c.input_priority, parse_stream_priority, stream_priority_name, priorities,
             "priority of the input (load) stream");
  t.add_enum(p + ".output_priority", &c.output_priority, parse_stream_priority, stream_priority_name, priorities,
             "priority of the output (eviction) stream");
  t.add(p + ".poll_interval", &c.poll_interval, "progress-thread poll period while work is pending");
  t.add(p + ".max_in_flight_tasks", &c.max_in_flight_tasks,
        "submits beyond this many pending tasks: ResourceExhausted");
  t.add(p + ".retained_finished_tasks", &c.retained_finished_tasks, "finished tasks kept queryable by id");
  t.add(p + ".max_unpolled_completions", &c.max_unpolled_completions,
        "completions kept for poll_completions (oldest dropped)");
  t.add(p + ".latency_samples", &c.latency_samples, "ring of per-layer load latencies (p50/p99)");
  t.add(p + ".shutdown_timeout", &c.shutdown_timeout, "per-stream drain limit in shutdown() (at most 24h)");
  t.add(p + ".event_pool_max_free", &c.event_pool_max_free, "returned events kept for reuse");
  t.add(p + ".host_ready_timeout", &c.host_ready_timeout,
        "wait for kvtier-allocated pinned host memory at create (at most 24h)");
  t.add(p + ".async_submit", &c.async_submit, "enqueue copies on submission threads (false: on the caller's thread)");
}

}  // namespace kvtier
