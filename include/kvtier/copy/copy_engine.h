// CopyEngine: batched block copies between two BlockSpaces (GPU->host,
// host->GPU, GPU->GPU) for one layer, some layers or all layers, every role,
// on a stream the caller gives.
//
// A request is a list of (src block, dst block) pairs. Every selected
// (layer, role) plane copies block_bytes from src block i to dst block i.
// Both spaces must have the same KvLayout (fingerprint).
//
// Strategies:
//   kDmaPerRun  one cudaMemcpyAsync per run: pairs whose blocks are adjacent on
//               both sides are merged into one contiguous segment first.
//   kDmaBatch   one cudaMemcpyBatchAsync over all merged segments. Host->GPU
//               batches of small segments (<= gate threshold) are submitted on
//               a "gated" stream (held busy until the whole batch is queued)
//               to avoid the driver's idle-stream cliff.
//   kSmKernel   a gather/scatter kernel with a small, configurable number of
//               CTAs, reading/writing pinned host memory through UVA with
//               16-byte accesses (any size: tails are copied exactly).
//   kAuto       chosen per call from segment size, direction and what else
//               the engine has in flight (see choose()).
// On the host backend each strategy runs its own code path on the stream's
// worker (the kernel strategy runs the same work decomposition as the GPU
// kernel), so every strategy is tested without a GPU.
//
// Validation happens before anything is enqueued: equal list lengths, ids in
// [0, num_blocks), no duplicate destination block, layers and roles in range,
// matching layouts, memory kinds the strategy supports. A rejected request
// writes nothing.
//
// No allocation and no pageable copy per call on the CUDA path: each stream
// gets a persistent ring of pinned + device descriptor slots on first use; a
// slot is reused only after the event recorded behind its last use completed
// (the engine waits for that event if the ring wrapped; pass larger
// `descriptor_slots` to make that rarer).
//
// Thread-safety: copy() may be called concurrently from several threads.
// Calls on the same stream are serialised internally in call order.
// The BlockSpaces' memory must stay valid until the copy completed on the
// stream (the caller owns ordering: record an event after copy()).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "kvtier/core/layout.h"
#include "kvtier/core/status.h"
#include "kvtier/device/device.h"

namespace kvtier {

enum class CopyStrategy : std::uint8_t { kAuto, kDmaPerRun, kDmaBatch, kSmKernel };
std::string_view copy_strategy_name(CopyStrategy s) noexcept;
Result<CopyStrategy> parse_copy_strategy(std::string_view name);

enum class CopyDirection : std::uint8_t { kDeviceToHost, kHostToDevice, kDeviceToDevice, kHostToHost };
std::string_view copy_direction_name(CopyDirection d) noexcept;

struct CopyEngineOptions {
  // SM kernel shape. Host->GPU needs more outstanding reads than GPU->host.
  std::uint32_t sm_ctas_h2d = 16;
  std::uint32_t sm_ctas_d2h = 8;
  std::uint32_t sm_threads_per_cta = 512;
  // Descriptor ring per stream: slots x capacity (pairs per call).
  std::uint32_t descriptor_slots = 8;
  std::uint32_t max_pairs_per_call = 1u << 18;
  // Host->GPU batch descriptors at or below this size are submitted gated.
  std::uint64_t batch_gate_max_segment_bytes = 28 * 1024;
  // kAuto: merged segments at least this large use kDmaPerRun.
  std::uint64_t auto_per_run_min_segment_bytes = 2u << 20;
  // kAuto: segments below this size use the SM kernel when the opposite
  // direction is idle; otherwise (full duplex) DMA batch is kept.
  std::uint64_t auto_kernel_max_segment_bytes = 256 * 1024;
  // Use a high-priority stream for the gate / kernels where applicable.
  bool high_priority_kernels = true;
};

struct CopyRequest {
  const BlockSpace* src = nullptr;
  const BlockSpace* dst = nullptr;
  std::span<const std::int32_t> src_blocks;
  std::span<const std::int32_t> dst_blocks;
  std::span<const std::uint32_t> layers;  // empty: every layer
  RoleMask roles = kAllRoles;             // by Role bit
  CopyStrategy strategy = CopyStrategy::kAuto;
};

struct CopyReport {
  CopyStrategy strategy = CopyStrategy::kAuto;  // what actually ran
  CopyDirection direction = CopyDirection::kDeviceToHost;
  std::uint64_t bytes = 0;     // payload bytes enqueued
  std::uint64_t pairs = 0;     // block pairs
  std::uint64_t segments = 0;  // contiguous segments after run merging
  std::uint32_t ctas = 0;      // CTAs used by the kernel strategy (0 otherwise)
  bool gated = false;          // batch submitted on a gated stream
};

class CopyEngine {
 public:
  static Result<std::unique_ptr<CopyEngine>> create(Device& device, const CopyEngineOptions& options = {});
  virtual ~CopyEngine() = default;

  // Checks a request without enqueuing anything.
  virtual Status validate(const CopyRequest& request) const = 0;
  // Validates, then enqueues the copy on `stream`. Returns once enqueued.
  virtual Result<CopyReport> copy(const CopyRequest& request, Stream& stream) = 0;
  // The strategy kAuto would pick for this request now.
  virtual CopyStrategy choose(const CopyRequest& request) const = 0;
  virtual const CopyEngineOptions& options() const noexcept = 0;
  virtual Device& device() const noexcept = 0;
};

}  // namespace kvtier
