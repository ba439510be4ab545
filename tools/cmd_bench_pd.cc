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
//
// --lanes direct runs the device lane of pd.h between the two processes (CUDA memory of GPU 0 on both sides,
// the ipc backend mapping each other's pool through CUDA IPC): push, the prefill's copy kernel writes the
// decode's blocks; pull, the decode's kernel reads the prefill's; checksums computed on the GPU. Its blocks are
// scattered: `blocks` ids out of a pool of --pool-bytes per side (direct_plan: a stride coprime to the pool,
// so no two listed blocks are adjacent), another list on the other side, the pool filled with a pattern of (layer,
// block, word) and the destination poisoned; after the measured transfers every destination block is compared with the
// pattern of its source and blocks outside the list must still hold the poison. Beside it, in the decode process, the
// same block lists gathered inside one process (pool to a second pool, one SM-kernel launch per layer, without and with
// checksums): ratio_to_gather = gbps / gather_gbps; and the plain gather with one CTA per SM instead of the lane
// engine's count: ratio_to_gather_all_sms = gbps / gather_all_sms_gbps; and the lane's own kernel in one process (every
// layer in one copy that reads back what it wrote, as the mover does): ratio_to_gather_landed = gbps /
// gather_landed_gbps. --lane-engine KEY=VALUE sets the lane engines' CopyEngineOptions (both processes).
//
// --lanes ring runs the ring lane of pd.h on the same pools and lists (forced: the two processes could map each
// other's pools): each layer goes device -> the decode's shared pinned ring (the prefill's copy) -> device (the
// decode's), --ring-slots slots of --ring-slot-bytes (0: one layer of a transfer), a row per --ring-copy strategy.
// Beside it, in the decode process, the PCIe ceiling of the same bytes: contiguous cudaMemcpyAsync of one layer's
// bytes device -> pinned host and back, each direction alone (ratio_to_ceiling = gbps / min(d2h, h2d)) and both at
// once on two streams (ratio_to_duplex_ceiling: with both processes on one GPU the ring's D2H and H2D share its
// link, which carries less each way when both run).
#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kvtier/copy/copy_config.h"
#include "kvtier/copy/copy_engine.h"
#include "kvtier/core/config.h"
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
  std::uint64_t pool_bytes = 512ull << 20;  // direct lane: the pool the scattered blocks are taken from, per side
  std::vector<std::string> lane_verifies = {"mover"};  // direct lanes: PdOptions::lane_verify values, a row each
  std::vector<std::uint32_t> inflights = {1};          // direct lanes: transfers in flight, a row each
  // Direct and ring lanes: when the decode counts a transfer done. "reclaimable": its blocks loaded and verified and
  // the prefill's writes proven over ('F', 'Q'), then forgotten, before the next transfer past the in-flight limit
  // starts. "final": loaded and verified (what a decode engine waits for before its step); it is forgotten once
  // reclaimable, after the next one is final, so that exchange overlaps the next transfer's bytes.
  std::string decode_wait = "reclaimable";
  std::uint32_t ring_slots = 4;                     // ring lane
  std::uint64_t ring_slot_bytes = 0;                // ring lane: 0 = one layer of a transfer
  std::vector<std::string> ring_copies = {"auto"};  // ring lane: PdOptions::ring_copy values, a row each
  int prefill_gpu = -1;  // ring lane: the prefill process on this GPU (CUDA_VISIBLE_DEVICES); -1: the decode's
  // Where host blocks and staging live: "transport" (Transport::allocate_host, what the lane reaches best) or
  // "caller" (plain memory the caller allocated, registered as it is).
  std::string host_alloc = "transport";
  // hidden: the prefill process
  std::string role;
  std::string lane = "tcp";
  std::string mode = "push";
  std::string memory = "host";
  std::uint64_t block_bytes = 0;
  int in_fd = -1, out_fd = -1;
  std::string lane_verify = "mover";
  std::uint32_t inflight = 1;
  std::string ring_copy = "auto";
  // KEY=VALUE settings of the lanes' CopyEngineOptions (copy_config.h's knob names without a prefix), applied over
  // transport::lane_engine_options() in both processes.
  std::vector<std::string> lane_engine;
  // PdOptions::busy_wait of both endpoints, in microseconds.
  std::int64_t busy_wait_us = transport::PdOptions{}.busy_wait.count();
};

// The options of every lane engine this command creates: lane_engine_options() with --lane-engine applied (set
// once, before any row; the prefill process applies the same settings, forwarded on its command line).
CopyEngineOptions g_lane_engine = transport::lane_engine_options();

// Applies --lane-engine's KEY=VALUE settings to lane_engine_options(); InvalidArgument naming the setting.
Result<CopyEngineOptions> lane_engine_from(const std::vector<std::string>& settings) {
  CopyEngineOptions o = transport::lane_engine_options();
  ConfigTable t;
  bind_copy_engine_options(t, o, "engine");
  for (const std::string& kv : settings) {
    const auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0)
      return InvalidArgument(
          fmt::format("--lane-engine '{}': expected KEY=VALUE (e.g. sm_landed_item_bytes=8192)", kv));
    KVTIER_RETURN_IF_ERROR(t.set("engine." + kv.substr(0, eq), kv.substr(eq + 1)));
  }
  KVTIER_RETURN_IF_ERROR(check_copy_engine_options(o));
  return o;
}

// The ring lane's options of a row (both processes); `layer_bytes`: one layer of a transfer.
void set_ring_options(const PdArgs& a, std::uint64_t layer_bytes, transport::PdOptions& o) {
  o.ring_slots = a.ring_slots;
  o.ring_slot_bytes = a.ring_slot_bytes != 0 ? a.ring_slot_bytes : layer_bytes;
  o.ring_copy = parse_copy_strategy(a.ring_copy).value_or(CopyStrategy::kAuto);
}

// A --lane-verify value: a PdOptions::lane_verify name, or "mover-pass" (the mover verifies with a separate
// read-back pass instead of inside its copy kernel, PdOptions::lane_read_back_in_copy = false).
constexpr std::string_view kMoverPass = "mover-pass";

void set_lane_verify(const std::string& name, transport::PdOptions& o) {
  o.lane_verify = name == kMoverPass
                      ? transport::PdOptions::LaneVerify::kMover
                      : transport::parse_lane_verify(name).value_or(transport::PdOptions::LaneVerify::kMover);
  o.lane_read_back_in_copy = name != kMoverPass;
}

// tcp takes UCX over TCP's default data path (active messages, UcxDataPath), tcp-rma UCX's emulated RMA.
bool tcp_lane(const std::string& lane) { return lane == "tcp" || lane == "tcp-rma"; }

transport::UcxOptions lane_options(const std::string& lane) {
  transport::UcxOptions o;
  o.tls = tcp_lane(lane) ? "tcp" : "shm";
  o.net_devices = tcp_lane(lane) ? "lo" : "";
  if (lane == "tcp-rma") o.data_path = transport::UcxDataPath::kRma;
  return o;
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
  std::vector<std::unique_ptr<std::byte[]>> mem;  // empty when the transport owns the memory
  BlockSpace space;
};

// Host blocks, layer l filled with fill + l: one allocation from `t` (allocate_host) for every layer, or, with
// `t` null, one caller allocation per layer.
Result<Blocks> make_blocks(const KvLayout& layout, std::uint64_t n, std::byte fill, transport::Transport* t) {
  Blocks b;
  std::vector<std::vector<void*>> bases(layout.num_layers());
  std::span<std::byte> all;
  if (t != nullptr) {
    std::uint64_t total = 0;
    for (std::uint32_t l = 0; l < layout.num_layers(); ++l) total += layout.block_bytes(l, 0) * n;
    KVTIER_ASSIGN_OR_RETURN(all, t->allocate_host(total));
  }
  std::uint64_t off = 0;
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l) {
    const std::uint64_t bytes = layout.block_bytes(l, 0) * n;
    std::byte* p = nullptr;
    if (t != nullptr) {
      p = all.data() + off;
      off += bytes;
    } else {
      b.mem.emplace_back(new std::byte[bytes]);
      p = b.mem.back().get();
    }
    std::memset(p, static_cast<int>(fill) + static_cast<int>(l), bytes);
    bases[l].push_back(p);
  }
  KVTIER_ASSIGN_OR_RETURN(b.space, BlockSpace::layer_first(MemoryKind::kPinnedHost, 0, layout, n, bases));
  return b;
}

