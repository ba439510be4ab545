// The ipc backend on CUDA memory: two processes on GPU 0 (CUDA IPC works across processes of one device). The
// test re-executes itself as the peer (KVTIER_IPC_GPU_HELPER), which owns a poisoned device buffer; the test
// WRITEs a pattern into it (the peer checks every byte after the notification), READs it back into a poisoned
// buffer of its own, and prints GB/s of ipc WRITEs against a plain cudaMemcpyAsync device to device of the same
// bytes in the same run. Skips where no GPU is visible.
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "kvtier/transport/ipc.h"

extern char** environ;

namespace kvtier::transport {
namespace {

using namespace std::chrono_literals;

constexpr std::uint64_t kBytes = 256ull << 20;
constexpr std::uint64_t kChunk = 1ull << 20;  // one descriptor pair per MiB
constexpr int kIters = 10;

std::byte pattern(std::uint64_t i) { return static_cast<std::byte>((i * 131 + (i >> 20) * 7 + 3) & 0xff); }

bool write_all(int fd, const void* p, std::size_t n) {
  const auto* b = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::write(fd, b, n);
    if (w <= 0) return false;
    b += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}
bool read_all(int fd, void* p, std::size_t n) {
  auto* b = static_cast<char*>(p);
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (n > 0 && std::chrono::steady_clock::now() < deadline) {
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, 100) <= 0) continue;
    const ssize_t r = ::read(fd, b, n);
    if (r <= 0) return false;
    b += r;
    n -= static_cast<std::size_t>(r);
  }
  return n == 0;
}
bool send_blob(int fd, const std::vector<std::byte>& b) {
  const auto n = static_cast<std::uint32_t>(b.size());
  return write_all(fd, &n, 4) && write_all(fd, b.data(), b.size());
}
Result<std::vector<std::byte>> recv_blob(int fd) {
  std::uint32_t n = 0;
  if (!read_all(fd, &n, 4) || n > (1u << 24)) return Unavailable("no blob");
  std::vector<std::byte> b(n);
  if (!read_all(fd, b.data(), n)) return Unavailable("truncated blob");
  return b;
}

// Waits for a notification whose message starts with `prefix`.
Result<std::string> await(Transport& t, std::string_view prefix, std::chrono::seconds timeout = 30s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    auto got = t.wait_notifications(deadline - std::chrono::steady_clock::now());
    if (!got.ok()) return got.status();
    for (auto& n : *got)
      if (n.message.rfind(prefix, 0) == 0) return n.message;
  }
  return TimedOut(fmt::format("no notification {}", prefix));
}

IpcOptions cuda_options() {
  IpcOptions o;
  o.device_memory = IpcOptions::DeviceMemory::kCuda;
  o.cuda_device = 0;
  return o;
}

// The peer process: exit 0 when the pattern arrived byte-exact; 2 mismatch, 5 setup.
int run_helper(int in_fd, int out_fd) {
  alarm(60);
  if (cudaSetDevice(0) != cudaSuccess) return 5;
  void* dst = nullptr;
  if (cudaMalloc(&dst, kBytes) != cudaSuccess || cudaMemset(dst, 0xee, kBytes) != cudaSuccess ||
      cudaDeviceSynchronize() != cudaSuccess)
    return 5;
  auto t = create_ipc_transport({"gpu-peer", 0x77, 1, 0}, cuda_options());
  if (!t.ok()) return 5;
  if (!(*t)->register_memory({MemoryKind::kDevice, 0, dst, kBytes}).ok()) return 5;
  if (!send_blob(out_fd, (*t)->export_metadata().value())) return 5;
  auto blob = recv_blob(in_fd);
  if (!blob.ok()) return 5;
  auto peer = (*t)->load_peer(*blob);
  if (!peer.ok()) {
    std::fprintf(stderr, "gpu peer: %s\n", peer.status().to_string().c_str());
    return 5;
  }
  if (!await(**t, "written").ok()) return 5;
  std::vector<std::byte> host(kBytes);
  if (cudaMemcpy(host.data(), dst, kBytes, cudaMemcpyDeviceToHost) != cudaSuccess) return 5;
  std::uint64_t bad = 0;
  for (std::uint64_t i = 0; i < kBytes; ++i) bad += host[i] != pattern(i);
  if (!(*t)->send_notification(*peer, fmt::format("checked {}", bad)).ok()) return 5;
  if (!await(**t, "bye").ok()) return 5;
  (*t).reset();
  cudaFree(dst);
  return bad == 0 ? 0 : 2;
}

TEST(IpcGpuHelper, PeerProcess) {
  const char* spec = std::getenv("KVTIER_IPC_GPU_HELPER");
  if (spec == nullptr) GTEST_SKIP() << "runs only as the spawned peer process";
  int in_fd = -1, out_fd = -1;
  if (std::sscanf(spec, "%d %d", &in_fd, &out_fd) != 2) _exit(5);
  _exit(run_helper(in_fd, out_fd));
}

struct Child {
  pid_t pid = -1;
  int to = -1, from = -1;
  ~Child() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
  int reap(std::chrono::seconds timeout = 30s) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    int status = 0;
    while (std::chrono::steady_clock::now() < deadline) {
      if (waitpid(pid, &status, WNOHANG) == pid) {
        pid = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
      }
      std::this_thread::sleep_for(5ms);
    }
    return -1000;
  }
};

