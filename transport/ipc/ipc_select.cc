// Host identity of an agent and the choice between the ipc backend and the staged / UCX path.
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "kvtier/transport/ipc.h"

namespace kvtier::transport {

Result<HostIdentity> local_host_identity() {
  HostIdentity h;
  const int fd = ::open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    // Out of descriptors is no missing procfs: said so, as every other call that needs one does.
    if (err == EMFILE || err == ENFILE)
      return ResourceExhausted(fmt::format(
          "cannot open /proc/sys/kernel/random/boot_id: {} (the open-file limit, ulimit -n / RLIMIT_NOFILE, is "
          "reached)",
          std::strerror(err)));
    return Unavailable(fmt::format("cannot read /proc/sys/kernel/random/boot_id: {} (no procfs?)", std::strerror(err)));
  }
  char id[128];
  const ssize_t got = ::read(fd, id, sizeof(id) - 1);
  ::close(fd);
  if (got > 0) {
    h.boot_id.assign(id, static_cast<std::size_t>(got));
    while (!h.boot_id.empty() && (h.boot_id.back() == '\n' || h.boot_id.back() == ' ')) h.boot_id.pop_back();
  }
  if (h.boot_id.empty()) return Unavailable("cannot read /proc/sys/kernel/random/boot_id (no procfs?)");
  char buf[256];
  const ssize_t n = readlink("/proc/self/ns/pid", buf, sizeof(buf) - 1);
  if (n <= 0) return Unavailable(fmt::format("cannot read /proc/self/ns/pid: {}", std::strerror(errno)));
  h.pid_ns.assign(buf, static_cast<std::size_t>(n));
  return h;
}

PathChoice choose_transfer_path(const PathEndpoint& local, const PathEndpoint& peer,
                                const std::function<bool(int, int)>& can_access_peer, bool cuda_ipc) {
  if (local.host.boot_id != peer.host.boot_id)
    return {false, fmt::format("staged: peer boot id {} != local boot id {} (another host)", peer.host.boot_id,
                               local.host.boot_id)};
  if (local.host.pid_ns != peer.host.pid_ns)
    return {false, fmt::format("staged: peer pid namespace {} != local pid namespace {} (another container)",
                               peer.host.pid_ns, local.host.pid_ns)};
  const bool local_cuda = local.kind == MemoryKind::kDevice && local.cuda;
  const bool peer_cuda = peer.kind == MemoryKind::kDevice && peer.cuda;
  if (!local_cuda && !peer_cuda) return {true, "ipc: same host, host memory on both sides"};
  if (local_cuda != peer_cuda)
    return {false, fmt::format("staged: CUDA memory on the {} side only; ipc copies CUDA to CUDA or host to host",
                               local_cuda ? "local" : "peer")};
  if (!cuda_ipc) return {false, "staged: this build's ipc backend has no CUDA data path"};
  if (local.device_ordinal == peer.device_ordinal)
    return {true, fmt::format("ipc: same host, same GPU {}", local.device_ordinal)};
  if (!can_access_peer || !can_access_peer(local.device_ordinal, peer.device_ordinal))
    return {false,
            fmt::format("staged: no peer access from GPU {} to GPU {}", local.device_ordinal, peer.device_ordinal)};
  return {true, fmt::format("ipc: same host, peer access GPU {} -> GPU {}", local.device_ordinal, peer.device_ordinal)};
}

}  // namespace kvtier::transport