std::vector<BlockId> iota(std::uint64_t n) {
  std::vector<BlockId> v(n);
  for (std::uint64_t i = 0; i < n; ++i) v[i] = static_cast<BlockId>(i);
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

// `t`: the transport the staging comes from (nullptr: the device's pinned memory); it must outlive the side.
Result<DeviceSide> make_device_side(const std::string& backend, const KvLayout& layout, std::uint64_t n, std::byte fill,
                                    transport::Transport* t, std::uint32_t inflight) {
  DeviceSide d;
  KVTIER_ASSIGN_OR_RETURN(d.device, open_device(backend));
  KVTIER_ASSIGN_OR_RETURN(d.engine, CopyEngine::create(*d.device, g_lane_engine));
  // Staging for every transfer in flight (each takes n staging blocks until it is forgotten).
  const std::uint64_t staging_blocks = n * std::max<std::uint32_t>(1, inflight);
  KVTIER_ASSIGN_OR_RETURN(d.staging, transport::StagingSpace::allocate(*d.device, layout, staging_blocks, t));
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

// Every endpoint's options (heartbeat, lease), with --busy-wait-us applied (set once, before any row; the prefill
// process gets the same value on its command line).
transport::PdOptions g_pd_options{std::chrono::milliseconds(200), std::chrono::milliseconds(5000)};

// The host lanes' options: shm-direct is UCX's shared-memory transport with PdOptions::host_direct (the moving side
// copies through UCX's mapping of the peer's pool).
transport::PdOptions host_lane_options(const std::string& lane) {
  transport::PdOptions o = g_pd_options;
  o.host_direct = lane == "shm-direct";
  return o;
}

// ---- the direct lane ----------------------------------------------------------------------------------------

struct DirectPlan {
  std::uint64_t pool = 0;  // blocks per layer plane
  std::vector<BlockId> src;
  std::vector<std::vector<BlockId>> dsts;  // one destination list per transfer in flight, disjoint
  const std::vector<BlockId>& dst_of(std::uint64_t transfer) const { return dsts[transfer % dsts.size()]; }
};

// The same lists in both processes (and in bench/pd_nixl.py): `n` distinct ids per side out of the pool,
// id_i = (a * i + b) mod pool with `a` coprime to the pool, so no two neighbours in the list are neighbours
// in memory (nothing merges into larger runs) and the list is reproducible anywhere.
std::uint64_t coprime_step(std::uint64_t start, std::uint64_t pool) {
  std::uint64_t a = start;
  while (std::gcd(a, pool) != 1) ++a;
  return a;
}

// With `inflight` transfers in flight each gets its own destination list: consecutive stretches of one
// sequence, so no block is the destination of two transfers at once. Every list has the same sources.
DirectPlan direct_plan(const PdArgs& a, std::uint64_t block_bytes, std::uint32_t inflight) {
  DirectPlan p;
  const std::uint64_t n = blocks_for(a, block_bytes);
  p.pool = std::max<std::uint64_t>((std::uint64_t{inflight} + 1) * n,
                                   a.pool_bytes / (std::uint64_t{a.layers} * block_bytes));
  const std::uint64_t as = coprime_step(7919, p.pool), ad = coprime_step(104729, p.pool);
  for (std::uint64_t i = 0; i < n; ++i) p.src.push_back(static_cast<BlockId>((as * i + 13) % p.pool));
  p.dsts.resize(inflight);
  for (std::uint32_t k = 0; k < inflight; ++k)
    for (std::uint64_t i = 0; i < n; ++i) p.dsts[k].push_back(static_cast<BlockId>((ad * (k * n + i) + 101) % p.pool));
  return p;
}

// Destination lists a run needs: one per transfer in flight, and one more when the decode forgets a transfer only
// after the next one is final (--decode-wait final), so no block is the destination of two unforgotten transfers.
std::uint32_t plan_lists(const PdArgs& a) { return a.inflight + (a.decode_wait == "final" ? 1 : 0); }

// --decode-wait final: a transfer final on the decode side is waited on until reclaimable and forgotten only after
// the next one is final (or at the end), so the 'F' / 'Q' exchange that makes it reclaimable overlaps the next
// transfer instead of preceding it.
class DeferredForget {
 public:
  DeferredForget(std::function<Result<transport::DecodeStatus>(transport::TransferId)> wait_reclaimable,
                 std::function<Status(transport::TransferId)> forget)
      : wait_reclaimable_(std::move(wait_reclaimable)), forget_(std::move(forget)) {}
  // `id` is final: forgets the one deferred before it, then defers `id`.
  Status defer(transport::TransferId id) {
    Status s = drain();
    pending_ = id;
    return s;
  }
  Status drain() {
    if (!pending_) return Status::Ok();
    const transport::TransferId id = *pending_;
    pending_.reset();
    auto st = wait_reclaimable_(id);
    if (!st.ok()) return st.status().with_context(fmt::format("transfer {}: reclaim", id));
    return forget_(id);
  }

 private:
  std::function<Result<transport::DecodeStatus>(transport::TransferId)> wait_reclaimable_;
  std::function<Status(transport::TransferId)> forget_;
  std::optional<transport::TransferId> pending_;
};

std::uint64_t pattern_word(std::uint32_t layer, std::uint64_t block, std::uint64_t word) {
  std::uint64_t x = (std::uint64_t{layer} << 56) ^ (block << 28) ^ word ^ 0x9E3779B97F4A7C15ull;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return x;
}

constexpr std::byte kPoison{0x5A};

struct DirectSide {
  std::unique_ptr<Device> device;
  std::unique_ptr<CopyEngine> engine;
  std::vector<Buffer> mem;
  BlockSpace space;
};

// A pool of `pool` blocks per layer in device memory (CUDA memory of GPU 0, or the host backend's for the
// in-process lane): the pattern (prefill) or the poison (decode).
Result<DirectSide> make_direct_side(const KvLayout& layout, std::uint64_t pool, bool fill_pattern,
                                    const std::string& backend = "cuda") {
  DirectSide d;
  KVTIER_ASSIGN_OR_RETURN(d.device, open_device(backend));
  KVTIER_ASSIGN_OR_RETURN(d.engine, CopyEngine::create(*d.device, g_lane_engine));
  std::vector<std::vector<void*>> bases(layout.num_layers());
  const std::uint64_t bb = layout.block_bytes(0, 0);
  std::vector<std::uint64_t> host(pool * bb / 8);
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l) {
    KVTIER_ASSIGN_OR_RETURN(Buffer b, d.device->allocate_device(pool * bb));
    if (fill_pattern) {
      for (std::uint64_t blk = 0; blk < pool; ++blk)
        for (std::uint64_t w = 0; w < bb / 8; ++w) host[blk * (bb / 8) + w] = pattern_word(l, blk, w);
    } else {
      std::memset(host.data(), static_cast<int>(kPoison), pool * bb);
    }
    KVTIER_RETURN_IF_ERROR(d.device->memcpy_sync(b.data(), host.data(), pool * bb));
    bases[l].push_back(b.data());
    d.mem.push_back(std::move(b));
  }
  KVTIER_ASSIGN_OR_RETURN(d.space, BlockSpace::layer_first(MemoryKind::kDevice, 0, layout, pool, std::move(bases)));
  return d;
}

// Destination blocks hold their source's pattern; every other block still holds the poison.
Status check_direct_bytes(DirectSide& d, const DirectPlan& p) {
  const KvLayout& layout = d.space.layout();
  const std::uint64_t bb = layout.block_bytes(0, 0);
  std::vector<std::uint64_t> host(p.pool * bb / 8);
  std::vector<std::int64_t> source_of(p.pool, -1);
  for (const auto& dst : p.dsts)
    for (std::size_t i = 0; i < dst.size(); ++i) source_of[dst[i]] = static_cast<std::int64_t>(p.src[i]);
  std::uint64_t poison_word = 0;
  std::memset(&poison_word, static_cast<int>(kPoison), 8);
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l) {
    KVTIER_RETURN_IF_ERROR(d.device->memcpy_sync(host.data(), d.space.block_ptr(l, 0, 0), p.pool * bb));
    for (std::uint64_t blk = 0; blk < p.pool; ++blk)
      for (std::uint64_t w = 0; w < bb / 8; ++w) {
        const std::uint64_t want =
            source_of[blk] < 0 ? poison_word : pattern_word(l, static_cast<std::uint64_t>(source_of[blk]), w);
        if (host[blk * (bb / 8) + w] != want)
          return DataLoss(fmt::format("layer {} block {} word {}: {:#x}, expected {:#x} ({})", l, blk, w,
                                      host[blk * (bb / 8) + w], want,
                                      source_of[blk] < 0 ? "outside the list: poison" : "its source's pattern"));
      }
  }
  return Status::Ok();
}

Result<std::unique_ptr<transport::Transport>> direct_transport(transport::AgentIdentity id) {
  transport::IpcOptions o;
  o.device_memory = transport::IpcOptions::DeviceMemory::kCuda;
  o.cuda_device = 0;
  return transport::create_ipc_transport(std::move(id), o);
}

// 0, 1, ..., layers - 1: what the prefill declares ready at once (its forward has finished).
std::vector<std::uint32_t> all_layers(const PdArgs& a) {
  std::vector<std::uint32_t> l(a.layers);
  std::iota(l.begin(), l.end(), 0u);
  return l;
}

// Transfers 1 (the warm-up, alone) to iters + 1, up to `inflight` of the measured ones open at once, each
// awaited and forgotten in order: `open(id)` starts one, `close(id)` waits for it and forgets it.
// `latencies_us`, when given, gets each measured transfer's time from the start of its open to the return of its
// close (one transfer at a time: what a transfer costs end to end).
Status run_transfers(
    std::uint32_t iters, std::uint32_t inflight, const std::function<Status(std::uint64_t)>& open,
    const std::function<Status(std::uint64_t)>& close, const std::function<void()>& measured_from = [] {},
    std::vector<double>* latencies_us = nullptr) {
  KVTIER_RETURN_IF_ERROR(open(1));
  KVTIER_RETURN_IF_ERROR(close(1));
  measured_from();
  if (latencies_us != nullptr) latencies_us->clear();
  std::map<std::uint64_t, std::chrono::steady_clock::time_point> opened;
  std::deque<std::uint64_t> pending;
  for (std::uint64_t next = 2, last = std::uint64_t{iters} + 1; next <= last || !pending.empty();) {
    while (next <= last && pending.size() < std::max<std::uint32_t>(1, inflight)) {
      opened[next] = std::chrono::steady_clock::now();
      KVTIER_RETURN_IF_ERROR(open(next));
      pending.push_back(next++);
    }
    KVTIER_RETURN_IF_ERROR(close(pending.front()));
    if (latencies_us != nullptr)
      latencies_us->push_back(
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - opened[pending.front()])
              .count());
    pending.pop_front();
  }
  return Status::Ok();
}

// The decode's per-transfer latencies of the last direct or ring row (run_transfers' latencies_us).
std::vector<double> g_last_latencies;
double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[static_cast<std::size_t>(q * static_cast<double>(v.size() - 1) + 0.5)];
}

