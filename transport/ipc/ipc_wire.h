// The ipc backend's wire (transport/ipc/ipc_transport.cc): SOCK_SEQPACKET messages on an abstract Unix domain
// socket, a u32 message type first, a file descriptor riding along where a window is handed over. Shared with the
// tests that speak it as a crafted peer.
#pragma once

#include <cstdint>
#include <string>

namespace kvtier::transport::ipc_wire {

enum MsgType : std::uint32_t {
  kHello = 1,       // initiator -> owner: {name, address (its blob's: which incarnation of the name)}
  kRegion = 2,      // owner -> initiator: {index, bytes, live} + the window's fd when live
  kRegionsEnd = 3,  // owner -> initiator
  kWrite = 4,       // initiator -> owner: {xfer, ranges, notification}
  kRead = 5,        // initiator -> owner: {xfer, ranges}
  kNotify = 6,      // initiator -> owner: {kind, message}
  kReply = 7,       // owner -> initiator: {xfer, code, message}
  // Under a peer secret, between kHello and the regions: the owner's challenge and the initiator's proof
  // (transport_base.h, handshake_proof). Without a secret the owner serves only processes of its own user.
  kChallenge = 8,  // owner -> initiator: {challenge}
  kProof = 9,      // initiator -> owner: {proof}
};

// Sends one message, optionally with a file descriptor (-1: none). False when the connection is gone.
bool send_msg(int fd, const std::string& m, int pass_fd = -1);
// Sends one message without waiting: kWouldBlock when the socket's buffer cannot take it now (the peer is not
// reading), kFailed when the connection is gone.
enum class TrySend : std::uint8_t { kSent, kWouldBlock, kFailed };
TrySend try_send_msg(int fd, const std::string& m);
// Receives one message, and the descriptor that came with it into *got_fd (-1: none; closed when got_fd is null).
// False at the connection's end or on error.
bool recv_msg(int fd, std::string& m, int* got_fd = nullptr);

}  // namespace kvtier::transport::ipc_wire
