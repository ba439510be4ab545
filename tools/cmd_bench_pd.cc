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
// --memory device runs the same rows with the KV in device memory on both sides (CUDA memory of GPU 0 when one
// is visible, --backend; the host backend's simulated device memory otherwise) through the staged path
// (pd_staged.h): each layer device -> pinned staging with the CopyEngine, the protocol between the staging
// spaces, staging -> device on the decode side. GB/s then counts until every layer is in device memory;
// ratio_to_host = gbps / the host-memory row of the same lane, mode and block size in the same run (when
// --memory lists both). ucx_perftest runs once per (lane, mode, block size), in host memory.
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kvtier/copy/copy_engine.h"
#include "kvtier/device/cuda_device.h"
#include "kvtier/device/host_device.h"
#include "kvtier/transport/ipc.h"
#include "kvtier/transport/pd.h"
#include "kvtier/transport/pd_staged.h"
#include "tools/cli.h"

extern char** environ;

namespace kvtier::cli {
namespace {

using namespace std::chrono_literals;
using transport::PdMode;

struct PdArgs {
  std::vector<std::string> lanes = {"tcp", "shm"};
  std::vector<std::string> modes = {"push", "pull"};
  std::vector<std::string> memories = {"host"};
  std::string backend = "auto";  // device memory: auto | cuda | host
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
  std::string memory = "host";
  std::uint64_t block_bytes = 0;
  int in_fd = -1, out_fd = -1;
};

transport::UcxOptions lane_options(const std::string& lane) {
  if (lane == "tcp") return {"tcp", "lo"};
  return {"shm", ""};
}

// The transport of a lane: UCX for tcp and shm, kvtier's same-host ipc backend for ipc (its regions here are
// pinned host blocks or staging, shared as memfd windows).
Result<std::unique_ptr<transport::Transport>> lane_transport(transport::AgentIdentity id, const std::string& lane) {
  if (lane == "ipc") return transport::create_ipc_transport(std::move(id));
  return transport::create_ucx_transport(std::move(id), lane_options(lane));
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

Result<std::unique_ptr<Device>> open_device(const std::string& backend) {
  if (backend == "cuda" || (backend == "auto" && cuda_device_count() > 0)) return create_cuda_device(0);
  KVTIER_ASSIGN_OR_RETURN(auto host, HostDevice::create());
  return std::unique_ptr<Device>(std::move(host));
}

// The staged side of one process: device blocks (layer l filled with fill + l), pinned staging, the engine.
struct DeviceSide {
  std::unique_ptr<Device> device;
  std::unique_ptr<CopyEngine> engine;
  std::vector<Buffer> mem;
  BlockSpace space;
  transport::StagingSpace staging;
};

Result<DeviceSide> make_device_side(const std::string& backend, const KvLayout& layout, std::uint64_t n,
                                    std::byte fill) {
  DeviceSide d;
  KVTIER_ASSIGN_OR_RETURN(d.device, open_device(backend));
  KVTIER_ASSIGN_OR_RETURN(d.engine, CopyEngine::create(*d.device));
  KVTIER_ASSIGN_OR_RETURN(d.staging, transport::StagingSpace::allocate(*d.device, layout, n));
  std::vector<std::vector<void*>> bases(layout.num_layers());
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l) {
    const std::uint64_t bytes = layout.block_bytes(l, 0) * n;
    KVTIER_ASSIGN_OR_RETURN(Buffer b, d.device->allocate_device(bytes));
    // The staging memory is a convenient pinned source for the fill.
    std::byte* tmp = d.staging.space.block_ptr(l, 0, 0);
    std::memset(tmp, static_cast<int>(fill) + static_cast<int>(l), bytes);
    KVTIER_RETURN_IF_ERROR(d.device->memcpy_sync(b.data(), tmp, bytes));
    bases[l].push_back(b.data());
    d.mem.push_back(std::move(b));
  }
  KVTIER_ASSIGN_OR_RETURN(
      d.space, BlockSpace::layer_first(MemoryKind::kDevice, d.device->ordinal(), layout, n, std::move(bases)));
  return d;
}

// Every byte of the decode side's device blocks holds the prefill's fill of its layer.
Status check_device_bytes(DeviceSide& d, std::byte fill) {
  const KvLayout& layout = d.space.layout();
  const std::uint64_t n = d.space.num_blocks();
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l) {
    const std::uint64_t bytes = layout.block_bytes(l, 0) * n;
    std::byte* tmp = d.staging.space.block_ptr(l, 0, 0);
    std::memset(tmp, 0, bytes);
    KVTIER_RETURN_IF_ERROR(d.device->memcpy_sync(tmp, d.space.block_ptr(l, 0, 0), bytes));
    const auto want = static_cast<std::byte>(static_cast<int>(fill) + static_cast<int>(l));
    for (std::uint64_t i = 0; i < bytes; ++i)
      if (tmp[i] != want)
        return DataLoss(fmt::format("device memory of layer {} differs at byte {} after the transfer", l, i));
  }
  return Status::Ok();
}

const transport::PdOptions kPdOptions{std::chrono::milliseconds(200), std::chrono::milliseconds(5000)};

int run_prefill_staged(const PdArgs& a, const KvLayout& layout, std::uint64_t n) {
  auto side = make_device_side(a.backend, layout, n, std::byte{1});
  if (!side.ok()) {
    std::fprintf(stderr, "kvtier bench pd (prefill): %s\n", side.status().to_string().c_str());
    return 5;
  }
  auto t = lane_transport({"bench-prefill", layout.fingerprint(), 1, 0}, a.lane);
  if (!t.ok()) return 5;
  transport::StagedOptions so;
  so.pd = kPdOptions;
  auto pre =
      transport::PdStagedPrefill::create(**t, *side->device, *side->engine, side->space, side->staging.space, so);
  if (!pre.ok()) return 5;
  auto blob = (*t)->export_metadata();
  if (!blob.ok() || !send_blob(a.out_fd, *blob)) return 5;
  auto peer_blob = recv_blob(a.in_fd);
  if (!peer_blob.ok()) return 5;
  auto peer = (*t)->load_peer(*peer_blob);
  if (!peer.ok()) return 3;
  for (std::uint32_t it = 0; it <= a.iters; ++it) {
    if (!(*pre)->begin(*peer, it + 1, iota(n)).ok()) return 5;
    // The forward has finished every layer: the staging copies queue at once and each layer goes on the wire
    // as its copy completes, so layer L's copy overlaps layer L-1's transfer.
    for (std::uint32_t l = 0; l < a.layers; ++l)
      if (!(*pre)->layer_ready(it + 1, l).ok()) return 5;
    auto st = (*pre)->wait(it + 1, 60s);
    if (!st.ok() || !st->done) return 4;
    if (!(*pre)->forget(it + 1).ok()) return 5;
  }
  std::this_thread::sleep_for(100ms);
  return 0;
}

int run_prefill(const PdArgs& a) {
  alarm(300);
  if (a.memory == "device") {
    auto layout = KvLayout::uniform(a.layers, 1, a.block_bytes);
    if (!layout.ok()) return 5;
    return run_prefill_staged(a, *layout, blocks_for(a, a.block_bytes));
  }
  auto layout = KvLayout::uniform(a.layers, 1, a.block_bytes);
  if (!layout.ok()) return 5;
  const std::uint64_t n = blocks_for(a, a.block_bytes);
  auto blocks = make_blocks(*layout, n, std::byte{1});
  if (!blocks.ok()) return 5;
  auto t = lane_transport({"bench-prefill", layout->fingerprint(), 1, 0}, a.lane);
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
// The decode side of either memory: start a transfer, wait until it is final and reclaimable, forget it.
struct DecodeOps {
  std::function<Status(transport::PeerId, transport::TransferId, PdMode, std::vector<std::uint64_t>)> start;
  std::function<Result<transport::DecodeStatus>(transport::TransferId)> wait;
  std::function<Status(transport::TransferId)> forget;
};

Result<double> run_decode(const PdArgs& a, const std::string& lane, PdMode mode, std::uint64_t block_bytes,
                          const std::string& memory) {
  KVTIER_ASSIGN_OR_RETURN(KvLayout layout, KvLayout::uniform(a.layers, 1, block_bytes));
  const std::uint64_t n = blocks_for(a, block_bytes);
  const bool staged = memory == "device";
  // Declaration order is destruction order in reverse: endpoints, then the transport, then the memory.
  Blocks blocks;
  std::optional<DeviceSide> side;
  if (staged) {
    KVTIER_ASSIGN_OR_RETURN(side, make_device_side(a.backend, layout, n, std::byte{0x40}));
  } else {
    KVTIER_ASSIGN_OR_RETURN(blocks, make_blocks(layout, n, std::byte{0x40}));
  }
  KVTIER_ASSIGN_OR_RETURN(
      auto t, lane_transport({"bench-decode", layout.fingerprint(), 1, 0}, lane));
  std::unique_ptr<transport::PdDecode> plain;
  std::unique_ptr<transport::PdStagedDecode> sdec;
  DecodeOps dec;
  if (staged) {
    transport::StagedOptions so;
    so.pd = kPdOptions;
    KVTIER_ASSIGN_OR_RETURN(sdec, transport::PdStagedDecode::create(*t, *side->device, *side->engine, side->space,
                                                                    side->staging.space, so));
    dec = {[&](auto p, auto id, auto m, auto b) { return sdec->start(p, id, m, std::move(b)); },
           [&](auto id) { return sdec->wait(id, 60s, true); }, [&](auto id) { return sdec->forget(id); }};
  } else {
    KVTIER_ASSIGN_OR_RETURN(plain, transport::PdDecode::create(*t, blocks.space, kPdOptions));
    dec = {[&](auto p, auto id, auto m, auto b) { return plain->start(p, id, m, std::move(b)); },
           [&](auto id) { return plain->wait(id, 60s, true); }, [&](auto id) { return plain->forget(id); }};
  }
  int down[2], up[2];
  if (pipe(down) != 0 || pipe(up) != 0) return Internal("pipe");
  const std::string bb = std::to_string(block_bytes), layers = std::to_string(a.layers),
                    lb = std::to_string(a.layer_bytes), iters = std::to_string(a.iters),
                    in_fd = std::to_string(down[0]), out_fd = std::to_string(up[1]);
  const std::string mode_s(transport::pd_mode_name(mode));
  const std::string backend = a.backend;
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
                                     out_fd,
                                     "--memory-one",
                                     memory,
                                     "--backend",
                                     backend};
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
    Status s = dec.start(*peer, it + 1, mode, iota(n));
    if (!s.ok()) return finish(s);
    auto st = dec.wait(it + 1);
    if (!st.ok()) return finish(st.status());
    if (st->leading_loaded_blocks() != n) return finish(st->error.ok() ? DataLoss("blocks not loaded") : st->error);
    if (Status f = dec.forget(it + 1); !f.ok()) return finish(f);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double bytes = static_cast<double>(a.iters) * a.layers * n * block_bytes;
  KVTIER_RETURN_IF_ERROR(finish(Status::Ok()));
  if (staged) KVTIER_RETURN_IF_ERROR(check_device_bytes(*side, std::byte{1}));
  return bytes / secs / 1e9;
}

// ucx_perftest over the same lane: a server and a client process; GB/s of the client's "Final:" line.
Result<double> run_perftest(const std::string& lane, PdMode mode, std::uint64_t block_bytes, int port) {
  if (lane == "ipc") return NotSupported("ucx_perftest has no ipc lane");
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
    std::printf("%-5s %-5s %-6s %12s %8s %10s %18s %7s %13s\n", "lane", "mode", "memory", "block_bytes", "blocks",
                "gbps", "ucx_perftest_gbps", "ratio", "ratio_to_host");
  int rc = 0;
  int port = 13400 + static_cast<int>(getpid() % 500);
  for (const auto& lane : a.lanes) {
    for (const auto& m : a.modes) {
      const PdMode mode = m == "pull" ? PdMode::kPull : PdMode::kPush;
      for (std::uint64_t bs : a.block_sizes) {
        Result<double> p =
            a.no_perftest ? Result<double>(NotSupported("skipped")) : run_perftest(lane, mode, bs, port++);
        std::optional<double> host_gbps;
        for (const auto& memory : a.memories) {
          auto g = run_decode(a, lane, mode, bs, memory);
          if (!g.ok()) {
            std::fprintf(stderr, "kvtier bench pd: %s %s %s %llu: %s\n", lane.c_str(), m.c_str(), memory.c_str(),
                         static_cast<unsigned long long>(bs), g.status().to_string().c_str());
            rc = 1;
            continue;
          }
          if (memory == "host") host_gbps = *g;
          const double pg = p.ok() ? *p : 0.0;
          const double ratio = pg > 0 ? *g / pg : 0.0;
          const std::optional<double> to_host =
              memory != "host" && host_gbps && *host_gbps > 0 ? std::optional<double>(*g / *host_gbps) : std::nullopt;
          if (a.json) {
            nlohmann::json j;
            j["bench"] = "pd";
            j["mode"] = m;
            j["lane"] = lane;
            j["memory"] = memory;
            j["block_bytes"] = bs;
            j["blocks"] = blocks_for(a, bs);
            j["layers"] = a.layers;
            j["iters"] = a.iters;
            j["gbps"] = *g;
            j["ucx_perftest_gbps"] = p.ok() ? nlohmann::json(pg) : nlohmann::json(nullptr);
            j["ratio"] = p.ok() ? nlohmann::json(ratio) : nlohmann::json(nullptr);
            if (memory != "host") {
              j["backend"] = a.backend == "auto" ? (cuda_device_count() > 0 ? "cuda" : "host") : a.backend;
              j["host_gbps"] = host_gbps ? nlohmann::json(*host_gbps) : nlohmann::json(nullptr);
              j["ratio_to_host"] = to_host ? nlohmann::json(*to_host) : nlohmann::json(nullptr);
            }
            if (!p.ok()) j["ucx_perftest_error"] = p.status().to_string();
            std::printf("%s\n", j.dump().c_str());
          } else {
            const std::string th = to_host ? fmt::format("{:.2f}", *to_host) : "-";
            std::printf("%-5s %-5s %-6s %12llu %8llu %10.2f %18.2f %7.2f %13s\n", lane.c_str(), m.c_str(),
                        memory.c_str(), static_cast<unsigned long long>(bs),
                        static_cast<unsigned long long>(blocks_for(a, bs)), *g, pg, ratio, th.c_str());
          }
          std::fflush(stdout);
        }
      }
    }
  }
  return rc;
}

}  // namespace