// Where one transfer's time went, both endpoints in this process (direct-inproc): per measured transfer, the
// prefill's and the decode's step times (PdTimes) and when the decode's wait returned; summarized as the p50 of
// each step's share, in microseconds (empty for rows without both sides here).
struct TransferSteps {
  transport::PdTimes prefill, decode;
  std::chrono::steady_clock::time_point waited;
};
std::map<std::string, double> g_last_phases;
std::map<std::string, double> summarize_steps(const std::map<std::uint64_t, TransferSteps>& steps, PdMode mode) {
  using TP = std::chrono::steady_clock::time_point;
  auto us = [](TP from, TP to) {
    return from == TP{} || to == TP{} ? -1.0 : std::chrono::duration<double, std::micro>(to - from).count();
  };
  std::map<std::string, std::vector<double>> v;
  for (const auto& [id, t] : steps) {
    const transport::PdTimes &p = t.prefill, &d = t.decode;
    v["total"].push_back(us(d.started, t.waited));
    v["decode_start_to_request_sent"].push_back(us(d.started, d.request));
    v["request_to_prefill"].push_back(us(d.request, p.request));
    if (mode == PdMode::kPush) {
      // The prefill moves: a request that came before the prefill's begin() waits for it (the bench's prefill opens
      // a transfer once an earlier one is done); then its copy, seen complete, the notifications, the decode's
      // verdict.
      v["request_waits_for_begin"].push_back(std::max(0.0, us(p.request, p.started)));
      v["prefill_until_move"].push_back(us(std::max(p.request, p.started), p.move));
      v["move_until_posted"].push_back(us(p.move, p.posted));
      v["posted_until_seen_done"].push_back(us(p.posted, p.moved));
      v["seen_done_to_notified"].push_back(us(p.moved, p.announced));
      v["notified_to_decode_final"].push_back(us(p.announced, d.final));
    } else {
      // The decode moves once announced: from the request's arrival (begin(), the announcement and its hop) to the
      // decode's copy, the copy until seen complete, the verdict.
      v["prefill_request_to_decode_move"].push_back(us(p.request, d.move));
      v["move_until_posted"].push_back(us(d.move, d.posted));
      v["posted_until_seen_done"].push_back(us(d.posted, d.moved));
      v["seen_done_to_decode_final"].push_back(us(d.moved, d.final));
    }
    // The decode's waiter woken (a transfer that loaded is reclaimable at once); beside the chain, the hop of the
    // decode's 'F' to the prefill.
    v["decode_final_to_wait_returned"].push_back(us(d.final, t.waited));
    v["decode_final_to_prefill_final"].push_back(us(d.final, p.final));
  }
  std::map<std::string, double> out;
  for (auto& [name, xs] : v) {
    std::erase_if(xs, [](double x) { return x < 0; });
    if (!xs.empty()) out[name] = quantile(xs, 0.5);
  }
  return out;
}

// The prefill process's part after its endpoint exists: blobs over the pipes, then one warm-up and `iters`
// measured transfers of `src` (`inflight` at once), every layer ready at once (the forward has finished), each
// awaited and forgotten. The endpoint is a PdPrefill or a PdStagedPrefill. Exit codes: 3 peer refused,
// 4 transfer failed, 5 other.
template <typename Prefill>
int serve_prefill(const PdArgs& a, transport::Transport& t, Prefill& pre, const std::vector<BlockId>& src) {
  auto blob = t.export_metadata();
  if (!blob.ok() || !send_blob(a.out_fd, *blob)) return 5;
  auto peer_blob = recv_blob(a.in_fd);
  if (!peer_blob.ok()) return 5;
  auto peer = t.load_peer(*peer_blob);
  if (!peer.ok()) return 3;
  bool failed = false;
  // With --decode-wait final the prefill opens one transfer more than the decode has in flight: an engine's prefill
  // begins its next request without waiting for the last one's reclaim; nothing moves before the decode's request.
  Status s = run_transfers(
      a.iters, plan_lists(a),
      [&](std::uint64_t id) {
        KVTIER_RETURN_IF_ERROR(pre.begin(*peer, id, src));
        if constexpr (requires { pre.layers_ready(id, std::span<const std::uint32_t>{}); }) {
          return pre.layers_ready(id, all_layers(a));  // the forward has finished: every layer at once
        } else {
          for (std::uint32_t l = 0; l < a.layers; ++l) KVTIER_RETURN_IF_ERROR(pre.layer_ready(id, l));
          return Status::Ok();
        }
      },
      [&](std::uint64_t id) {
        auto st = pre.wait(id, 60s);
        if (!st.ok() || !st->done) {
          failed = true;
          return st.ok() ? st->error : st.status();
        }
        return pre.forget(id);
      });
  if (!s.ok()) return failed ? 4 : 5;
  std::this_thread::sleep_for(100ms);
  return 0;
}

int run_prefill_direct(const PdArgs& a) {
  auto layout = KvLayout::uniform(a.layers, 1, a.block_bytes);
  if (!layout.ok()) return 5;
  const DirectPlan plan = direct_plan(a, a.block_bytes, plan_lists(a));
  auto side = make_direct_side(*layout, plan.pool, true);
  if (!side.ok()) {
    std::fprintf(stderr, "kvtier bench pd (prefill): %s\n", side.status().to_string().c_str());
    return 5;
  }
  auto t = direct_transport({"bench-prefill", layout->fingerprint(), 1, 0});
  if (!t.ok()) return 5;
  transport::PdOptions o = g_pd_options;
  o.engine = side->engine.get();
  set_lane_verify(a.lane_verify, o);
  if (a.lane == "ring") set_ring_options(a, plan.src.size() * a.block_bytes, o);
  auto pre = transport::PdPrefill::create(**t, side->space, o);
  if (!pre.ok()) {
    std::fprintf(stderr, "kvtier bench pd (prefill): %s\n", pre.status().to_string().c_str());
    return 5;
  }
  return serve_prefill(a, **t, **pre, plan.src);
}

struct GatherRates {
  double plain = 0, checksummed = 0;
  // The plain gather with a copy kernel of one CTA per SM (the lane engine runs lane_engine_options()'s
  // sm_ctas_d2d, a quarter of an H200's SMs): a gather that uses the whole GPU, a reference the lane's own engine
  // options do not set.
  double all_sms = 0;
  std::uint32_t all_sms_ctas = 0;
  // The lane's own kernel in one process: the lane engine's copy of every layer at once with both checksum lists
  // (CopyRequest::landed_checksums: the read-back inside the copy), as the mover copies layers that are ready
  // together. The lane against it is the protocol's and the second process's cost; it against all_sms is the
  // integrity's.
  double landed = 0;
};
GatherRates g_last_gather;  // of the last direct row (the decode process)

struct PcieRates {
  double d2h = 0, h2d = 0;  // each direction alone
  double duplex = 0;        // each direction while the other runs (the same bytes both ways at once)
};
PcieRates g_last_ceiling;  // of the last ring row (the decode process)

// The PCIe ceiling for the ring rows: one layer's bytes of a transfer copied contiguously between a device pool
// and pinned host memory, iters x layers times each way, after a warm-up: one direction at a time, then both at
// once on two streams (what a ring between two processes on one GPU shares: its D2H and H2D cross one link).
Result<PcieRates> run_pcie_ceiling(const PdArgs& a, DirectSide& d, std::uint64_t layer_bytes) {
  KVTIER_ASSIGN_OR_RETURN(auto pinned, d.device->allocate_pinned(layer_bytes));
  KVTIER_RETURN_IF_ERROR(pinned->wait_ready(60s));
  KVTIER_ASSIGN_OR_RETURN(auto pinned2, d.device->allocate_pinned(layer_bytes));
  KVTIER_RETURN_IF_ERROR(pinned2->wait_ready(60s));
  KVTIER_ASSIGN_OR_RETURN(auto stream, d.device->create_stream());
  KVTIER_ASSIGN_OR_RETURN(auto stream2, d.device->create_stream());
  std::byte* dev = static_cast<std::byte*>(d.mem[0].data());
  std::byte* dev2 = static_cast<std::byte*>(d.mem[d.mem.size() > 1 ? 1 : 0].data());
  PcieRates r;
  {
    std::chrono::steady_clock::time_point t0;
    for (std::uint32_t it = 0; it <= a.iters; ++it) {
      if (it == 1) {
        KVTIER_RETURN_IF_ERROR(d.device->synchronize(*stream, 60s));
        KVTIER_RETURN_IF_ERROR(d.device->synchronize(*stream2, 60s));
        t0 = std::chrono::steady_clock::now();
      }
      for (std::uint32_t l = 0; l < a.layers; ++l) {
        KVTIER_RETURN_IF_ERROR(d.device->memcpy_async(pinned->data(), dev, layer_bytes, *stream));
        KVTIER_RETURN_IF_ERROR(d.device->memcpy_async(dev2, pinned2->data(), layer_bytes, *stream2));
      }
    }
    KVTIER_RETURN_IF_ERROR(d.device->synchronize(*stream, 60s));
    KVTIER_RETURN_IF_ERROR(d.device->synchronize(*stream2, 60s));
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    r.duplex = static_cast<double>(a.iters) * a.layers * layer_bytes / secs / 1e9;
  }
  for (bool to_host : {true, false}) {
    std::chrono::steady_clock::time_point t0;
    for (std::uint32_t it = 0; it <= a.iters; ++it) {
      if (it == 1) {
        KVTIER_RETURN_IF_ERROR(d.device->synchronize(*stream, 60s));
        t0 = std::chrono::steady_clock::now();
      }
      for (std::uint32_t l = 0; l < a.layers; ++l)
        KVTIER_RETURN_IF_ERROR(to_host ? d.device->memcpy_async(pinned->data(), dev, layer_bytes, *stream)
                                       : d.device->memcpy_async(dev, pinned->data(), layer_bytes, *stream));
    }
    KVTIER_RETURN_IF_ERROR(d.device->synchronize(*stream, 60s));
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    (to_host ? r.d2h : r.h2d) = static_cast<double>(a.iters) * a.layers * layer_bytes / secs / 1e9;
  }
  return r;
}

