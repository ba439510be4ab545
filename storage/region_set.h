// Registered host regions of one backend (register_region/unregister_region bookkeeping).
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "kvtier/core/status.h"

namespace kvtier::storage {

class RegionSet {
 public:
  Status add(void* ptr, std::uint64_t bytes) {
    if (ptr == nullptr || bytes == 0) return InvalidArgument("register_region: null pointer or zero bytes");
    std::lock_guard<std::mutex> lk(mu_);
    const auto b = reinterpret_cast<std::uintptr_t>(ptr);
    for (auto& [p, n] : regions_) {
      const auto rb = reinterpret_cast<std::uintptr_t>(p);
      if (b < rb + n && rb < b + bytes)
        return InvalidArgument(
            fmt::format("register_region: [{}, +{}) overlaps registered [{}, +{})", ptr, bytes, p, n));
    }
    regions_.emplace_back(ptr, bytes);
    return Status::Ok();
  }
  Status remove(void* ptr) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = std::find_if(regions_.begin(), regions_.end(), [&](auto& r) { return r.first == ptr; });
    if (it == regions_.end()) return NotFound(fmt::format("unregister_region: {} is not registered", ptr));
    regions_.erase(it);
    return Status::Ok();
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<void*, std::uint64_t>> regions_;
};

}  // namespace kvtier::storage
