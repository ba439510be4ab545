// PdReceiver: one decode instance's P/D receives, end to end, through the one data plane
// (docs/architecture.md, "P/D receives"). It ties the three pieces that guard a received block together:
// the CacheManager (the blocks, the prefix index), the TransferManager (the external write: hazards, per-layer
// waits) and a PD decode endpoint (PdDecode, or PdStagedDecode for device memory the transport cannot reach).
//
// A receive, for one prompt (transfer id, prefill peer, mode, the prompt's block keys):
//   start()  (scheduler thread)
//     1. CacheManager::admit_receive(keys, options): the blocks the peer writes are reserved, never indexed,
//        matched, evicted or committed while receiving;
//     2. take_plan() and PlanExecutor::execute(plan): the evictions that freed those blocks (and, with
//        ReceiveOptions::match_prefix, the loads of the servable prefix) go to the data plane first;
//     3. TransferManager::begin_external_write(all layers, receive blocks): waits until earlier accesses of the
//        blocks completed, then every load into them, eviction of them and reuse of them is refused;
//     4. the PD endpoint's start(peer, id, mode, receive blocks): only now is the peer told the blocks.
//     A failure at any step undoes the earlier ones (nothing was sent: the blocks return to the admission and the
//     admission is released) and returns the step's error; the cache's plan moves already executed are acked
//     through the executor's completions as usual.
//   reporter thread (internal; every poll_interval while receives are active)
//     5. As the endpoint reports layer L final: loaded -> complete_external_layer(task, L); failed ->
//        complete_external_layer(task, L, every block). A partial layer (some blocks failed their checksum) is
//        reported at once, naming the blocks of that layer that did not verify (DecodeStatus::layer_block_loaded;
//        an endpoint that does not say is reported when the transfer is final, naming every block not loaded):
//        its waiters see it failed, never loaded. So the decode forward calls
//        TransferManager::wait_for_layer(Receive::task, L, stream) / wait_layer_host exactly as for a local load,
//        and must check the task's status (or the layer's) before trusting the result, as for a load.
//     6. When the transfer is final: end_external_write(task, error, quiescent = DecodeStatus::reclaimable).
//        A receive not final by ReceiverOptions::receive_timeout is ended with TimedOut and treated as failed,
//        not reclaimable.
//   poll() / finish()  (scheduler thread)
//     7. CacheManager::complete_receive(admission, leading_loaded_blocks, reclaimable): the leading loaded blocks
//        join the prefix index (pinned by the admission; a later request matches them as device hits); the
//        others hold no valid data. With `reclaimable` they are plain blocks of the admission (recompute them);
//        without it they are quarantined.
//   quarantine (reporter thread, then poll())
//     8. Once the endpoint reports the transfer reclaimable (no byte of the peer can still land: its writes
//        confirmed over, its connection torn down), release_external_write(task), the endpoint's forget(id), and
//        at the next poll() CacheManager::ack_receive_reclaimable(admission). Time alone never ends a quarantine
//        (fail closed); a receive whose endpoint forgot the transfer stays quarantined.
//
// Failure rules, as the pieces define them: a block of a layer that failed (checksum, a failed or aborted write,
// the peer's failure notice, the lease) is never reported loaded by the TransferManager and never committed; a
// block the peer may still write is neither in a pool nor declared free until proven quiescent. Ordering: the
// TransferManager side is released before the CacheManager side, so a block back in the cache's pool is never
// still declared to the data plane.
//
// The admission. Receive::admission is the caller's: it runs its decode in admission.device_blocks and calls
// CacheManager::release(admission.id) at the request's end, after poll()/finish() reported the receive ended
// (the leading loaded blocks stay indexed). A release() while still receiving (a request aborted mid-transfer)
// fails closed: every receive block is quarantined until the receiver acks it reclaimable; the outcome then
// carries the complete_receive refusal and commits nothing.
//
// Thread-safety: start(), poll(), finish() and drain() call the CacheManager and the PlanExecutor, so they run on
// the one scheduler thread that drives them; stats() and active() from any thread. The TransferManager and the
// endpoint are called from the reporter thread too (both are thread-safe). Every wait has a deadline.
// Lifetime: the CacheManager, TransferManager, PlanExecutor and endpoint outlive the receiver. The destructor stops
// the reporter thread and does not touch the cache: poll() (or drain()) first, or a receive that ended and was
// not reported is never completed into it. Receives still open are ended on the data plane as Cancelled and not
// quiescent: their blocks stay declared for good (fail closed: cancel_open() and drain() first to get them back).
// Errors: InvalidArgument (no blocks to receive), AlreadyExists (transfer id active here), and the pieces'
// errors (admission refused: ResourceExhausted; blocks busy: TimedOut; ...), with context naming the transfer.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "kvtier/backend/plan_executor.h"
#include "kvtier/cache/block_key.h"
#include "kvtier/cache/cache_manager.h"
#include "kvtier/core/status.h"
#include "kvtier/transfer/transfer_manager.h"
#include "kvtier/transport/pd.h"
#include "kvtier/transport/pd_staged.h"