// The same block lists gathered inside one process: the decode's pool to a second pool, one launch per layer.
Result<GatherRates> run_gather(const PdArgs& a, DirectSide& d, const DirectPlan& p) {
  const KvLayout& layout = d.space.layout();
  const std::uint64_t bb = layout.block_bytes(0, 0);
  std::vector<Buffer> mem;
  std::vector<std::vector<void*>> bases(layout.num_layers());
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l) {
    KVTIER_ASSIGN_OR_RETURN(Buffer b, d.device->allocate_device(p.pool * bb));
    bases[l].push_back(b.data());
    mem.push_back(std::move(b));
  }
  KVTIER_ASSIGN_OR_RETURN(BlockSpace out, BlockSpace::layer_first(MemoryKind::kDevice, 0, layout, p.pool, bases));
  KVTIER_ASSIGN_OR_RETURN(Buffer ck, d.device->allocate_device(p.src.size() * 8));
  KVTIER_ASSIGN_OR_RETURN(auto stream, d.device->create_stream());
  std::vector<BlockId> src(p.dsts[0].begin(), p.dsts[0].end()), dst(p.src.begin(), p.src.end());
  GatherRates r;
  CopyEngineOptions wide = transport::lane_engine_options();
  wide.sm_ctas_d2d = static_cast<std::uint32_t>(std::max(1, d.device->multiprocessor_count()));
  r.all_sms_ctas = wide.sm_ctas_d2d;
  KVTIER_ASSIGN_OR_RETURN(auto wide_engine, CopyEngine::create(*d.device, wide));
  KVTIER_ASSIGN_OR_RETURN(Buffer landed_ck, d.device->allocate_device(p.src.size() * 8));
  std::vector<std::uint32_t> all_layers(a.layers);
  std::iota(all_layers.begin(), all_layers.end(), 0u);
  {
    std::chrono::steady_clock::time_point t0;
    for (std::uint32_t it = 0; it <= a.iters; ++it) {
      if (it == 1) {
        KVTIER_RETURN_IF_ERROR(d.device->synchronize(*stream, 60s));
        t0 = std::chrono::steady_clock::now();
      }
      CopyRequest req{&d.space, &out, src, dst, all_layers, kAllRoles, CopyStrategy::kSmKernel};
      req.checksums = reinterpret_cast<std::uint64_t*>(ck.data());
      req.landed_checksums = reinterpret_cast<std::uint64_t*>(landed_ck.data());
      KVTIER_RETURN_IF_ERROR(d.engine->copy(req, *stream).status());
    }
    KVTIER_RETURN_IF_ERROR(d.device->synchronize(*stream, 60s));
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    r.landed = static_cast<double>(a.iters) * a.layers * p.src.size() * bb / secs / 1e9;
  }
  for (int pass = 0; pass < 3; ++pass) {
    const bool checksummed = pass == 1;
    CopyEngine& engine = pass == 2 ? *wide_engine : *d.engine;
    std::chrono::steady_clock::time_point t0;
    for (std::uint32_t it = 0; it <= a.iters; ++it) {
      if (it == 1) {
        KVTIER_RETURN_IF_ERROR(d.device->synchronize(*stream, 60s));
        t0 = std::chrono::steady_clock::now();
      }
      for (std::uint32_t l = 0; l < a.layers; ++l) {
        const std::uint32_t layer[1] = {l};
        CopyRequest req{&d.space, &out, src, dst, layer, kAllRoles, CopyStrategy::kSmKernel};
        if (checksummed) req.checksums = reinterpret_cast<std::uint64_t*>(ck.data());
        KVTIER_RETURN_IF_ERROR(engine.copy(req, *stream).status());
      }
    }
    KVTIER_RETURN_IF_ERROR(d.device->synchronize(*stream, 60s));
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double gbps = static_cast<double>(a.iters) * a.layers * p.src.size() * bb / secs / 1e9;
    (pass == 0 ? r.plain : pass == 1 ? r.checksummed : r.all_sms) = gbps;
  }
  KVTIER_RETURN_IF_ERROR(d.engine->forget_stream(*stream));
  KVTIER_RETURN_IF_ERROR(wide_engine->forget_stream(*stream));
  return r;
}

int run_prefill_staged(const PdArgs& a, const KvLayout& layout, std::uint64_t n) {
  auto t = lane_transport({"bench-prefill", layout.fingerprint(), 1, 0}, a.lane);
  if (!t.ok()) return 5;
  auto side = make_device_side(a.backend, layout, n, std::byte{1}, a.host_alloc == "transport" ? t->get() : nullptr,
                               a.inflight);
  if (!side.ok()) {
    std::fprintf(stderr, "kvtier bench pd (prefill): %s\n", side.status().to_string().c_str());
    return 5;
  }
  transport::StagedOptions so;
  so.pd = g_pd_options;
  auto pre =
      transport::PdStagedPrefill::create(**t, *side->device, *side->engine, side->space, side->staging.space, so);
  if (!pre.ok()) return 5;
  return serve_prefill(a, **t, **pre, iota(n));
}

// ---- the raw transport rows (--memory raw): the same blocks and descriptors as the protocol's host rows, posted
// straight through the transport: per layer one transfer of every block (its notification names it), no
// checksums, no protocol messages, no leases. What the protocol is measured against.

// Registers one region per layer plane, in order (as the protocol's endpoints do).
Status register_planes(transport::Transport& t, const BlockSpace& space, std::uint64_t n) {
  for (std::uint32_t l = 0; l < space.layout().num_layers(); ++l) {
    KVTIER_RETURN_IF_ERROR(
        t.register_memory({MemoryKind::kPinnedHost, 0, space.block_ptr(l, 0, 0), space.layout().block_bytes(l, 0) * n})
            .status());
  }
  return Status::Ok();
}

// Layer l of every block (0..n), block by block.
void raw_layer_descs(std::uint32_t l, std::uint64_t n, std::uint64_t bb, std::vector<transport::LocalDesc>& ld,
                     std::vector<transport::RemoteDesc>& rd) {
  ld.clear();
  rd.clear();
  for (std::uint64_t b = 0; b < n; ++b) {
    ld.push_back({l, b * bb, bb});
    rd.push_back({l, b * bb, bb});
  }
}

// Waits for every transfer in `xfers` and releases it; the first failure.
Status finish_raw(transport::Transport& t, std::vector<transport::XferId>& xfers) {
  Status first;
  for (transport::XferId x : xfers) {
    auto st = t.wait(x, 60s);
    if (!st.ok()) return st.status();
    if (st->state != transport::XferState::kDone && first.ok()) first = st->error;
    // Quiescence follows completion closely: spin (yielding) rather than sleep, so the raw row pays no timer.
    for (const auto limit = std::chrono::steady_clock::now() + 60s;;) {
      auto q = t.poll(x);
      if (!q.ok()) return q.status();
      if (q->quiescent) break;
      if (std::chrono::steady_clock::now() > limit) return TimedOut("raw transfer not quiescent after 60 s");
      std::this_thread::yield();
    }
    t.release(x).ignore_error();
  }
  xfers.clear();
  return first;
}

// The prefill process's host blocks (layer l filled with 1 + l) and its lane's transport; the transport goes first
// (the caller's memory stays registered in it until then).
struct PrefillHost {
  Blocks blocks;
  std::unique_ptr<transport::Transport> t;
  std::uint64_t n = 0;
};
Result<PrefillHost> make_prefill_host(const PdArgs& a) {
  KVTIER_ASSIGN_OR_RETURN(KvLayout layout, KvLayout::uniform(a.layers, 1, a.block_bytes));
  PrefillHost h;
  h.n = blocks_for(a, a.block_bytes);
  KVTIER_ASSIGN_OR_RETURN(h.t, lane_transport({"bench-prefill", layout.fingerprint(), 1, 0}, a.lane));
  KVTIER_ASSIGN_OR_RETURN(h.blocks,
                          make_blocks(layout, h.n, std::byte{1}, a.host_alloc == "transport" ? h.t.get() : nullptr));
  return h;
}

// The prefill process of a raw row: in push, each "go <id>" from the decode makes it write every layer (one
// transfer per layer, its notification "w <id>"); in pull it only serves. Ends when the decode closes its pipe.
int run_prefill_raw(const PdArgs& a) {
  auto host = make_prefill_host(a);
  if (!host.ok() || !register_planes(*host->t, host->blocks.space, host->n).ok()) return 5;
  auto* t = &host->t;
  const std::uint64_t n = host->n;
  auto blob = (*t)->export_metadata();
  if (!blob.ok() || !send_blob(a.out_fd, *blob)) return 5;
  auto peer_blob = recv_blob(a.in_fd);
  if (!peer_blob.ok()) return 5;
  auto peer = (*t)->load_peer(*peer_blob);
  if (!peer.ok()) return 3;
  std::vector<transport::LocalDesc> ld;
  std::vector<transport::RemoteDesc> rd;
  std::vector<transport::XferId> xfers;  // writes in flight (of any number of transfers)
  for (;;) {
    pollfd p{a.in_fd, POLLIN, 0};
    if (::poll(&p, 1, 0) > 0) break;  // the decode closed its end: the row is over
    auto notes = (*t)->wait_notifications(xfers.empty() ? 10ms : 0ms);
    for (const auto& note : notes.ok() ? *notes : std::vector<transport::Notification>{}) {
      if (note.message.rfind("go ", 0) != 0) continue;
      for (std::uint32_t l = 0; l < a.layers; ++l) {
        raw_layer_descs(l, n, a.block_bytes, ld, rd);
        auto x = (*t)->post(transport::XferOp::kWrite, *peer, ld, rd, "w " + note.message.substr(3));
        if (!x.ok()) return 4;
        xfers.push_back(*x);
      }
    }
    bool failed = false;
    std::erase_if(xfers, [&](transport::XferId x) {
      auto st = (*t)->poll(x);
      if (!st.ok() || !st->quiescent) return false;
      failed = failed || st->state != transport::XferState::kDone;
      (*t)->release(x).ignore_error();
      return true;
    });
    if (failed) return 4;
  }
  return 0;
}

int run_prefill(const PdArgs& a) {
  alarm(300);
  if (a.memory == "raw") return run_prefill_raw(a);
  if (a.lane == "direct" || a.lane == "ring") return run_prefill_direct(a);
  if (a.memory == "device") {
    auto layout = KvLayout::uniform(a.layers, 1, a.block_bytes);
    if (!layout.ok()) return 5;
    return run_prefill_staged(a, *layout, blocks_for(a, a.block_bytes));
  }
  auto host = make_prefill_host(a);
  if (!host.ok()) return 5;
  auto pre = transport::PdPrefill::create(*host->t, host->blocks.space, host_lane_options(a.lane));
  if (!pre.ok()) return 5;
  return serve_prefill(a, *host->t, **pre, iota(host->n));
}

