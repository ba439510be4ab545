// What kAuto's split learns at run time, per size class (direction and
// half-octave of the average segment): the SplitTuner keeps the kernel's
// share, moved toward the balanced share of each timed split
// (auto_split_adaptive), and the CPU budget of the DMA part, with the pause
// after a late submission (auto_split_cpu_budget_adaptive). engine_base.h
// documents each member.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>

#include "copy/engine_base.h"

namespace kvtier::copy_detail {

double balanced_split_share(double share, double kernel_bytes, double kernel_ms, double dma_bytes, double dma_ms) {
  if (!(kernel_bytes > 0 && dma_bytes > 0) || std::isnan(kernel_ms) || std::isnan(dma_ms)) return share;
  // A part that finished within the timer's resolution of the fork (or even
  // "before" it, when the two clocks' stamps race) counts as 1 us.
  constexpr double kResolutionMs = 1e-3;
  kernel_ms = std::max(kernel_ms, kResolutionMs);
  dma_ms = std::max(dma_ms, kResolutionMs);
  const double kernel_rate = kernel_bytes / kernel_ms;
  const double dma_rate = dma_bytes / dma_ms;
  return kernel_rate / (kernel_rate + dma_rate);
}

std::uint32_t split_size_class(CopyDirection dir, std::uint64_t average_segment_bytes) {
  const double half_octaves =
      std::floor(2.0 * std::log2(static_cast<double>(std::max<std::uint64_t>(1, average_segment_bytes))));
  return static_cast<std::uint32_t>(dir) * 256u + static_cast<std::uint32_t>(half_octaves);
}

double SplitTuner::share(std::uint32_t size_class, double initial) const {
  std::lock_guard lock(mu_);
  auto it = classes_.find(size_class);
  return it != classes_.end() && it->second.share ? *it->second.share : initial;
}

void SplitTuner::observe(std::uint32_t size_class, double share, double kernel_bytes, double kernel_ms,
                         double dma_bytes, double dma_ms, double gain, double lo, double hi) {
  const double target = balanced_split_share(share, kernel_bytes, kernel_ms, dma_bytes, dma_ms);
  std::lock_guard lock(mu_);
  // Several streams may report samples taken at older shares: step from
  // the current value toward this sample's balance point.
  ClassState& c = classes_[size_class];
  const double current = c.share.value_or(share);
  c.share = std::clamp(current + gain * (target - current), lo, hi);
}

double SplitTuner::budget(std::uint32_t size_class, double initial) const {
  std::lock_guard lock(mu_);
  auto it = classes_.find(size_class);
  return it != classes_.end() && it->second.budget ? *it->second.budget : initial;
}

void SplitTuner::report_submission(std::uint32_t size_class, double budget, bool cpu_late, double lo, double hi) {
  constexpr double kStep = 1.25;
  std::lock_guard lock(mu_);
  ClassState& c = classes_[size_class];
  const double current = c.budget.value_or(budget);
  c.budget = std::clamp(cpu_late ? current * kStep : current / kStep, lo, hi);
  if (cpu_late) {
    c.backoff = c.backoff == 0 ? kSplitPauseCopies : std::min(2 * c.backoff, kSplitMaxPauseCopies);
    c.pause = c.backoff;
  } else {
    c.backoff = 0;
  }
}

bool SplitTuner::paused(std::uint32_t size_class) const {
  std::lock_guard lock(mu_);
  auto it = classes_.find(size_class);
  return it != classes_.end() && it->second.pause > 0;
}

void SplitTuner::note_copy_while_paused(std::uint32_t size_class) {
  std::lock_guard lock(mu_);
  auto it = classes_.find(size_class);
  if (it != classes_.end() && it->second.pause > 0) --it->second.pause;
}

}  // namespace kvtier::copy_detail