namespace kvtier::pd {

struct ReceiverOptions {
  // How often the reporter thread looks at the endpoint's layers while receives are active.
  std::chrono::microseconds poll_interval{100};
  // A receive whose transfer is not final by then fails (TimedOut), not reclaimable.
  std::chrono::milliseconds receive_timeout{30000};
  // begin_external_write's host wait for earlier accesses of the blocks (ExternalWriteOptions::free_timeout).
  std::chrono::milliseconds free_timeout{10000};
};

struct ReceiveRequest {
  transport::PeerId prefill = 0;
  transport::TransferId id = 0;
  transport::PdMode mode = transport::PdMode::kPush;
  std::vector<cache::BlockKey> keys;  // the prompt's chained keys
  cache::ReceiveOptions options;      // extra (tail) blocks, match_prefix
};

struct Receive {
  transport::TransferId id = 0;
  // device_blocks[receive_begin, receive_begin + receive_blocks) are the endpoint's destination blocks, in order.
  cache::Admission admission;
  // The external write: wait_for_layer / wait_layer_host / wait on it as on a load.
  TaskId task = 0;
};

// A receive ended (poll() / finish()).
struct ReceiveOutcome {
  transport::TransferId id = 0;
  cache::AdmissionId admission = 0;
  TaskId task = 0;
  std::uint32_t receive_blocks = 0;
  std::uint32_t loaded_blocks = 0;   // leading loaded blocks given to complete_receive (joined the index if keyed)
  bool reclaimable = false;          // when it ended: false -> the others are quarantined until reclaimable
  KeptStatus error;                  // the transfer's first failure (OK when every block loaded)
  transport::DecodeStatus transfer;  // the endpoint's final status (empty after a receive_timeout)
};

struct ReceiverStats {
  std::uint64_t started = 0, refused = 0;   // start() calls that succeeded / failed
  std::uint64_t completed = 0, failed = 0;  // ended with every block loaded / not
  std::uint64_t committed_blocks = 0;       // leading loaded blocks handed to complete_receive
  std::uint64_t layers_reported = 0, layers_failed = 0;
  std::uint64_t quarantined = 0, reclaimed = 0;  // receives that ended not reclaimable / whose quarantine ended
  std::uint64_t timed_out = 0;                   // receives ended by receive_timeout
};

class PdReceiver {
 public:
  static Result<std::unique_ptr<PdReceiver>> create(cache::CacheManager& cache, TransferManager& transfers,
                                                    cache::PlanExecutor& executor, transport::PdDecode& endpoint,
                                                    ReceiverOptions options = {});
  static Result<std::unique_ptr<PdReceiver>> create(cache::CacheManager& cache, TransferManager& transfers,
                                                    cache::PlanExecutor& executor, transport::PdStagedDecode& endpoint,
                                                    ReceiverOptions options = {});
  virtual ~PdReceiver() = default;

  // Steps 1-4 above.
  virtual Result<Receive> start(const ReceiveRequest& request) = 0;
  // Steps 7-8 for every receive that reached them: the receives ended by this call, in transfer id order.
  virtual Result<std::vector<ReceiveOutcome>> poll() = 0;
  // Until receive `id` ended (then as poll() for it; other receives ended meanwhile are returned by the next
  // poll()), or TimedOut. NotFound for an id not started here or already reported.
  virtual Result<ReceiveOutcome> finish(transport::TransferId id, std::chrono::nanoseconds timeout) = 0;
  // Until no receive is open or quarantined (polling), or TimedOut naming what is left.
  virtual Status drain(std::chrono::nanoseconds timeout) = 0;
  // Cancels every receive still receiving on the endpoint (PdDecode::cancel): each ends failed (kCancelled) and,
  // once the endpoint proves no byte can land any more, its blocks come back through poll() / drain() as any
  // failed receive's do. For an owner about to destroy the receiver: cancel_open(), then drain(), then destroy.
  // Thread-safe (it touches only the endpoint).
  virtual void cancel_open() = 0;

  // Receives started and not yet through step 8 (open, ended not reported, or quarantined).
  virtual std::size_t active() const = 0;
  virtual std::size_t quarantined() const = 0;
  virtual ReceiverStats stats() const = 0;
};

}  // namespace kvtier::pd
