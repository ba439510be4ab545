#include "core/parallel_loop.h"

#include <algorithm>

namespace kvtier::detail {

ParallelLoop::ParallelLoop(unsigned helpers) {
  for (unsigned i = 0; i < helpers; ++i) {
    try {
      threads_.emplace_back([this] { helper_loop(); });
    } catch (const std::system_error&) {
      break;
    }
  }
}

ParallelLoop::~ParallelLoop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

unsigned ParallelLoop::default_helpers(unsigned cores) { return cores <= 2 ? 0 : std::min(4u, (cores - 1) / 2); }

void ParallelLoop::work_chunks() {
  for (;;) {
    const std::size_t begin = next_.fetch_add(grain_);
    if (begin >= n_) return;
    (*body_)(begin, std::min(n_, begin + grain_));
  }
}

void ParallelLoop::helper_loop() {
  std::uint64_t seen = 0;
  std::unique_lock lock(mu_);
  for (;;) {
    start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    ++busy_;
    lock.unlock();
    work_chunks();
    lock.lock();
    if (--busy_ == 0) done_cv_.notify_all();
  }
}

void ParallelLoop::run(std::size_t n, std::size_t grain, const std::function<void(std::size_t, std::size_t)>& body) {
  if (n == 0) return;
  grain = std::max<std::size_t>(grain, 1);
  if (threads_.empty() || n <= grain) {
    body(0, n);
    return;
  }
  std::lock_guard turn(run_mu_);
  {
    // A helper that woke late for the last run may still be looking for chunks: the fields change only once no
    // helper is inside a run.
    std::unique_lock lock(mu_);
    done_cv_.wait(lock, [&] { return busy_ == 0; });
    body_ = &body;
    n_ = n;
    grain_ = grain;
    next_.store(0);
    ++generation_;
  }
  start_cv_.notify_all();
  work_chunks();
  // Helpers that woke for this run finish their chunks; one that had not woken yet finds no chunk left. Wait for
  // those inside, so that body_ outlives every use of it.
  std::unique_lock lock(mu_);
  done_cv_.wait(lock, [&] { return busy_ == 0; });
}

}  // namespace kvtier::detail
