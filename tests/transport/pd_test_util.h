// Shared by the prefill/decode tests: a small layout, block spaces in host memory, the bytes every prefill
// block holds (a pure function of layer, role, block and byte index, so two processes agree).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "kvtier/backend/transport.h"
#include "kvtier/core/layout.h"
#include "transport/forwarding_transport.h"

namespace kvtier::transport::testing {

// Forwards every call to `inner`; tests override what they need to disturb.
using ForwardingTransport = detail::ForwardingTransport;

// An agent that falls silent without ending (a paused or hung process): once muted, its notifications are dropped
// both ways (nothing it sends leaves, nothing sent to it arrives), while its transport, its registered memory and
// the peers' mappings of it live on. What an endpoint does while muted (including closing) reaches nobody.
class Mutable final : public ForwardingTransport {
 public:
  using ForwardingTransport::ForwardingTransport;
  void mute() { muted_.store(true); }
  // A paused process (SIGSTOP): nothing it sends leaves, what is sent to it waits; resume() delivers what waited.
  void pause() { paused_.store(true); }
  void resume() { paused_.store(false); }
  // Mutes the agent right after it sends a message that `pred` picks (the message still leaves).
  void mute_after(std::function<bool(const std::string&)> pred) {
    std::lock_guard lock(mu_);
    mute_after_ = std::move(pred);
  }
  Status send_notification(PeerId peer, std::string message) override {
    if (muted_.load() || paused_.load()) return Status::Ok();
    bool then_mute = false;
    {
      std::lock_guard lock(mu_);
      then_mute = mute_after_ && mute_after_(message);
    }
    Status s = inner().send_notification(peer, std::move(message));
    if (then_mute) mute();
    return s;
  }
  Status send_urgent_notification(PeerId peer, std::string message) override {
    return muted_.load() || paused_.load() ? Status::Ok() : inner().send_urgent_notification(peer, std::move(message));
  }
  std::vector<Notification> take_notifications() override { return filter(inner().take_notifications()); }
  Result<std::vector<Notification>> wait_notifications(std::chrono::nanoseconds timeout) override {
    auto got = inner().wait_notifications(timeout);
    if (got.ok()) *got = filter(std::move(*got));
    return got;
  }

 private:
  std::vector<Notification> filter(std::vector<Notification> got) {
    if (muted_.load()) return {};
    std::lock_guard lock(mu_);
    if (paused_.load()) {
      for (Notification& n : got) waiting_.push_back(std::move(n));
      return {};
    }
    if (waiting_.empty()) return got;
    for (Notification& n : got) waiting_.push_back(std::move(n));
    return std::exchange(waiting_, {});
  }

  std::atomic<bool> muted_{false}, paused_{false};
  std::vector<Notification> waiting_;  // arrived while paused (under mu_)
  std::mutex mu_;
  std::function<bool(const std::string&)> mute_after_;
};

inline KvLayout pd_layout(std::uint32_t layers = 4, std::uint64_t block_bytes = 8192) {
  return KvLayout::uniform(layers, 2, block_bytes).value();
}

// The reference bytes of (layer l, role r, block b): byte i is byte i % 8 of a hash of (l, r, b, i / 8), so a
// block is filled and checked a 64-bit word at a time (byte by byte, filling and checking the 256 MiB of the lease
// test took about 50 s of pd_test's 120 s under AddressSanitizer).
inline std::uint64_t pattern_word(std::uint32_t l, std::uint32_t r, std::uint64_t b, std::uint64_t word) {
  std::uint64_t x = (static_cast<std::uint64_t>(l) << 48) ^ (static_cast<std::uint64_t>(r) << 40) ^ (b << 24) ^ word;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 29;
  return x;
}

inline std::byte pattern(std::uint32_t l, std::uint32_t r, std::uint64_t b, std::uint64_t i) {
  return static_cast<std::byte>(pattern_word(l, r, b, i / 8) >> (8 * (i % 8)));
}

// Writes the reference bytes of (l, r, b) to p[0, bytes).
inline void fill_pattern(std::byte* p, std::uint32_t l, std::uint32_t r, std::uint64_t b, std::uint64_t bytes) {
  std::uint64_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    const std::uint64_t w = pattern_word(l, r, b, i / 8);
    std::memcpy(p + i, &w, 8);
  }
  for (; i < bytes; ++i) p[i] = pattern(l, r, b, i);
}

// True when p[0, bytes) holds the reference bytes of (l, r, b).
inline bool matches_pattern(const std::byte* p, std::uint32_t l, std::uint32_t r, std::uint64_t b,
                            std::uint64_t bytes) {
  std::uint64_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    std::uint64_t w = 0;
    std::memcpy(&w, p + i, 8);
    if (w != pattern_word(l, r, b, i / 8)) return false;
  }
  for (; i < bytes; ++i)
    if (p[i] != pattern(l, r, b, i)) return false;
  return true;
}

// Host-backend device memory is RAM: the same blocks viewed as device memory (the device and ring lanes).
inline BlockSpace as_device(const BlockSpace& s) {
  const KvLayout& layout = s.layout();
  std::vector<std::vector<Plane>> planes(layout.num_layers());
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) planes[l].push_back(s.plane(l, r));
  return BlockSpace::from_planes(MemoryKind::kDevice, 0, layout, s.num_blocks(), std::move(planes)).value();
}

// Layer-first host block space; the memory lives in `storage`.
struct HostBlocks {
  std::vector<std::vector<std::unique_ptr<std::byte[]>>> storage;
  BlockSpace space;

  static HostBlocks make(const KvLayout& layout, std::uint64_t num_blocks, bool fill,
                         std::byte poison = std::byte{0xee}) {
    HostBlocks h;
    std::vector<std::vector<void*>> bases(layout.num_layers());
    h.storage.resize(layout.num_layers());
    for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
      for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
        const std::uint64_t bytes = layout.block_bytes(l, r) * num_blocks;
        h.storage[l].emplace_back(new std::byte[bytes]);
        std::byte* p = h.storage[l].back().get();
        if (fill)
          for (std::uint64_t b = 0; b < num_blocks; ++b)
            fill_pattern(p + b * layout.block_bytes(l, r), l, r, b, layout.block_bytes(l, r));
        else
          std::memset(p, static_cast<int>(poison), bytes);
        bases[l].push_back(p);
      }
    h.space = BlockSpace::layer_first(MemoryKind::kPinnedHost, 0, layout, num_blocks, bases).value();
    return h;
  }
};

// True when decode block `dst` holds, in layer l, what prefill block `src` holds.
inline bool layer_matches(const BlockSpace& decode, std::uint64_t dst, std::uint32_t l, std::uint64_t src) {
  const KvLayout& layout = decode.layout();
  for (std::uint32_t r = 0; r < layout.num_roles(l); ++r)
    if (!matches_pattern(decode.block_ptr(l, r, dst), l, r, src, layout.block_bytes(l, r))) return false;
  return true;
}

}  // namespace kvtier::transport::testing
