// `kvtier bench pd`: prefill/decode KV transfer between two processes on this machine (UCX over TCP on
// 127.0.0.1, or shared memory), push and pull, next to ucx_perftest over the same lane in the same run.
//
// Per (lane, mode, block size) the command re-executes itself as the prefill process (hidden --role prefill),
// exchanges blobs over pipes, and runs `iters` transfers of `layers` layers x `blocks` blocks through the full
// protocol (PdPrefill / PdDecode: per-layer messages, checksums computed and verified, leases). GB/s counts
// payload bytes from the decode side's start() until every layer is verified. ucx_perftest then runs as a
// server/client pair (ucp_put_bw for push, ucp_get for pull) with messages of one block, under the same
// UCX_TLS / UCX_NET_DEVICES; ratio = gbps / ucx_perftest_gbps.
//
// Host memory only: Debian's UCX has no CUDA lanes, and the staged GPU path (CopyEngine into pinned host
// blocks, layer by layer) is not part of this command yet.
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kvtier/transport/pd.h"
#include "tools/cli.h"

extern char** environ;

namespace kvtier::cli {
namespace {

using namespace std::chrono_literals;
using transport::PdMode;

struct PdArgs {
  std::vector<std::string> lanes = {"tcp", "shm"};
  std::vector<std::string> modes = {"push", "pull"};
  std::vector<std::uint64_t> block_sizes = {16384, 65536, 262144, 1048576};
  std::uint32_t layers = 4;
  std::uint64_t layer_bytes = 8ull << 20;  // payload of one layer of one transfer
  std::uint32_t iters = 8;
  bool json = false;
  bool no_perftest = false;
  // hidden: the prefill process
  std::string role;
  std::string lane = "tcp";
  std::string mode = "push";
  std::uint64_t block_bytes = 0;
  int in_fd = -1, out_fd = -1;
};

transport::UcxOptions lane_options(const std::string& lane) {
  if (lane == "tcp") return {"tcp", "lo"};
  return {"shm", ""};
}

std::uint64_t blocks_for(const PdArgs& a, std::uint64_t block_bytes) {
  return std::max<std::uint64_t>(4, a.layer_bytes / block_bytes);
}

bool write_all(int fd, const void* p, std::size_t n) {
  const auto* b = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::write(fd, b, n);
    if (w <= 0) return false;
    b += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* p, std::size_t n) {
  auto* b = static_cast<char*>(p);
  while (n > 0) {
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, 20000) <= 0) return false;
    ssize_t r = ::read(fd, b, n);
    if (r <= 0) return false;
    b += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

bool send_blob(int fd, const std::vector<std::byte>& blob) {
  const auto n = static_cast<std::uint32_t>(blob.size());
  return write_all(fd, &n, 4) && write_all(fd, blob.data(), blob.size());
}

Result<std::vector<std::byte>> recv_blob(int fd) {
  std::uint32_t n = 0;
  if (!read_all(fd, &n, 4) || n > (1u << 24)) return Unavailable("no blob from the other process");
  std::vector<std::byte> b(n);
  if (!read_all(fd, b.data(), n)) return Unavailable("truncated blob");
  return b;
}

struct Blocks {
  std::vector<std::unique_ptr<std::byte[]>> mem;
  BlockSpace space;
};

Result<Blocks> make_blocks(const KvLayout& layout, std::uint64_t n, std::byte fill) {
  Blocks b;
  std::vector<std::vector<void*>> bases(layout.num_layers());
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l) {
    const std::uint64_t bytes = layout.block_bytes(l, 0) * n;
    b.mem.emplace_back(new std::byte[bytes]);
    std::memset(b.mem.back().get(), static_cast<int>(fill) + static_cast<int>(l), bytes);
    bases[l].push_back(b.mem.back().get());
  }
  KVTIER_ASSIGN_OR_RETURN(b.space, BlockSpace::layer_first(MemoryKind::kPinnedHost, 0, layout, n, bases));
  return b;
}

std::vector<std::uint64_t> iota(std::uint64_t n) {
  std::vector<std::uint64_t> v(n);
  for (std::uint64_t i = 0; i < n; ++i) v[i] = i;
  return v;
}

const transport::PdOptions kPdOptions{std::chrono::milliseconds(200), std::chrono::milliseconds(5000)};

int run_prefill(const PdArgs& a) {
  alarm(300);
  auto layout = KvLayout::uniform(a.layers, 1, a.block_bytes);
  if (!layout.ok()) return 5;
  const std::uint64_t n = blocks_for(a, a.block_bytes);
  auto blocks = make_blocks(*layout, n, std::byte{1});
  if (!blocks.ok()) return 5;
  auto t = transport::create_ucx_transport({"bench-prefill", layout->fingerprint(), 1, 0}, lane_options(a.lane));
  if (!t.ok()) return 5;
  auto pre = transport::PdPrefill::create(**t, blocks->space, kPdOptions);
  if (!pre.ok()) return 5;
  auto blob = (*t)->export_metadata();
  if (!blob.ok() || !send_blob(a.out_fd, *blob)) return 5;
  auto peer_blob = recv_blob(a.in_fd);
  if (!peer_blob.ok()) return 5;
  auto peer = (*t)->load_peer(*peer_blob);
  if (!peer.ok()) return 3;
  for (std::uint32_t it = 0; it <= a.iters; ++it) {  // iteration 0 warms up
    if (!(*pre)->begin(*peer, it + 1, iota(n)).ok()) return 5;
    for (std::uint32_t l = 0; l < a.layers; ++l)
      if (!(*pre)->layer_ready(it + 1, l).ok()) return 5;
    auto st = (*pre)->wait(it + 1, 60s);
    if (!st.ok() || !st->done) return 4;
    if (!(*pre)->forget(it + 1).ok()) return 5;
  }
  std::this_thread::sleep_for(100ms);
  return 0;
}

// One kvtier row: GB/s of the protocol, or an error.
Result<double> run_decode(const PdArgs& a, const std::string& lane, PdMode mode, std::uint64_t block_bytes) {
  KVTIER_ASSIGN_OR_RETURN(KvLayout layout, KvLayout::uniform(a.layers, 1, block_bytes));
  const std::uint64_t n = blocks_for(a, block_bytes);
  KVTIER_ASSIGN_OR_RETURN(Blocks blocks, make_blocks(layout, n, std::byte{0x40}));
  KVTIER_ASSIGN_OR_RETURN(
      auto t, transport::create_ucx_transport({"bench-decode", layout.fingerprint(), 1, 0}, lane_options(lane)));
  KVTIER_ASSIGN_OR_RETURN(auto dec, transport::PdDecode::create(*t, blocks.space, kPdOptions));
  int down[2], up[2];
  if (pipe(down) != 0 || pipe(up) != 0) return Internal("pipe");
  const std::string bb = std::to_string(block_bytes), layers = std::to_string(a.layers),
                    lb = std::to_string(a.layer_bytes), iters = std::to_string(a.iters),
                    in_fd = std::to_string(down[0]), out_fd = std::to_string(up[1]);
  const std::string mode_s(transport::pd_mode_name(mode));
  pid_t pid = fork();
  if (pid < 0) return Internal("fork");
  if (pid == 0) {
    close(down[1]);
    close(up[0]);
    std::vector<std::string> args = {"/proc/self/exe",
                                     "bench",
                                     "pd",
                                     "--role",
                                     "prefill",
                                     "--lane",
                                     lane,
                                     "--mode",
                                     mode_s,
                                     "--block-bytes",
                                     bb,
                                     "--layers",
                                     layers,
                                     "--layer-bytes",
                                     lb,
                                     "--iters",
                                     iters,
                                     "--in-fd",
                                     in_fd,
                                     "--out-fd",
                                     out_fd};
    std::vector<char*> argv;
    for (auto& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    execve("/proc/self/exe", argv.data(), environ);
    _exit(127);
  }
  close(down[0]);
  close(up[1]);
  auto finish = [&](Status s) -> Status {
    close(down[1]);
    close(up[0]);
    int status = 0;
    for (int i = 0; i < 2000; ++i) {
      if (waitpid(pid, &status, WNOHANG) == pid)
        return s.ok() && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)
                   ? Internal(fmt::format("prefill process exited {}", status))
                   : s;
      std::this_thread::sleep_for(5ms);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    return s.ok() ? TimedOut("prefill process did not exit") : s;
  };
  auto blob = t->export_metadata();
  if (!blob.ok() || !send_blob(down[1], *blob)) return finish(Internal("sending the blob"));
  auto peer_blob = recv_blob(up[0]);
  if (!peer_blob.ok()) return finish(peer_blob.status());
  auto peer = t->load_peer(*peer_blob);
  if (!peer.ok()) return finish(peer.status());
  std::chrono::steady_clock::time_point t0;
  for (std::uint32_t it = 0; it <= a.iters; ++it) {
    if (it == 1) t0 = std::chrono::steady_clock::now();
    Status s = dec->start(*peer, it + 1, mode, iota(n));
    if (!s.ok()) return finish(s);
    auto st = dec->wait(it + 1, 60s, true);
    if (!st.ok()) return finish(st.status());
    if (st->leading_loaded_blocks() != n) return finish(st->error.ok() ? DataLoss("blocks not loaded") : st->error);
    if (Status f = dec->forget(it + 1); !f.ok()) return finish(f);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double bytes = static_cast<double>(a.iters) * a.layers * n * block_bytes;
  KVTIER_RETURN_IF_ERROR(finish(Status::Ok()));
  return bytes / secs / 1e9;
}

// ucx_perftest over the same lane: a server and a client process; GB/s of the client's "Final:" line.
Result<double> run_perftest(const std::string& lane, PdMode mode, std::uint64_t block_bytes, int port) {
  const transport::UcxOptions o = lane_options(lane);
  std::string env = "UCX_TLS=" + o.tls + (o.net_devices.empty() ? "" : " UCX_NET_DEVICES=" + o.net_devices);
  const std::string test = mode == PdMode::kPush ? "ucp_put_bw" : "ucp_get";
  const std::uint64_t iters = std::max<std::uint64_t>(200, (256ull << 20) / block_bytes);
  const std::string common = fmt::format("-t {} -s {} -n {} -p {}", test, block_bytes, iters, port);
  const std::string server = fmt::format("env {} timeout 60 ucx_perftest {} >/dev/null 2>&1 &", env, common);
  if (std::system(server.c_str()) != 0) return Unavailable("could not start the ucx_perftest server");
  std::this_thread::sleep_for(300ms);
  const std::string client = fmt::format("env {} timeout 60 ucx_perftest 127.0.0.1 {} 2>&1", env, common);
  FILE* f = popen(client.c_str(), "r");
  if (f == nullptr) return Unavailable("could not run the ucx_perftest client");
  std::string out;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, f) != nullptr) out += buf;
  const int rc = pclose(f);
  const auto pos = out.find("Final:");
  if (rc != 0 || pos == std::string::npos)
    return Unavailable(fmt::format("ucx_perftest {} failed (rc {}): {}", common, rc, out.substr(0, 300)));
  // Final: iterations, latency 50%ile, avg, overall, bandwidth (MB/s, 2^20 bytes) average, overall, ...
  std::istringstream line(out.substr(pos + 6));
  double v[6] = {};
  for (double& x : v) line >> x;
  return v[5] * 1048576.0 / 1e9;
}

int run_bench(const PdArgs& a) {
  if (!a.json)
    std::printf("%-5s %-5s %12s %8s %10s %18s %7s\n", "lane", "mode", "block_bytes", "blocks", "gbps",
                "ucx_perftest_gbps", "ratio");
  int rc = 0;
  int port = 13400 + static_cast<int>(getpid() % 500);
  for (const auto& lane : a.lanes) {
    for (const auto& m : a.modes) {
      const PdMode mode = m == "pull" ? PdMode::kPull : PdMode::kPush;
      for (std::uint64_t bs : a.block_sizes) {
        auto g = run_decode(a, lane, mode, bs);
        Result<double> p =
            a.no_perftest ? Result<double>(NotSupported("skipped")) : run_perftest(lane, mode, bs, port++);
        if (!g.ok()) {
          std::fprintf(stderr, "kvtier bench pd: %s %s %llu: %s\n", lane.c_str(), m.c_str(),
                       static_cast<unsigned long long>(bs), g.status().to_string().c_str());
          rc = 1;
          continue;
        }
        const double pg = p.ok() ? *p : 0.0;
        const double ratio = pg > 0 ? *g / pg : 0.0;
        if (a.json) {
          nlohmann::json j;
          j["bench"] = "pd";
          j["mode"] = m;
          j["lane"] = lane;
          j["block_bytes"] = bs;
          j["blocks"] = blocks_for(a, bs);
          j["layers"] = a.layers;
          j["iters"] = a.iters;
          j["gbps"] = *g;
          j["ucx_perftest_gbps"] = p.ok() ? nlohmann::json(pg) : nlohmann::json(nullptr);
          j["ratio"] = p.ok() ? nlohmann::json(ratio) : nlohmann::json(nullptr);
          if (!p.ok()) j["ucx_perftest_error"] = p.status().to_string();
          std::printf("%s\n", j.dump().c_str());
        } else {
          std::printf("%-5s %-5s %12llu %8llu %10.2f %18.2f %7.2f\n", lane.c_str(), m.c_str(),
                      static_cast<unsigned long long>(bs), static_cast<unsigned long long>(blocks_for(a, bs)), *g, pg,
                      ratio);
        }
        std::fflush(stdout);
      }
    }
  }
  return rc;
}

}  // namespace

