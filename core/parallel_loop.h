// ParallelLoop: a few threads that share one loop with the calling thread.
//
// Host-side passes over many bytes (the prefill/decode host lanes' checksums of every block, the memory tier's
// copies of a batch's objects) cost more on one thread than the transfer around them; split over a few cores they
// leave the critical path. Private to kvtier's libraries (not installed).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvtier::detail {

class ParallelLoop {
 public:
  // `helpers` threads beside the caller (0: the caller does everything). Threads that cannot be started are
  // left out (the loop still runs, on fewer threads).
  explicit ParallelLoop(unsigned helpers);
  ~ParallelLoop();
  ParallelLoop(const ParallelLoop&) = delete;
  ParallelLoop& operator=(const ParallelLoop&) = delete;

  unsigned helpers() const noexcept { return static_cast<unsigned>(threads_.size()); }

  // Calls body(begin, end) over [0, n) in chunks of `grain` items (the last one shorter), on the caller and the
  // helpers, and returns once every chunk is done. `body` must not throw. Concurrent callers take turns.
  void run(std::size_t n, std::size_t grain, const std::function<void(std::size_t, std::size_t)>& body);

  // The helpers for a machine with `cores` cores: none on two cores or fewer (the lane and the peer need them),
  // then one per two cores beyond, at most 4.
  static unsigned default_helpers(unsigned cores);

 private:
  void work_chunks();
  void helper_loop();

  std::vector<std::thread> threads_;
  std::mutex run_mu_;  // one run at a time
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  std::uint64_t generation_ = 0;  // a new run
  unsigned busy_ = 0;             // helpers inside the current run
  bool stop_ = false;
  // The current run (valid while busy_ > 0 or the caller works).
  const std::function<void(std::size_t, std::size_t)>* body_ = nullptr;
  std::size_t n_ = 0, grain_ = 1;
  std::atomic<std::size_t> next_{0};
};

}  // namespace kvtier::detail