Action register_bench_pd(CLI::App& bench) {
  auto a = std::make_shared<PdArgs>();
  auto* cmd = bench.add_subcommand("pd", "Prefill/decode KV transfer between two processes (UCX) vs ucx_perftest");
  cmd->add_option("--lanes", a->lanes, "lanes: tcp (UCX, 127.0.0.1), shm (UCX), ipc (kvtier's same-host backend)")->delimiter(',');
  cmd->add_option("--modes", a->modes, "push, pull")->delimiter(',');
  cmd->add_option("--memory", a->memories,
                  "host (pinned host blocks), device (device blocks through the staged path); both: host,device")
      ->delimiter(',');
  cmd->add_option("--backend", a->backend, "device memory: auto | cuda | host (auto: cuda when a GPU is visible)");
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
  cmd->add_option("--memory-one", a->memory)->group("");
  cmd->add_option("--in-fd", a->in_fd)->group("");
  cmd->add_option("--out-fd", a->out_fd)->group("");
  return [cmd, a]() -> int {
    if (!cmd->parsed()) return -1;
    for (const auto& l : a->lanes)
      if (l != "tcp" && l != "shm" && l != "ipc") {
        std::fprintf(stderr, "kvtier bench pd: lane '%s' is not tcp, shm or ipc\n", l.c_str());
        return 2;
      }
    for (const auto& m : a->modes)
      if (m != "push" && m != "pull") {
        std::fprintf(stderr, "kvtier bench pd: mode '%s' is not push or pull\n", m.c_str());
        return 2;
      }
    for (const auto& m : a->memories)
      if (m != "host" && m != "device") {
        std::fprintf(stderr, "kvtier bench pd: memory '%s' is not host or device\n", m.c_str());
        return 2;
      }
    if (a->backend != "auto" && a->backend != "cuda" && a->backend != "host") {
      std::fprintf(stderr, "kvtier bench pd: backend '%s' is not auto, cuda or host\n", a->backend.c_str());
      return 2;
    }
    if (a->backend == "cuda" && cuda_device_count() == 0) {
      std::fprintf(stderr, "kvtier bench pd: --backend cuda, but no CUDA device is visible (or built without CUDA)\n");
      return 2;
    }
    if (a->role == "prefill") return run_prefill(*a);
    return run_bench(*a);
  };
}

}  // namespace kvtier::cli
