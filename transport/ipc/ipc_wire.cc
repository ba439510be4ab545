// The ipc backend's wire helpers (ipc_wire.h).
#include "transport/ipc/ipc_wire.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace kvtier::transport::ipc_wire {

bool send_msg(int fd, const std::string& m, int pass_fd) {
  iovec iov{const_cast<char*>(m.data()), m.size()};
  msghdr h{};
  h.msg_iov = &iov;
  h.msg_iovlen = 1;
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))] = {};
  if (pass_fd >= 0) {
    h.msg_control = ctl;
    h.msg_controllen = sizeof(ctl);
    cmsghdr* c = CMSG_FIRSTHDR(&h);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
  }
  for (;;) {
    const ssize_t n = sendmsg(fd, &h, MSG_NOSIGNAL);
    if (n == static_cast<ssize_t>(m.size())) return true;
    if (n < 0 && errno == EINTR) continue;
    return false;
  }
}

TrySend try_send_msg(int fd, const std::string& m) {
  for (;;) {
    const ssize_t n = send(fd, m.data(), m.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n == static_cast<ssize_t>(m.size())) return TrySend::kSent;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return TrySend::kWouldBlock;
    return TrySend::kFailed;
  }
}

bool recv_msg(int fd, std::string& m, int* got_fd) {
  if (got_fd) *got_fd = -1;
  for (;;) {
    char probe;
    const ssize_t len = recv(fd, &probe, 1, MSG_PEEK | MSG_TRUNC);
    if (len < 0 && errno == EINTR) continue;
    if (len <= 0) return false;
    m.resize(static_cast<std::size_t>(len));
    iovec iov{m.data(), m.size()};
    msghdr h{};
    h.msg_iov = &iov;
    h.msg_iovlen = 1;
    alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))] = {};
    h.msg_control = ctl;
    h.msg_controllen = sizeof(ctl);
    const ssize_t n = recvmsg(fd, &h, MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR) continue;
    if (n != len) return false;
    for (cmsghdr* c = CMSG_FIRSTHDR(&h); c != nullptr; c = CMSG_NXTHDR(&h, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        int passed = -1;
        std::memcpy(&passed, CMSG_DATA(c), sizeof(int));
        if (got_fd)
          *got_fd = passed;
        else
          close(passed);
      }
    }
    return true;
  }
}

}  // namespace kvtier::transport::ipc_wire
