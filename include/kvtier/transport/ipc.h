// Same-host IPC transport: two agents on one machine copy straight into each other's memory, without a network
// stack. See docs/transport.md ("The ipc backend") for the blob fields and the selection rule.
//
// Host memory (pinned host, and the host backend's simulated device memory): every registered region gets a
// shareable window, a memfd of the region's size mapped in the owner and sealed against resizing (a peer holding
// the descriptor must not be able to shrink it under a mapping: copies past the end raise SIGBUS); a peer's window
// is mapped only when it carries those seals and holds the bytes its blob claims (kFailedPrecondition otherwise). A
// peer that loads the blob connects to the owner's Unix domain socket (abstract namespace) and receives the windows'
// file descriptors there (SCM_RIGHTS), then maps them. A WRITE copies the initiator's bytes into the window and asks
// the owner, over the socket, to move them into the region; the owner does so, delivers the notification and
// acknowledges, and only then is the transfer done. A READ asks the owner to fill the window from the region, then
// copies out of it. The caller's memory need not be shareable itself; the cost is one extra memcpy on the owner's side.
//
// CUDA device memory (IpcOptions::device_memory = kCuda, builds with KVTIER_CUDA): the region's key carries its
// allocation's CUDA IPC handle, its offset in it and the device's PCI bus id; the peer opens the handle and the
// initiator copies with cudaMemcpyAsync (device to device, or peer copies between GPUs) on its own stream, one
// event per transfer polled for completion, then sends the request, so the notification still follows the
// bytes. Without CUDA in the build, register_memory refuses such regions (kNotSupported).
//
// Host identity: the blob carries /proc/sys/kernel/random/boot_id and the agent's pid namespace; load_peer
// refuses a peer whose values differ (kFailedPrecondition naming both) before anything is connected or mapped.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "kvtier/backend/transport.h"

namespace kvtier::transport {

// Which machine (and pid namespace) an agent runs on.
struct HostIdentity {
  std::string boot_id;  // /proc/sys/kernel/random/boot_id
  std::string pid_ns;   // readlink /proc/self/ns/pid, e.g. "pid:[4026531836]"
  bool operator==(const HostIdentity&) const = default;
};
// This process's identity; kUnavailable when /proc does not provide it.
Result<HostIdentity> local_host_identity();

// The host identity an ipc blob carries (checksum, format and, with a peer secret, the blob's MAC checked).
Result<HostIdentity> ipc_blob_host(std::span<const std::byte> blob, std::string_view peer_secret = {});

struct IpcOptions {
  enum class DeviceMemory : std::uint8_t {
    kHost,  // the host backend: kDevice regions are CPU-addressable RAM, shared like pinned host memory
    kCuda,  // CUDA device memory, shared through CUDA IPC handles (see above)
  };
  DeviceMemory device_memory = DeviceMemory::kHost;
  int cuda_device = 0;  // the ordinal this agent's copies run on (kCuda)
  // A CUDA copy not complete by then fails its transfer, which stays non-quiescent (fail closed).
  std::chrono::milliseconds copy_timeout{60000};
  // A message to a peer that does not read it within this time (> 0; the peer paused, stopped, swapping) ends the
  // connection to that peer (its transfers fail, kUnavailable) instead of blocking every other peer's messages.
  std::chrono::milliseconds send_timeout{5000};
  // Overrides the host identity the agent advertises and compares against (tests of the refusal).
  std::function<Result<HostIdentity>()> host_identity;
  // See "Trust" in transport.h: 32..64 raw bytes shared by the agents that may talk to each other; empty: none.
  std::string peer_secret;
};
Result<std::unique_ptr<Transport>> create_ipc_transport(AgentIdentity identity, IpcOptions options = {});

// ---- path selection -----------------------------------------------------------------------------------------

// One side of a prefill/decode pair as the selection sees it.
struct PathEndpoint {
  HostIdentity host;
  MemoryKind kind = MemoryKind::kPinnedHost;
  bool cuda = false;       // kDevice memory is CUDA memory (false: the host backend's RAM)
  int device_ordinal = 0;  // CUDA ordinal of kDevice memory
};

struct PathChoice {
  bool ipc = false;    // true: the ipc backend; false: the staged / UCX path
  std::string reason;  // why, naming the values that decided
};

// ipc when both sides are on one host (boot id and pid namespace equal) and, where both sides hold CUDA device
// memory, peer access works between the two ordinals (the same ordinal always does); the staged / UCX path
// otherwise. `can_access_peer(from, to)` is cudaDeviceCanAccessPeer; it is asked only for distinct CUDA ordinals.
// CUDA memory on one side and host memory on the other goes the staged way. `cuda_ipc` says whether the ipc
// backend has its CUDA data path (ipc_cuda_supported(): builds with KVTIER_CUDA), so the rule is testable
// everywhere.
bool ipc_cuda_supported() noexcept;
PathChoice choose_transfer_path(const PathEndpoint& local, const PathEndpoint& peer,
                                const std::function<bool(int, int)>& can_access_peer,
                                bool cuda_ipc = ipc_cuda_supported());

}  // namespace kvtier::transport
