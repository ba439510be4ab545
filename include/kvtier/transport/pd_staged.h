// Prefill/decode transfer of KV that lives in device memory the transport cannot reach (CUDA memory with
// Debian's UCX, which has no CUDA lanes): the staged path. Each side keeps its blocks in device memory and
// moves them through a pinned host staging BlockSpace with the CopyEngine; the PD protocol of pd.h runs
// between the two staging spaces, unchanged (checksums, leases, push and pull, layer by layer).
//
// Prefill side. layer_ready_after(id, layer, compute_done) makes the endpoint's copy stream wait for
// `compute_done` (a device-side wait: the host never synchronises the compute stream), enqueues the layer's
// device -> staging copy behind it, records a staging event, and declares the layer ready to the PD endpoint
// when that event has completed. Layer L's copy therefore runs while layer L-1 is on the wire. A staging copy
// that fails (its event reports an error) fails the transfer: that layer and every layer not yet sent are
// reported to the decode side as not sendable, so their blocks are failed there at once, never loaded.
//
// Decode side. As the PD endpoint reports a layer final on the wire, a progress thread enqueues the layer's
// staging -> device copy on the endpoint's copy stream and records an event behind it. The layer's state, as
// this endpoint reports it, is final only when that copy completed:
//   - loaded / partial: the wire verified (every / some) block of the layer and the copy succeeded;
//   - failed: the wire failed the layer, or its staging copy failed (then no block of that layer is loaded).
// Two waits per layer, each with a deadline: layer_event() returns once the layer's copy is enqueued, with the
// event the forward's stream can wait on (Device::wait, no host sync); wait_layer() returns once the layer is
// final in device memory. A forward that ran on the event must still check the layer's final state before its
// blocks are trusted (committed to a prefix index): the event also completes when the copy failed.
//
// Staging memory. Each endpoint owns a pool of whole staging blocks (every layer of a block), taken per
// transfer (one per block of the transfer) and returned on forget(). begin()/start() refuse with
// kResourceExhausted when the pool has too few free blocks (back-pressure: retry after a forget()). Staging
// is per prompt, not a ring of layers: a transfer of n blocks holds n staging blocks for its lifetime.
// Staging blocks return to the pool only when no byte can still land in them (the PD endpoint's reclaimable
// rule) and every staging copy that touches them has completed; the device blocks likewise.
//
// Lifetime. The staging memory (StagingSpace) must outlive the transport (its regions stay registered there);
// destroy the staged endpoint, then the transport, then the staging memory. The device, the copy engine and
// the device BlockSpace's memory outlive the endpoint. The endpoint registers the staging planes as the first
// regions of a fresh transport, as pd.h requires.
//
// Thread-safety: every method may be called from any thread. Errors as pd.h, plus kResourceExhausted (staging
// pool), kInvalidArgument (spaces of another layout, staging not pinned host, device space not on `device`).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvtier/backend/device.h"
#include "kvtier/copy/copy_engine.h"
#include "kvtier/core/layout.h"
#include "kvtier/core/status.h"
#include "kvtier/transport/pd.h"

namespace kvtier::transport {

// Pinned host staging blocks: one allocation, layer-first (a plane per (layer, role)). With `transport`, the memory
// is the transport's (Transport::allocate_host: where its lanes reach it best, e.g. UCX's shared-memory lanes copy
// straight into it) pinned with device.register_host; the transport must then outlive the StagingSpace. Without,
// the device allocates it (allocate_pinned).
struct StagingSpace {
  std::unique_ptr<PinnedMemory> memory;
  BlockSpace space;
  static Result<StagingSpace> allocate(Device& device, const KvLayout& layout, std::uint64_t num_blocks,
                                       Transport* transport = nullptr);
};

struct StagedOptions {
  PdOptions pd;
  // Strategy of the staging copies (kAuto: the engine picks per layer).
  CopyStrategy strategy = CopyStrategy::kAuto;
  // Decode side: how often the progress thread looks for layers that reached the staging space and for
  // completed staging copies.
  std::chrono::microseconds poll_interval{100};
};

class PdStagedPrefill {
 public:
  virtual ~PdStagedPrefill() = default;
  // `device_blocks`: where the prompt's KV lives (memory of `device`); `staging`: pinned host, same layout.
  static Result<std::unique_ptr<PdStagedPrefill>> create(Transport& transport, Device& device, CopyEngine& engine,
                                                         BlockSpace device_blocks, BlockSpace staging,
                                                         StagedOptions options = {});