// Layer l of every host block holds fill + l (what the prefill's blocks hold).
Status check_host_bytes(const BlockSpace& space, std::uint64_t n, std::byte fill) {
  for (std::uint32_t l = 0; l < space.layout().num_layers(); ++l) {
    const auto* p = reinterpret_cast<const std::uint8_t*>(space.block_ptr(l, 0, 0));
    const std::uint8_t want = static_cast<std::uint8_t>(static_cast<int>(fill) + static_cast<int>(l));
    for (std::uint64_t i = 0; i < space.layout().block_bytes(l, 0) * n; ++i)
      if (p[i] != want) return DataLoss(fmt::format("layer {} byte {}: {:#x}, expected {:#x}", l, i, p[i], want));
  }
  return Status::Ok();
}

// A decode transfer's end: every block loaded, then forgotten.
Status finish_decode(const Result<transport::DecodeStatus>& st, std::size_t blocks,
                     const std::function<Status()>& forget) {
  if (!st.ok()) return st.status();
  if (st->leading_loaded_blocks() != blocks) return st->error.ok() ? DataLoss("blocks not loaded") : Status(st->error);
  return forget();
}

// The direct lane with both endpoints in this process (loopback transports hand out each other's pools; one
// CUDA context): the protocol and the kernels without the second process. A diagnostic beside `direct`.
Result<double> run_direct_in_process(const PdArgs& a, PdMode mode, std::uint64_t block_bytes) {
  g_last_phases.clear();
  KVTIER_ASSIGN_OR_RETURN(KvLayout layout, KvLayout::uniform(a.layers, 1, block_bytes));
  const DirectPlan plan = direct_plan(a, block_bytes, plan_lists(a));
  KVTIER_ASSIGN_OR_RETURN(DirectSide pre_side, make_direct_side(layout, plan.pool, true, a.backend));
  KVTIER_ASSIGN_OR_RETURN(DirectSide dec_side, make_direct_side(layout, plan.pool, false, a.backend));
  static int seq = 0;
  ++seq;
  KVTIER_ASSIGN_OR_RETURN(auto pre_t, transport::create_loopback_transport(
                                          {fmt::format("bench-inproc-prefill{}", seq), layout.fingerprint(), 1, 0}));
  KVTIER_ASSIGN_OR_RETURN(auto dec_t, transport::create_loopback_transport(
                                          {fmt::format("bench-inproc-decode{}", seq), layout.fingerprint(), 1, 0}));
  transport::PdOptions po = g_pd_options, dopt = g_pd_options;
  po.engine = pre_side.engine.get();
  dopt.engine = dec_side.engine.get();
  set_lane_verify(a.lane_verify, po);
  set_lane_verify(a.lane_verify, dopt);
  KVTIER_ASSIGN_OR_RETURN(auto pre, transport::PdPrefill::create(*pre_t, pre_side.space, po));
  KVTIER_ASSIGN_OR_RETURN(auto dec, transport::PdDecode::create(*dec_t, dec_side.space, dopt));
  KVTIER_ASSIGN_OR_RETURN(auto b1, dec_t->export_metadata());
  KVTIER_ASSIGN_OR_RETURN(auto b2, pre_t->export_metadata());
  KVTIER_ASSIGN_OR_RETURN(transport::PeerId to_dec, pre_t->load_peer(b1));
  KVTIER_ASSIGN_OR_RETURN(transport::PeerId to_pre, dec_t->load_peer(b2));
  Status prefill_status;
  std::mutex steps_mu;
  std::map<std::uint64_t, TransferSteps> steps;
  std::thread prefill([&] {
    prefill_status = run_transfers(
        a.iters, plan_lists(a),
        [&](std::uint64_t id) {
          KVTIER_RETURN_IF_ERROR(pre->begin(to_dec, id, plan.src));
          return pre->layers_ready(id, all_layers(a));
        },
        [&](std::uint64_t id) {
          auto st = pre->wait(id, 60s);
          if (!st.ok() || !st->done) return st.ok() ? st->error : st.status();
          {
            std::lock_guard lock(steps_mu);
            steps[id].prefill = st->times;
          }
          return pre->forget(id);
        });
  });
  std::chrono::steady_clock::time_point t0;
  const bool until_final = a.decode_wait == "final";
  DeferredForget deferred([&](auto id) { return dec->wait(id, 60s, true); }, [&](auto id) { return dec->forget(id); });
  Status s = run_transfers(
      a.iters, a.inflight, [&](std::uint64_t id) { return dec->start(to_pre, id, mode, plan.dst_of(id)); },
      [&](std::uint64_t id) {
        auto st = dec->wait(id, 60s, !until_final);
        if (st.ok()) {
          std::lock_guard lock(steps_mu);
          steps[id].decode = st->times;
          steps[id].waited = std::chrono::steady_clock::now();
        }
        return finish_decode(st, plan.src.size(), [&] { return until_final ? deferred.defer(id) : dec->forget(id); });
      },
      [&] { t0 = std::chrono::steady_clock::now(); }, &g_last_latencies);
  if (s.ok()) s = deferred.drain();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  prefill.join();
  steps.erase(1);  // the warm-up
  g_last_phases = summarize_steps(steps, mode);
  KVTIER_RETURN_IF_ERROR(s);
  KVTIER_RETURN_IF_ERROR(prefill_status.with_context("prefill"));
  dec.reset();
  pre.reset();
  KVTIER_RETURN_IF_ERROR(check_direct_bytes(dec_side, plan));
  KVTIER_ASSIGN_OR_RETURN(g_last_gather, run_gather(a, dec_side, plan));
  return static_cast<double>(a.iters) * a.layers * plan.src.size() * block_bytes / secs / 1e9;
}

// One kvtier row: GB/s of the protocol, or an error.
// The decode side of either memory: start a transfer, wait until it is final and reclaimable, forget it.
struct DecodeOps {
  std::function<Status(transport::PeerId, transport::TransferId, PdMode, std::vector<BlockId>)> start;
  std::function<Result<transport::DecodeStatus>(transport::TransferId)> wait;
  std::function<Status(transport::TransferId)> forget;
};

