// Small helpers shared by the host-backend TransferManager tests: a host
// device with injected delays, a small GQA layout, and a gate that holds a
// stream busy (a "long kernel") until released.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>

#include "kvtier/core/layout.h"
#include "kvtier/device/host_device.h"

namespace kvtier::transfer_test {

inline std::unique_ptr<HostDevice> make_host(std::uint64_t seed, int max_delay_us = 200) {
  HostDeviceOptions o;
  o.min_delay = std::chrono::microseconds(0);
  o.max_delay = std::chrono::microseconds(max_delay_us);
  o.seed = seed;
  auto d = HostDevice::create(o);
  EXPECT_TRUE(d.ok()) << d.status().to_string();
  return std::move(d).value();
}

inline KvLayout small_gqa(std::uint32_t layers = 4) {
  GqaShape s;
  s.num_layers = layers;
  s.kv_heads = 1;
  s.block_tokens = 4;
  s.head_dim = 16;  // 128 B per (layer, role, block)
  auto l = KvLayout::gqa(s);
  EXPECT_TRUE(l.ok());
  return *l;
}

// Holds a stream busy until released (a "long kernel").
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  bool entered = false;
  Status block(HostDevice& dev, Stream& s) {
    return dev.enqueue_task(s, [this]() -> Status {
      std::unique_lock<std::mutex> lock(mu);
      entered = true;
      cv.notify_all();
      cv.wait(lock, [this] { return open; });
      return Status::Ok();
    });
  }
  // Until the gate's task runs on its stream: only then is it no longer an operation yet to start (what
  // HostDevice::fail_nth_operation counts). False at the deadline.
  bool wait_entered(std::chrono::seconds deadline = std::chrono::seconds(10)) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, deadline, [this] { return entered; });
  }
  void release() {
    {
      std::lock_guard<std::mutex> lock(mu);
      open = true;
    }
    cv.notify_all();
  }
};

}  // namespace kvtier::transfer_test