  // As PdPrefill::begin, `src_blocks` being device block ids; takes src_blocks.size() staging blocks.
  virtual Status begin(PeerId decode, TransferId id, std::vector<BlockId> src_blocks) = 0;
  // The layer's device bytes are complete once `compute_done` (recorded on the compute stream) has fired.
  // Only the event's current capture matters: it may be re-recorded or destroyed after the call.
  virtual Status layer_ready_after(TransferId id, std::uint32_t layer, Event& compute_done) = 0;
  // The layer's device bytes are complete now.
  virtual Status layer_ready(TransferId id, std::uint32_t layer) = 0;
  // Several layers complete now: every layer is checked (in range, not declared, not listed twice) before any is
  // declared, so a refused call declares none.
  virtual Status layers_ready(TransferId id, std::span<const std::uint32_t> layers) = 0;
  // As PdPrefill; reclaimable also needs every staging copy of the transfer completed (the device source
  // blocks are then free too).
  virtual Result<PrefillStatus> status(TransferId id) const = 0;
  virtual Result<PrefillStatus> wait(TransferId id, std::chrono::nanoseconds timeout) = 0;
  // Forgets a final, reclaimable transfer and returns its staging blocks; kFailedPrecondition otherwise.
  virtual Status forget(TransferId id) = 0;
  virtual std::uint64_t staging_blocks_free() const = 0;
  // As PdPrefill::abort_waits / PdDecode::abort_waits (layer_event included).
  virtual void abort_waits() = 0;
  // As PdPrefill::disconnect_peer / PdDecode::disconnect_peer.
  virtual Status disconnect_peer(PeerId peer) = 0;
};

class PdStagedDecode {
 public:
  virtual ~PdStagedDecode() = default;
  static Result<std::unique_ptr<PdStagedDecode>> create(Transport& transport, Device& device, CopyEngine& engine,
                                                        BlockSpace device_blocks, BlockSpace staging,
                                                        StagedOptions options = {});

  // As PdDecode::start, `dst_blocks` being device block ids; takes dst_blocks.size() staging blocks.
  virtual Status start(PeerId prefill, TransferId id, PdMode mode, std::vector<BlockId> dst_blocks) = 0;
  // Until the layer's staging -> device copy is enqueued: the event behind it (valid until forget()).
  // kDataLoss / kUnavailable (the layer's error) when the layer failed before reaching device memory;
  // kTimedOut at the deadline.
  virtual Result<Event*> layer_event(TransferId id, std::uint32_t layer, std::chrono::nanoseconds timeout) = 0;
  // Until the layer is final in device memory (loaded, partial or failed), or kTimedOut.
  virtual Result<LayerState> wait_layer(TransferId id, std::uint32_t layer, std::chrono::nanoseconds timeout) = 0;
  // As PdDecode: layers and block_loaded describe device memory (a block is loaded when every layer of it
  // was verified on the wire and copied into device memory).
  virtual Result<DecodeStatus> status(TransferId id) const = 0;
  virtual Result<DecodeStatus> wait(TransferId id, std::chrono::nanoseconds timeout, bool reclaimable = false) = 0;
  // As PdDecode::cancel.
  virtual Status cancel(TransferId id) = 0;
  // Forgets a final, reclaimable transfer and returns its staging blocks; kFailedPrecondition otherwise.
  virtual Status forget(TransferId id) = 0;
  virtual std::uint64_t staging_blocks_free() const = 0;
  // As PdPrefill::abort_waits / PdDecode::abort_waits (layer_event included).
  virtual void abort_waits() = 0;
  // As PdPrefill::disconnect_peer / PdDecode::disconnect_peer.
  virtual Status disconnect_peer(PeerId peer) = 0;
};

}  // namespace kvtier::transport