TEST(IpcGpu, TwoProcessesOnOneGpuWriteAndReadByteExactAndReportGbps) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) GTEST_SKIP() << "no CUDA device";
  int down[2], up[2];
  ASSERT_EQ(pipe(down), 0);
  ASSERT_EQ(pipe(up), 0);
  Child c;
  const std::string spec = fmt::format("{} {}", down[0], up[1]);
  c.pid = fork();
  ASSERT_GE(c.pid, 0);
  if (c.pid == 0) {
    setenv("KVTIER_IPC_GPU_HELPER", spec.c_str(), 1);
    char self[] = "/proc/self/exe";
    char filter[] = "--gtest_filter=IpcGpuHelper.PeerProcess";
    char* argv[] = {self, filter, nullptr};
    execve(self, argv, environ);
    _exit(127);
  }
  close(down[0]);
  close(up[1]);
  c.to = down[1];
  c.from = up[0];

  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  void *src = nullptr, *back = nullptr, *plain = nullptr;
  ASSERT_EQ(cudaMalloc(&src, kBytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&back, kBytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&plain, kBytes), cudaSuccess);
  std::vector<std::byte> host(kBytes);
  for (std::uint64_t i = 0; i < kBytes; ++i) host[i] = pattern(i);
  ASSERT_EQ(cudaMemcpy(src, host.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(back, 0xee, kBytes), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  auto t = create_ipc_transport({"gpu-test", 0x77, 1, 0}, cuda_options());
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  auto rs = (*t)->register_memory({MemoryKind::kDevice, 0, src, kBytes});
  auto rb = (*t)->register_memory({MemoryKind::kDevice, 0, back, kBytes});
  ASSERT_TRUE(rs.ok() && rb.ok()) << rs.status().to_string() << rb.status().to_string();
  ASSERT_TRUE(send_blob(c.to, (*t)->export_metadata().value()));
  auto blob = recv_blob(c.from);
  ASSERT_TRUE(blob.ok()) << blob.status().to_string() << " (peer exit " << c.reap(1s) << ")";
  auto peer = (*t)->load_peer(*blob);
  ASSERT_TRUE(peer.ok()) << peer.status().to_string();

  std::vector<LocalDesc> ls, lb;
  std::vector<RemoteDesc> r;
  for (std::uint64_t off = 0; off < kBytes; off += kChunk) {
    ls.push_back({*rs, off, kChunk});
    lb.push_back({*rb, off, kChunk});
    r.push_back({0, off, kChunk});
  }
  auto run = [&](XferOp op, const std::vector<LocalDesc>& l, std::string note) -> double {
    const auto t0 = std::chrono::steady_clock::now();
    auto x = (*t)->post(op, *peer, l, r, std::move(note));
    EXPECT_TRUE(x.ok()) << x.status().to_string();
    if (!x.ok()) return 0;
    auto st = (*t)->wait(*x, 30s);
    EXPECT_TRUE(st.ok() && st->state == XferState::kDone) << (st.ok() ? st->error.to_string() : "");
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (int i = 0; i < 1000 && !(*t)->poll(*x).value().quiescent; ++i) std::this_thread::sleep_for(1ms);
    EXPECT_TRUE((*t)->release(*x).ok());
    return s;
  };

  // Byte-exact both ways: the peer checks the WRITE; the READ lands in `back`, compared here.
  run(XferOp::kWrite, ls, "written");
  auto checked = await(**t, "checked");
  ASSERT_TRUE(checked.ok()) << checked.status().to_string();
  EXPECT_EQ(*checked, "checked 0");
  run(XferOp::kRead, lb, "read");
  std::vector<std::byte> got(kBytes);
  ASSERT_EQ(cudaMemcpy(got.data(), back, kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
  std::uint64_t bad = 0;
  for (std::uint64_t i = 0; i < kBytes; ++i) bad += got[i] != host[i];
  EXPECT_EQ(bad, 0u);

  // GB/s: ipc WRITEs of the whole buffer (post to completion) against cudaMemcpyAsync of the same bytes.
  double ipc_s = 0;
  for (int i = 0; i < kIters; ++i) ipc_s += run(XferOp::kWrite, ls, fmt::format("bench {}", i));
  cudaStream_t st = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
  double plain_s = 0;
  for (int i = 0; i < kIters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    for (std::uint64_t off = 0; off < kBytes; off += kChunk)
      ASSERT_EQ(cudaMemcpyAsync(static_cast<char*>(plain) + off, static_cast<char*>(src) + off, kChunk,
                                cudaMemcpyDeviceToDevice, st),
                cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
    plain_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const double gb = static_cast<double>(kBytes) * kIters / 1e9;
  std::printf(
      "ipc_gpu: %llu MiB x %d, %llu KiB per descriptor: ipc write %.1f GB/s, plain cudaMemcpyAsync D2D %.1f GB/s\n",
      static_cast<unsigned long long>(kBytes >> 20), kIters, static_cast<unsigned long long>(kChunk >> 10), gb / ipc_s,
      gb / plain_s);
  ASSERT_TRUE((*t)->send_notification(*peer, "bye").ok());
  EXPECT_EQ(c.reap(), 0);
  cudaStreamDestroy(st);
  (*t).reset();
  cudaFree(src);
  cudaFree(back);
  cudaFree(plain);
}

}  // namespace
}  // namespace kvtier::transport