Result<double> run_decode(const PdArgs& a, const std::string& lane, PdMode mode, std::uint64_t block_bytes,
                          const std::string& memory) {
  if (lane == "direct-inproc") {
    if (memory != "device") return NotSupported("the direct lane moves device memory only (--memory device)");
    return run_direct_in_process(a, mode, block_bytes);
  }
  KVTIER_ASSIGN_OR_RETURN(KvLayout layout, KvLayout::uniform(a.layers, 1, block_bytes));
  const std::uint64_t n = blocks_for(a, block_bytes);
  const bool ring = lane == "ring";
  const bool direct = lane == "direct" || ring;
  const bool staged = memory == "device" && !direct;
  const bool raw = memory == "raw";
  if (raw && direct) return NotSupported(fmt::format("raw rows are for transport lanes, not '{}'", lane));
  if (direct && memory != "device")
    return NotSupported(fmt::format("the {} lane moves device memory only (--memory device)", lane));
  std::optional<DirectSide> direct_side;
  DirectPlan plan;
  if (direct) {
    plan = direct_plan(a, block_bytes, plan_lists(a));
    KVTIER_ASSIGN_OR_RETURN(direct_side, make_direct_side(layout, plan.pool, false));
  }
  // Declaration order is destruction order in reverse: endpoints, then the transport (and the memory it
  // allocated), then the caller's memory.
  Blocks blocks;
  KVTIER_ASSIGN_OR_RETURN(auto t, direct ? direct_transport({"bench-decode", layout.fingerprint(), 1, 0})
                                         : lane_transport({"bench-decode", layout.fingerprint(), 1, 0}, lane));
  std::optional<DeviceSide> side;  // its staging may be the transport's memory
  if (staged) {
    transport::Transport* from = a.host_alloc == "transport" ? t.get() : nullptr;
    KVTIER_ASSIGN_OR_RETURN(side, make_device_side(a.backend, layout, n, std::byte{0x40}, from, a.inflight));
  }
  // Host rows through the protocol: a stretch of n blocks per transfer in flight (a destination block belongs to
  // one transfer until it is forgotten); the raw rows move the first n blocks, which the protocol does not govern.
  const std::uint64_t host_lists = !staged && !direct && !raw ? std::max<std::uint32_t>(1, a.inflight) : 1;
  if (!staged && !direct) {
    transport::Transport* from = a.host_alloc == "transport" ? t.get() : nullptr;
    KVTIER_ASSIGN_OR_RETURN(blocks, make_blocks(layout, n * host_lists, std::byte{0x40}, from));
  }
  // Transfers open at once have consecutive ids (run_transfers), so their stretches differ.
  auto host_dst = [&](std::uint64_t id) {
    std::vector<BlockId> ids = iota(n);
    for (BlockId& b : ids) b += static_cast<BlockId>(((id - 1) % host_lists) * n);
    return ids;
  };
  std::unique_ptr<transport::PdDecode> plain;
  std::unique_ptr<transport::PdStagedDecode> sdec;
  std::map<transport::TransferId, std::vector<transport::XferId>> raw_xfers;  // raw pull rows: reads per transfer
  std::map<transport::TransferId, std::uint32_t> raw_writes;  // raw push rows: layers written, per transfer
  DecodeOps dec;
  DeferredForget deferred([&](auto id) { return plain->wait(id, 60s, true); },
                          [&](auto id) { return plain->forget(id); });  // direct and ring lanes, --decode-wait final
  if (direct) {
    transport::PdOptions o = g_pd_options;
    o.engine = direct_side->engine.get();
    set_lane_verify(a.lane_verify, o);
    if (ring) set_ring_options(a, n * block_bytes, o);
    KVTIER_ASSIGN_OR_RETURN(plain, transport::PdDecode::create(*t, direct_side->space, o));
    dec = {[&](auto p, auto id, auto m, auto) { return plain->start(p, id, m, plan.dst_of(id)); },
           [&](auto id) { return plain->wait(id, 60s, a.decode_wait != "final"); },
           [&](auto id) { return a.decode_wait == "final" ? deferred.defer(id) : plain->forget(id); }};
  } else if (staged) {
    transport::StagedOptions so;
    so.pd = g_pd_options;
    KVTIER_ASSIGN_OR_RETURN(sdec, transport::PdStagedDecode::create(*t, *side->device, *side->engine, side->space,
                                                                    side->staging.space, so));
    dec = {[&](auto p, auto id, auto m, auto b) { return sdec->start(p, id, m, std::move(b)); },
           [&](auto id) { return sdec->wait(id, 60s, true); }, [&](auto id) { return sdec->forget(id); }};
  } else if (raw) {
    KVTIER_RETURN_IF_ERROR(register_planes(*t, blocks.space, n));
    dec = {[&, bb = block_bytes](transport::PeerId p, transport::TransferId id, PdMode m, auto) -> Status {
             if (m == PdMode::kPush) return t->send_notification(p, fmt::format("go {}", id));
             std::vector<transport::LocalDesc> ld;
             std::vector<transport::RemoteDesc> rd;
             for (std::uint32_t l = 0; l < a.layers; ++l) {
               raw_layer_descs(l, n, bb, ld, rd);
               KVTIER_ASSIGN_OR_RETURN(auto x, t->post(transport::XferOp::kRead, p, ld, rd, ""));
               raw_xfers[id].push_back(x);
             }
             return Status::Ok();
           },
           [&](transport::TransferId id) -> Result<transport::DecodeStatus> {
             if (mode == PdMode::kPull) {
               KVTIER_RETURN_IF_ERROR(finish_raw(*t, raw_xfers[id]));
               raw_xfers.erase(id);
             } else {
               // Every layer's write notification (sent once its bytes are visible here); other transfers'
               // notifications are counted for their own wait.
               while (raw_writes[id] < a.layers) {
                 KVTIER_ASSIGN_OR_RETURN(auto notes, t->wait_notifications(60s));
                 for (const auto& note : notes) {
                   if (note.kind != transport::NotifKind::kMessage) return DataLoss("a raw write failed");
                   transport::TransferId of = 0;
                   if (std::sscanf(note.message.c_str(), "w %llu", reinterpret_cast<unsigned long long*>(&of)) == 1)
                     ++raw_writes[of];
                 }
               }
               raw_writes.erase(id);
             }
             transport::DecodeStatus st;
             st.final = st.reclaimable = true;
             st.block_loaded.assign(n, true);
             return st;
           },
           [](transport::TransferId) { return Status::Ok(); }};
  } else {
    KVTIER_ASSIGN_OR_RETURN(plain, transport::PdDecode::create(*t, blocks.space, host_lane_options(lane)));
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
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) return Internal("fork");
  if (pid == 0) {
    // The prefill dies with the bench: killed (a timeout, Ctrl-C twice) the bench left it running on its own,
    // holding its pool (4 GiB at --layer-bytes 4294967296) until its transfers timed out. Kept across execve; the
    // check after it covers a parent that died before it took effect.
    (void)prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    close(down[1]);
    close(up[0]);
    // The prefill on another GPU (the ring lane's case: two GPUs whose pools are not mapped into each other).
    if (a.prefill_gpu >= 0) setenv("CUDA_VISIBLE_DEVICES", std::to_string(a.prefill_gpu).c_str(), 1);
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
                                     backend,
                                     "--pool-bytes",
                                     std::to_string(a.pool_bytes),
                                     "--lane-verify-one",
                                     a.lane_verify,
                                     "--inflight-one",
                                     std::to_string(a.inflight),
                                     "--decode-wait",
                                     a.decode_wait,
                                     "--ring-slots",
                                     std::to_string(a.ring_slots),
                                     "--ring-slot-bytes",
                                     std::to_string(a.ring_slot_bytes),
                                     "--ring-copy-one",
                                     a.ring_copy,
                                     "--host-alloc",
                                     a.host_alloc};
    args.push_back("--busy-wait-us");
    args.push_back(std::to_string(a.busy_wait_us));
    for (const std::string& kv : a.lane_engine) {
      args.push_back("--lane-engine");
      args.push_back(kv);
    }
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
  Status s = run_transfers(
      a.iters, a.inflight, [&](std::uint64_t id) { return dec.start(*peer, id, mode, host_dst(id)); },
      [&](std::uint64_t id) { return finish_decode(dec.wait(id), n, [&] { return dec.forget(id); }); },
      [&] { t0 = std::chrono::steady_clock::now(); }, &g_last_latencies);
  if (s.ok()) s = deferred.drain();
  if (!s.ok()) return finish(s);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double bytes = static_cast<double>(a.iters) * a.layers * n * block_bytes;
  KVTIER_RETURN_IF_ERROR(finish(Status::Ok()));
  if (staged) KVTIER_RETURN_IF_ERROR(check_device_bytes(*side, std::byte{1}));
  if (raw) KVTIER_RETURN_IF_ERROR(check_host_bytes(blocks.space, n, std::byte{1}));
  if (direct) {
    KVTIER_RETURN_IF_ERROR(check_direct_bytes(*direct_side, plan));
    plain.reset();
    if (ring) {
      KVTIER_ASSIGN_OR_RETURN(g_last_ceiling, run_pcie_ceiling(a, *direct_side, n * block_bytes));
    } else {
      KVTIER_ASSIGN_OR_RETURN(g_last_gather, run_gather(a, *direct_side, plan));
    }
  }
  return bytes / secs / 1e9;
}