Action register_bench_pd(CLI::App& bench) {
  auto a = std::make_shared<PdArgs>();
  auto* cmd = bench.add_subcommand("pd", "Prefill/decode KV transfer between two processes (UCX) vs ucx_perftest");
  cmd->add_option("--lanes", a->lanes, "UCX lanes: tcp (127.0.0.1), shm")->delimiter(',');
  cmd->add_option("--modes", a->modes, "push, pull")->delimiter(',');
  cmd->add_option("--block-sizes", a->block_sizes, "bytes per block (one role per layer)")->delimiter(',');
  cmd->add_option("--layers", a->layers, "layers per transfer");
  cmd->add_option("--layer-bytes", a->layer_bytes, "payload of one layer (sets the block count, >= 4 blocks)");
  cmd->add_option("--iters", a->iters, "measured transfers (after one warm-up)");
  cmd->add_flag("--json", a->json, "one JSON object per line");
  cmd->add_flag("--no-perftest", a->no_perftest, "skip ucx_perftest");
  auto* role = cmd->add_option("--role", a->role, "internal: the prefill process");
  role->group("");
  cmd->add_option("--lane", a->lane)->group("");
  cmd->add_option("--mode", a->mode)->group("");
  cmd->add_option("--block-bytes", a->block_bytes)->group("");
  cmd->add_option("--in-fd", a->in_fd)->group("");
  cmd->add_option("--out-fd", a->out_fd)->group("");
  return [cmd, a]() -> int {
    if (!cmd->parsed()) return -1;
    for (const auto& l : a->lanes)
      if (l != "tcp" && l != "shm") {
        std::fprintf(stderr, "kvtier bench pd: lane '%s' is not tcp or shm\n", l.c_str());
        return 2;
      }
    for (const auto& m : a->modes)
      if (m != "push" && m != "pull") {
        std::fprintf(stderr, "kvtier bench pd: mode '%s' is not push or pull\n", m.c_str());
        return 2;
      }
    if (a->role == "prefill") return run_prefill(*a);
    return run_bench(*a);
  };
}

}  // namespace kvtier::cli