// ucx_perftest over the same lane: a server and a client process; GB/s of the client's "Final:" line.
// `block_bytes` is the message size; `bytes_per_run` the bytes the run moves (at least 200 messages).
Result<double> run_perftest(const std::string& lane, PdMode mode, std::uint64_t block_bytes, int port,
                            std::uint64_t bytes_per_run = 256ull << 20, std::uint64_t min_iters = 200) {
  if (lane == "ipc") return NotSupported("ucx_perftest has no ipc lane");
  const transport::UcxOptions o = lane_options(lane);
  std::string env = "UCX_TLS=" + o.tls + (o.net_devices.empty() ? "" : " UCX_NET_DEVICES=" + o.net_devices);
  const std::string test = mode == PdMode::kPush ? "ucp_put_bw" : "ucp_get";
  const std::uint64_t iters = std::max<std::uint64_t>(min_iters, bytes_per_run / block_bytes);
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

// The tcp rows' reference: `bytes` through one plain loopback TCP connection (a sender and a receiver thread,
// 1 MiB send() and recv() calls), GB/s. Each side walks a buffer of `footprint` bytes (touched before the clock
// starts), so that a stream compared with a transfer reads and writes as much distinct memory as the transfer does
// (a transfer's blocks are not in any cache; a 1 MiB buffer reused is, and spares the kernel's copies the DRAM
// reads). A footprint of 1 MiB or less reuses one buffer.
Result<double> run_socket_stream(std::uint64_t bytes, std::uint64_t footprint) {
  const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener < 0) return Unavailable(fmt::format("socket: {}", std::strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || listen(listener, 1) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(listener);
    return Unavailable(fmt::format("loopback listener: {}", std::strerror(errno)));
  }
  constexpr std::size_t kChunk = 1 << 20;
  const std::size_t span = std::max<std::size_t>(kChunk, footprint / kChunk * kChunk);
  std::atomic<bool> send_failed{false};
  std::vector<char> out(span, 'k');  // both buffers touched here, before the clock starts
  std::thread sender([&] {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      send_failed = true;
    } else {
      for (std::uint64_t sent = 0; sent < bytes;) {
        const std::size_t at = sent % span;
        const ssize_t n =
            send(fd, out.data() + at, std::min<std::uint64_t>(std::min(kChunk, span - at), bytes - sent), MSG_NOSIGNAL);
        if (n <= 0) {
          send_failed = true;
          break;
        }
        sent += static_cast<std::uint64_t>(n);
      }
    }
    if (fd >= 0) close(fd);
  });
  pollfd p{listener, POLLIN, 0};
  const int conn = ::poll(&p, 1, 10000) > 0 ? accept4(listener, nullptr, nullptr, SOCK_CLOEXEC) : -1;
  close(listener);
  std::vector<char> in(span, 'd');
  std::uint64_t got = 0;
  const auto t0 = std::chrono::steady_clock::now();
  while (conn >= 0 && got < bytes) {
    const std::size_t at = got % span;
    const ssize_t n = recv(conn, in.data() + at, std::min(kChunk, span - at), 0);
    if (n <= 0) break;
    got += static_cast<std::uint64_t>(n);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (conn >= 0) close(conn);
  sender.join();
  if (got < bytes || send_failed) return Unavailable("loopback stream ended early");
  return static_cast<double>(bytes) / secs / 1e9;
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
        const bool ring_lane = lane == "ring";
        const bool direct_lane = lane.rfind("direct", 0) == 0 || ring_lane;
        Result<double> p = a.no_perftest || direct_lane ? Result<double>(NotSupported("skipped"))
                                                        : run_perftest(lane, mode, bs, port++);
        // The same lane with one message per transfer of the rows (every layer's blocks: the bytes a transfer
        // touches, so that neither side runs from its caches, as a 16 KiB message reused 16k times does).
        const std::uint64_t transfer_bytes = std::uint64_t{a.layers} * blocks_for(a, bs) * bs;
        Result<double> pt = a.no_perftest || direct_lane
                                ? Result<double>(NotSupported("skipped"))
                                : run_perftest(lane, mode, transfer_bytes, port++, 2ull << 30, 10);
        // The tcp lane's other reference: the same bytes through one plain loopback socket stream, out of and into
        // as much memory as a transfer touches; and, for comparison with earlier tables, out of one hot 1 MiB buffer.
        const Result<double> socket_gbps =
            tcp_lane(lane) ? run_socket_stream(std::uint64_t{a.iters} * transfer_bytes, transfer_bytes)
                           : Result<double>(NotSupported(""));
        std::optional<double> socket_hot_gbps;
        if (tcp_lane(lane))
          if (Result<double> hot = run_socket_stream(std::uint64_t{a.iters} * transfer_bytes, 0); hot.ok())
            socket_hot_gbps = *hot;
        std::optional<double> host_gbps;
        std::map<std::uint32_t, double> raw_by_inflight;  // raw rows of this block size, by transfers in flight
        // The direct lanes get a row per verifying side and transfers in flight, the ring a row per copy strategy
        // and transfers in flight; the others one row.
        std::vector<std::pair<std::string, std::uint32_t>> variants;
        for (const auto& v : ring_lane     ? a.ring_copies
                             : direct_lane ? a.lane_verifies
                                           : std::vector<std::string>{a.lane_verify})
          for (std::uint32_t k : a.inflights) variants.emplace_back(v, k);
        for (const auto& memory : a.memories)
          for (const auto& [verify, inflight] : variants) {
            PdArgs row = a;
            if (ring_lane)
              row.ring_copy = verify;
            else
              row.lane_verify = verify;
            row.inflight = inflight;
            auto g = run_decode(row, lane, mode, bs, memory);
            if (!g.ok()) {
              std::fprintf(stderr, "kvtier bench pd: %s %s %s %llu (%s %s, %u in flight): %s\n", lane.c_str(),
                           m.c_str(), memory.c_str(), static_cast<unsigned long long>(bs),
                           ring_lane ? "copy" : "verify", verify.c_str(), inflight, g.status().to_string().c_str());
              rc = 1;
              continue;
            }
            if (memory == "host") host_gbps = *g;
            if (memory == "raw") raw_by_inflight[inflight] = *g;
            // Flags and plain doubles, not std::optional<double>: GCC 12 at -O3 reports those as maybe used
            // uninitialized (a false -Wmaybe-uninitialized).
            const bool has_raw = raw_by_inflight.count(inflight) > 0;
            const double raw_gbps = has_raw ? raw_by_inflight[inflight] : 0.0;
            const double pg = p.ok() ? *p : 0.0;
            const double ratio = pg > 0 ? *g / pg : 0.0;
            const bool has_to_host = memory != "host" && host_gbps && *host_gbps > 0;
            const double to_host = has_to_host ? *g / *host_gbps : 0.0;
            if (a.json) {
              nlohmann::json j;
              j["bench"] = "pd";
              j["mode"] = m;
              j["lane"] = lane;
              j["memory"] = memory;
              j["block_bytes"] = bs;
              if (!direct_lane) {
                j["host_alloc"] = a.host_alloc;
                j["inflight"] = inflight;
              }
              j["blocks"] = blocks_for(a, bs);
              j["layers"] = a.layers;
              j["iters"] = a.iters;
              j["gbps"] = *g;
              j["ucx_perftest_gbps"] = p.ok() ? nlohmann::json(pg) : nlohmann::json(nullptr);
              j["ratio"] = p.ok() ? nlohmann::json(ratio) : nlohmann::json(nullptr);
              if (socket_gbps.ok() && memory != "device") {
                j["socket_stream_gbps"] = *socket_gbps;
                if (socket_hot_gbps) j["socket_stream_hot_buffer_gbps"] = *socket_hot_gbps;
                j["ratio_to_socket_stream"] = *socket_gbps > 0 ? *g / *socket_gbps : 0.0;
              }
              if (pt.ok()) {
                j["ucx_perftest_transfer_gbps"] = *pt;
                j["ratio_to_perftest_transfer"] = *pt > 0 ? *g / *pt : 0.0;
              }
              if (ring_lane) {
                const double ceiling = std::min(g_last_ceiling.d2h, g_last_ceiling.h2d);
                j["ring_copy"] = verify;
                j["ring_slots"] = a.ring_slots;
                j["ring_slot_bytes"] = a.ring_slot_bytes != 0 ? a.ring_slot_bytes : blocks_for(a, bs) * bs;
                j["prefill_gpu"] = a.prefill_gpu >= 0 ? a.prefill_gpu : 0;
                j["inflight"] = inflight;
                j["decode_wait"] = a.decode_wait;
                j["pool_blocks"] = direct_plan(row, bs, plan_lists(row)).pool;
                j["ceiling_d2h_gbps"] = g_last_ceiling.d2h;
                j["ceiling_h2d_gbps"] = g_last_ceiling.h2d;
                j["ratio_to_ceiling"] = ceiling > 0 ? *g / ceiling : 0.0;
                j["ceiling_duplex_gbps"] = g_last_ceiling.duplex;
                j["ratio_to_duplex_ceiling"] = g_last_ceiling.duplex > 0 ? *g / g_last_ceiling.duplex : 0.0;
                j["bytes_checked"] = true;
              } else if (direct_lane) {
                j["lane_verify"] = verify;
                j["inflight"] = inflight;
                j["decode_wait"] = a.decode_wait;
                j["pool_blocks"] = direct_plan(row, bs, plan_lists(row)).pool;
                j["gather_gbps"] = g_last_gather.plain;
                j["gather_checksummed_gbps"] = g_last_gather.checksummed;
                j["gather_all_sms_gbps"] = g_last_gather.all_sms;
                j["gather_all_sms_ctas"] = g_last_gather.all_sms_ctas;
                j["ratio_to_gather_all_sms"] = g_last_gather.all_sms > 0 ? *g / g_last_gather.all_sms : 0.0;
                j["ratio_to_gather"] = g_last_gather.plain > 0 ? *g / g_last_gather.plain : 0.0;
                j["gather_landed_gbps"] = g_last_gather.landed;
                if (lane == "direct-inproc" && !g_last_phases.empty()) j["steps_us_p50"] = g_last_phases;
                // One transfer's end-to-end time on the decode (start to done), against the time the lane's own
                // kernel needs for its bytes: the difference is what the protocol adds per transfer.
                j["transfer_us_p50"] = quantile(g_last_latencies, 0.5);
                j["transfer_us_p90"] = quantile(g_last_latencies, 0.9);
                j["landed_kernel_us"] = g_last_gather.landed > 0
                                            ? static_cast<double>(std::uint64_t{a.layers} * blocks_for(a, bs) * bs) /
                                                  g_last_gather.landed / 1e3
                                            : 0.0;
                j["ratio_to_gather_landed"] = g_last_gather.landed > 0 ? *g / g_last_gather.landed : 0.0;
                if (!a.lane_engine.empty()) j["lane_engine"] = a.lane_engine;
                j["busy_wait_us"] = a.busy_wait_us;
                j["bytes_checked"] = true;
              }
              if (memory == "host" && has_raw) {
                j["raw_gbps"] = raw_gbps;
                j["ratio_to_raw"] = raw_gbps > 0 ? *g / raw_gbps : 0.0;
              }
              if (memory == "device") {
                j["backend"] = a.backend == "auto" ? (cuda_device_count() > 0 ? "cuda" : "host") : a.backend;
                j["host_gbps"] = host_gbps ? nlohmann::json(*host_gbps) : nlohmann::json(nullptr);
                j["ratio_to_host"] = has_to_host ? nlohmann::json(to_host) : nlohmann::json(nullptr);
              }
              if (!p.ok()) j["ucx_perftest_error"] = p.status().to_string();
              std::printf("%s\n", j.dump().c_str());
            } else {
              std::string th = has_to_host ? fmt::format("{:.2f}", to_host) : "-";
              if (memory != "device") {
                th = pt.ok() ? fmt::format("perftest/transfer {:.2f} ({:.2f})", *pt, *g / std::max(1e-9, *pt)) : "";
                if (memory == "host" && has_raw)
                  th += fmt::format(" raw {:.2f} ({:.2f})", raw_gbps, *g / std::max(1e-9, raw_gbps));
                if (socket_gbps.ok())
                  th += fmt::format(" socket {:.2f} ({:.2f})", *socket_gbps, *g / std::max(1e-9, *socket_gbps));
                if (socket_hot_gbps)
                  th += fmt::format(" hot-buffer socket {:.2f} ({:.2f})", *socket_hot_gbps,
                                    *g / std::max(1e-9, *socket_hot_gbps));
                if (inflight > 1) th += fmt::format(" x{}", inflight);
              }
              if (ring_lane)
                th = fmt::format("copy {} x{} d2h {:.1f} h2d {:.1f} duplex {:.1f} ratio {:.2f} ({:.2f} of duplex)",
                                 verify, inflight, g_last_ceiling.d2h, g_last_ceiling.h2d, g_last_ceiling.duplex,
                                 *g / std::max(1e-9, std::min(g_last_ceiling.d2h, g_last_ceiling.h2d)),
                                 *g / std::max(1e-9, g_last_ceiling.duplex));
              else if (direct_lane)
                th = fmt::format(
                    "verify {} x{} gather {:.1f} ({:.1f} ck, {:.1f} all SMs, {:.1f} landed) ratio {:.2f} ({:.2f}, "
                    "{:.2f} of landed)",
                    verify, inflight, g_last_gather.plain, g_last_gather.checksummed, g_last_gather.all_sms,
                    g_last_gather.landed, g_last_gather.plain > 0 ? *g / g_last_gather.plain : 0.0,
                    g_last_gather.all_sms > 0 ? *g / g_last_gather.all_sms : 0.0,
                    g_last_gather.landed > 0 ? *g / g_last_gather.landed : 0.0);
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
  cmd->add_option("--lanes", a->lanes,
                  "lanes: tcp (UCX, 127.0.0.1; its active-message data path), tcp-rma (the same with UCX's emulated "
                  "RMA), shm (UCX), shm-direct (UCX shared memory, the host direct lane: the "
                  "moving side copies and checksums through UCX's mapping of the peer's pool), ipc (kvtier's same-host "
                  "backend), direct (the device lane: "
                  "CUDA IPC, copy kernels, --memory device), direct-inproc (the same with both endpoints in this "
                  "process: a diagnostic), ring (the ring lane through the decode's shared pinned ring, forced)")
      ->delimiter(',');
  cmd->add_option("--ring-slots", a->ring_slots, "ring lane: slots of the ring");
  cmd->add_option("--ring-slot-bytes", a->ring_slot_bytes, "ring lane: bytes of a slot (0: one layer of a transfer)");
  cmd->add_option("--ring-copy", a->ring_copies, "ring lane: copy strategies (a row each), e.g. auto,sm_kernel")
      ->delimiter(',');
  cmd->add_option("--prefill-gpu", a->prefill_gpu,
                  "ring lane: run the prefill process on this GPU (its CUDA_VISIBLE_DEVICES; the decode stays on GPU "
                  "0 of this process), e.g. 1 on a two-GPU machine");
  cmd->add_option("--pool-bytes", a->pool_bytes, "direct lane: bytes of the pool per side the blocks are taken from");
  cmd->add_option("--lane-verify", a->lane_verifies,
                  "direct lanes: which side makes the second checksum pass, mover (inside its copy kernel), "
                  "mover-pass (a separate read-back pass) and/or receiver (a row each)")
      ->delimiter(',');
  cmd->add_option("--inflight", a->inflights, "transfers in flight at once (a row each), e.g. 1,4")->delimiter(',');
  cmd->add_option("--decode-wait", a->decode_wait,
                  "direct and ring lanes: when the decode counts a transfer done, reclaimable (its blocks loaded and "
                  "the prefill's writes proven over, then forgotten) or final (loaded and verified, what a decode "
                  "step waits for; forgotten once reclaimable, after the next one is final)")
      ->check(CLI::IsMember({"reclaimable", "final"}));
  cmd->add_option("--modes", a->modes, "push, pull")->delimiter(',');
  cmd->add_option("--memory", a->memories,
                  "host (pinned host blocks), device (device blocks through the staged path), raw (host blocks moved "
                  "by the transport alone: the same descriptors, a transfer per layer, no checksums or protocol; "
                  "list it before host for the host rows' ratio_to_raw); e.g. raw,host,device")
      ->delimiter(',');
  cmd->add_option("--backend", a->backend, "device memory: auto | cuda | host (auto: cuda when a GPU is visible)");
  cmd->add_option("--block-sizes", a->block_sizes, "bytes per block (one role per layer)")
      ->delimiter(',')
      ->check(kAtLeastOne);
  cmd->add_option("--layers", a->layers, "layers per transfer")
      ->check(kAtLeastOne)
      ->check(CLI::Range(std::uint32_t{1}, KvLayout::kMaxLayers));
  cmd->add_option("--layer-bytes", a->layer_bytes, "payload of one layer (sets the block count, >= 4 blocks)");
  cmd->add_option("--iters", a->iters, "measured transfers (after one warm-up)")->check(kAtLeastOne);
  cmd->add_flag("--json", a->json, "one JSON object per line");
  cmd->add_option("--host-alloc", a->host_alloc,
                  "where host blocks live: transport (Transport::allocate_host: UCX allocates them, so its "
                  "shared-memory lanes reach them directly) or caller (plain memory, registered as it is)")
      ->check(CLI::IsMember({"transport", "caller"}));
  cmd->add_flag("--no-perftest", a->no_perftest, "skip ucx_perftest");
  cmd->add_option("--lane-engine", a->lane_engine,
                  "KEY=VALUE settings of the lanes' copy engine over lane_engine_options() (knob names of "
                  "copy_config.h without a prefix, e.g. sm_landed_item_bytes=8192); repeat for several");
  cmd->add_option("--busy-wait-us", a->busy_wait_us,
                  "PdOptions::busy_wait of both endpoints: microseconds between the progress thread's looks while "
                  "a transfer needs polling (0: yield, no sleep)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1000}));
  auto* role = cmd->add_option("--role", a->role, "internal: the prefill process");
  role->group("");
  cmd->add_option("--lane", a->lane)->group("");
  cmd->add_option("--mode", a->mode)->group("");
  cmd->add_option("--block-bytes", a->block_bytes)->group("");
  cmd->add_option("--memory-one", a->memory)->group("");
  cmd->add_option("--in-fd", a->in_fd)->group("");
  cmd->add_option("--lane-verify-one", a->lane_verify)->group("");
  cmd->add_option("--inflight-one", a->inflight)->group("");
  cmd->add_option("--ring-copy-one", a->ring_copy)->group("");
  cmd->add_option("--out-fd", a->out_fd)->group("");
  return [cmd, a]() -> int {
    if (!cmd->parsed()) return -1;
    for (const auto& l : a->lanes)
      if (!tcp_lane(l) && l != "shm" && l != "shm-direct" && l != "ipc" && l != "direct" && l != "direct-inproc" &&
          l != "ring") {
        std::fprintf(stderr,
                     "kvtier bench pd: lane '%s' is not tcp, tcp-rma, shm, shm-direct, ipc, direct, direct-inproc or "
                     "ring\n",
                     l.c_str());
        return 2;
      }
    for (const auto& l : a->lanes) {
      if (l != "shm-direct") continue;
      const bool device_memory = std::find(a->memories.begin(), a->memories.end(), "device") != a->memories.end();
      if (device_memory || a->host_alloc != "transport") {
        std::fprintf(stderr,
                     "kvtier bench pd: lane shm-direct moves host blocks the transport allocated: --memory raw,host "
                     "and --host-alloc transport\n");
        return 2;
      }
    }
    for (const auto& l : a->lanes)
      // direct-inproc runs on the host backend too (both endpoints in this process: the protocol's own CPU cost,
      // with copies the host backend's threads do).
      if (l != "direct-inproc" && (l.rfind("direct", 0) == 0 || l == "ring") &&
          (cuda_device_count() == 0 || a->backend == "host")) {
        std::fprintf(stderr,
                     "kvtier bench pd: the %s lane needs CUDA memory: no CUDA device is visible "
                     "(or --backend host)\n",
                     l.c_str());
        return 2;
      }
    if (a->role.empty()) {
      // A lane's own flags given for a run without that lane changed nothing: say so instead of measuring rows
      // that look configured. (The prefill process is handed every setting, whatever its lane.)
      auto has = [&](std::initializer_list<std::string_view> names) {
        for (const auto& l : a->lanes)
          for (std::string_view n : names)
            if (l == n) return true;
        return false;
      };
      const bool ring = has({"ring"}), direct = has({"direct", "direct-inproc"});
      const struct {
        const char* flag;
        bool applies;
        const char* lanes;
      } lane_flags[] = {{"--ring-slots", ring, "the ring lane"},
                        {"--ring-slot-bytes", ring, "the ring lane"},
                        {"--ring-copy", ring, "the ring lane"},
                        {"--lane-verify", direct, "the direct and direct-inproc lanes"},
                        {"--pool-bytes", direct || ring, "the direct, direct-inproc and ring lanes"},
                        {"--decode-wait", direct || ring, "the direct, direct-inproc and ring lanes"}};
      for (const auto& f : lane_flags)
        if (!f.applies && cmd->get_option(f.flag)->count() > 0) {
          std::string lanes;
          for (const auto& l : a->lanes) lanes += (lanes.empty() ? "" : ",") + l;
          std::fprintf(stderr, "kvtier bench pd: %s is for %s only, and --lanes is %s\n", f.flag, f.lanes,
                       lanes.c_str());
          return 2;
        }
    }
    g_pd_options.busy_wait = std::chrono::microseconds(a->busy_wait_us);
    if (auto o = lane_engine_from(a->lane_engine); o.ok()) {
      g_lane_engine = *o;
    } else {
      std::fprintf(stderr, "kvtier bench pd: %s\n", o.status().message().c_str());
      return 2;
    }
    for (const auto& c : a->ring_copies)
      if (!parse_copy_strategy(c).ok()) {
        std::fprintf(stderr, "kvtier bench pd: --ring-copy '%s' is not a copy strategy\n", c.c_str());
        return 2;
      }
    if (a->prefill_gpu >= 0) {
      for (const auto& l : a->lanes)
        if (l != "ring") {
          std::fprintf(stderr, "kvtier bench pd: --prefill-gpu is for the ring lane only (lane '%s')\n", l.c_str());
          return 2;
        }
      if (a->prefill_gpu >= cuda_device_count()) {
        std::fprintf(stderr, "kvtier bench pd: --prefill-gpu %d, but %d CUDA devices are visible\n", a->prefill_gpu,
                     cuda_device_count());
        return 2;
      }
    }
    // A pool per side (direct lane) of at most 1 TiB: a larger one ended in "internal error: cannot create
    // std::vector larger than max_size()" (exit 1) instead of a usage error.
    if (a->pool_bytes > KvLayout::kMaxBlockBytes) {
      std::fprintf(stderr, "kvtier bench pd: --pool-bytes %llu is above %llu\n",
                   static_cast<unsigned long long>(a->pool_bytes),
                   static_cast<unsigned long long>(KvLayout::kMaxBlockBytes));
      return 2;
    }
    if (a->ring_slots == 0 || a->ring_slots > transport::PdOptions::kMaxRingSlots) {
      std::fprintf(stderr, "kvtier bench pd: --ring-slots %u is not in [1, %u]\n", a->ring_slots,
                   transport::PdOptions::kMaxRingSlots);
      return 2;
    }
    for (const auto& v : a->lane_verifies)
      if (auto parsed = transport::parse_lane_verify(v); !parsed.ok() && v != kMoverPass) {
        std::fprintf(stderr, "kvtier bench pd: --lane-verify: %s\n", parsed.status().message().c_str());
        return 2;
      }
    for (std::uint32_t k : a->inflights)
      if (k == 0 || k > 64) {
        std::fprintf(stderr, "kvtier bench pd: --inflight %u is not in [1, 64]\n", k);
        return 2;
      }
    if (a->decode_wait == "final" && a->role.empty())
      for (const auto& lane : a->lanes)
        if (lane != "direct" && lane != "direct-inproc" && lane != "ring") {
          std::fprintf(stderr, "kvtier bench pd: --decode-wait final is for the direct and ring lanes, not '%s'\n",
                       lane.c_str());
          return 2;
        }
    for (const auto& m : a->modes)
      if (m != "push" && m != "pull") {
        std::fprintf(stderr, "kvtier bench pd: mode '%s' is not push or pull\n", m.c_str());
        return 2;
      }
    for (const auto& m : a->memories)
      if (m != "host" && m != "device" && m != "raw") {
        std::fprintf(stderr, "kvtier bench pd: memory '%s' is not host, device or raw\n", m.c_str());
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
