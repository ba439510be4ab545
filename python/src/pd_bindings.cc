// Prefill/decode endpoints for Python (kvtier.pd): include/kvtier/transport/pd.h and, with a Device, the staged
// endpoints of pd_staged.h.
//
// One PdEndpoint is one side of the protocol (prefill or decode) on its own transport. Its blocks are the
// engine's tensors, described as the TransferManager's are (the name map of FastDeploy's CacheTransferManager:
// key_caches_{layer}_rank{r}.device{d}, ...; kvtier/pd.py builds it from per-layer lists). Without a Device the
// tensors must be memory the CPU addresses (numpy, CPU or pinned tensors) and the protocol runs on them directly;
// with one (device=cuda_device(n), or the host backend) they are that device's memory and move through a pinned
// staging space with the CopyEngine, and layer readiness / layer waits can go through the device's streams
// without a host sync.
//
// Every call that can block or take a lock of a kvtier thread releases the GIL. Teardown: the endpoint stops
// first (its progress threads), then the transport, then the staging memory and the engine's tensors.
#include <fmt/format.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "device_bridge.h"
#include "kvtier/backend/transport.h"
#include "kvtier/copy/copy_engine.h"
#include "kvtier/transfer/registration.h"
#include "kvtier/transport/ipc.h"
#include "kvtier/transport/pd.h"
#include "kvtier/transport/pd_staged.h"
#include "pd_bridge.h"
#include "status_bridge.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvtier::python {
namespace {

// The first byte of an endpoint's metadata: its role.
constexpr char kPrefillTag = 'P';
constexpr char kDecodeTag = 'D';

using transport::DecodeStatus;
using transport::LayerState;
using transport::PdMode;
using transport::PrefillStatus;
using transport::TransferId;

// What both sides must agree on beyond the layout's own fingerprint (dtype, block bytes, roles, block tokens): each
// tensor's per-block shape (a block of [heads, tokens, dim] is not one of [tokens, heads, dim], though it has as
// many bytes) and the tensor-parallel rank (rank r's blocks hold rank r's heads). Another value refuses the pairing
// at add_peer, where the transfer would have "loaded" bytes of another meaning. FNV-1a over the values.
std::uint64_t pairing_fingerprint(const KvLayout& layout, const std::map<std::string, TensorDesc>& descs, int rank) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  const auto mix = [&h](std::uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 0x100000001b3ull;
    }
  };
  mix(layout.fingerprint());
  mix(static_cast<std::uint64_t>(rank));
  for (const auto& [name, desc] : descs) {  // in name order, the same pattern on both sides
    mix(desc.shape.size());
    for (std::size_t d = 1; d < desc.shape.size(); ++d) mix(static_cast<std::uint64_t>(desc.shape[d]));
  }
  return h != 0 ? h : 1;  // 0 would mean "the layout's own" to PdOptions
}

Result<std::unique_ptr<transport::Transport>> make_transport(const EndpointOptions& o, std::uint64_t fingerprint,
                                                             const Device* device) {
  transport::AgentIdentity id{o.name, fingerprint, 1, 0};
  if (o.transport == "loopback") {
    transport::LoopbackOptions lo;
    lo.peer_secret = o.peer_secret;
    return transport::create_loopback_transport(std::move(id), std::move(lo));
  }
  if (o.transport == "ipc") {
    transport::IpcOptions io;
    io.peer_secret = o.peer_secret;
    if ((o.lane == "direct" || o.lane == "ring") && device != nullptr && device->backend() == BackendKind::kCuda) {
      // The pools shared through CUDA IPC (direct), or registered by handle only (ring: no window per pool).
      io.device_memory = transport::IpcOptions::DeviceMemory::kCuda;
      io.cuda_device = device->ordinal();
    }
    return transport::create_ipc_transport(std::move(id), std::move(io));
  }
  if (o.transport == "ucx") {
    transport::UcxOptions uo;
    uo.tls = o.tls;
    uo.net_devices = o.net_devices;
    uo.peer_secret = o.peer_secret;
    return transport::create_ucx_transport(std::move(id), std::move(uo));
  }
  return InvalidArgument(fmt::format("transport '{}' is not one of loopback, ipc, ucx", o.transport));
}

// Leases and heartbeats run in whole milliseconds: a value below one is refused rather than rounded to one (a
// heartbeat of 0.1 ms and a lease of 1.9 ms would otherwise be refused as "heartbeat 1 ms and lease 1 ms").
std::chrono::milliseconds to_ms(double seconds, const char* what) {
  if (!(seconds >= 0.001) || seconds > 86400)
    raise_status(InvalidArgument(fmt::format("{}_s {} is not in [0.001, 86400] seconds", what, seconds)));
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::llround(seconds * 1000)));
}

std::vector<BlockId> to_blocks(const std::vector<std::int64_t>& ids, const char* what) {
  std::vector<BlockId> out;
  out.reserve(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0) raise_status(OutOfRange(fmt::format("{} block id {} at index {} is negative", what, ids[i], i)));
    if (static_cast<std::uint64_t>(ids[i]) > kMaxBlockId)
      raise_status(
          OutOfRange(fmt::format("{} block id {} at index {} does not fit a 32-bit block id", what, ids[i], i)));
    out.push_back(static_cast<BlockId>(ids[i]));
  }
  return out;
}

std::uint32_t to_layer(std::int64_t layer) {
  if (layer < 0 || layer > UINT32_MAX) raise_status(OutOfRange(fmt::format("layer {} is not a layer index", layer)));
  return static_cast<std::uint32_t>(layer);
}

TransferId to_xid(std::int64_t id) {
  if (id < 0) raise_status(InvalidArgument(fmt::format("transfer id {} is negative", id)));
  return static_cast<TransferId>(id);
}

PdMode parse_mode(const std::string& mode) {
  if (mode == "push") return PdMode::kPush;
  if (mode == "pull") return PdMode::kPull;
  raise_status(InvalidArgument(fmt::format("mode '{}' is not push or pull", mode)));
}

// The steps this side has reached, in seconds of the monotonic clock (Python's time.monotonic() on Linux).
nb::dict times_dict(const transport::PdTimes& t) {
  nb::dict d;
  auto put = [&](const char* name, transport::PdTimes::TimePoint at) {
    if (at != transport::PdTimes::TimePoint{}) d[name] = std::chrono::duration<double>(at.time_since_epoch()).count();
  };
  put("started", t.started);
  put("request", t.request);
  put("move", t.move);
  put("posted", t.posted);
  put("moved", t.moved);
  put("announced", t.announced);
  put("final", t.final);
  return d;
}

nb::dict prefill_dict(const PrefillStatus& s) {
  nb::dict d;
  d["final"] = s.final;
  d["done"] = s.done;
  d["reclaimable"] = s.reclaimable;
  d["layers_sent"] = s.layers_sent;
  d["error"] = exception_object(s.error);
  d["times"] = times_dict(s.times);
  return d;
}

nb::dict decode_dict(const DecodeStatus& s) {
  nb::dict d;
  d["final"] = s.final;
  d["reclaimable"] = s.reclaimable;
  std::vector<std::string> layers;
  for (auto l : s.layers) layers.emplace_back(transport::layer_state_name(l));
  d["layers"] = layers;
  nb::list loaded;
  for (bool b : s.block_loaded) loaded.append(nb::bool_(b));
  d["block_loaded"] = loaded;
  d["leading_loaded_blocks"] = s.leading_loaded_blocks();
  d["error"] = exception_object(s.error);
  d["times"] = times_dict(s.times);
  return d;
}

// A stream of the endpoint's own device (a stream of another Device object is refused: its work is not that
// device's to wait for).
void check_stream(const PdNative& n, const PyStream& stream, const std::string& endpoint) {
  if (&stream.stream->device() != n.device())
    raise_status(InvalidArgument(
        fmt::format("stream {} belongs to another kvtier Device than endpoint '{}'s; create or adopt it on the "
                    "endpoint's device",
                    stream.stream->id(), endpoint)));
}

// Whether a UCX TLS list (UCX_TLS syntax: names separated by commas; empty is UCX's default, "^..." excludes) can
// include a transport that maps the peer's memory into this process, as the host direct lane needs.
bool ucx_tls_may_map(std::string_view tls) {
  if (tls.empty() || tls.front() == '^') return true;
  for (std::size_t at = 0; at <= tls.size();) {
    const std::size_t comma = std::min(tls.find(',', at), tls.size());
    const std::string_view name = tls.substr(at, comma - at);
    for (std::string_view maps : {"all", "sm", "shm", "posix", "sysv", "xpmem"})
      if (name == maps) return true;
    at = comma + 1;
  }
  return false;
}

std::unique_ptr<PyPdEndpoint> create_endpoint(std::map<std::string, nb::ndarray<>> tensors, nb::object device_obj,
                                              EndpointOptions o) {
  if (o.role != "prefill" && o.role != "decode")
    raise_status(InvalidArgument(fmt::format("role '{}' is not prefill or decode", o.role)));
  if (o.name.empty()) raise_status(InvalidArgument("the endpoint's name is empty"));
  if (o.lane != "auto" && o.lane != "direct" && o.lane != "ring" && o.lane != "host-direct")
    raise_status(InvalidArgument(fmt::format("lane '{}' is not auto, direct, ring or host-direct", o.lane)));
  if (o.lane == "host-direct" && !device_obj.is_none())
    raise_status(InvalidArgument("lane 'host-direct' moves host memory: no device="));
  if (o.lane == "host-direct" && o.transport != "ucx" && o.transport != "loopback")
    raise_status(InvalidArgument(fmt::format(
        "lane 'host-direct' needs a transport that maps the peer's pool here: ucx (tls='shm') or loopback, not {}",
        o.transport)));
  if (o.lane == "host-direct" && o.transport == "ucx" && !ucx_tls_may_map(o.tls))
    raise_status(InvalidArgument(fmt::format(
        "lane 'host-direct' over ucx needs a shared-memory transport in tls (shm, sm, posix, sysv, xpmem or all); "
        "tls '{}' reaches the peer through active messages only, so every transfer would fail",
        o.tls)));
  if (auto v = transport::parse_lane_verify(o.verify); !v.ok()) raise_status(v.status());
  if (o.read_back != "copy" && o.read_back != "pass")
    raise_status(InvalidArgument(fmt::format("read_back '{}' is not copy or pass", o.read_back)));
  if ((o.lane == "direct" || o.lane == "ring") && device_obj.is_none())
    raise_status(
        InvalidArgument(fmt::format("lane '{}' moves device memory: pass device= (kvtier.cuda_device(n))", o.lane)));
  if (o.lane == "direct" && o.transport == "ucx")
    raise_status(InvalidArgument(
        "lane 'direct' needs a transport that maps the peer's pool here: ipc (CUDA IPC) or loopback, not ucx"));
  if (o.lane == "ring" && o.transport == "ucx")
    raise_status(InvalidArgument(
        "lane 'ring' needs a transport that shares memory both processes map: ipc or loopback, not ucx"));
  const auto ring_copy = parse_copy_strategy(o.ring_copy);
  if (!ring_copy.ok()) raise_status(ring_copy.status().with_context("ring_copy"));
  const auto heartbeat = to_ms(o.heartbeat_s, "heartbeat");
  const auto lease = to_ms(o.lease_s, "lease");
  const auto request_wait = to_ms(o.request_wait_s, "request_wait");
  auto n = std::make_shared<PdNative>();
  n->device_ref = device_obj;
  nb::list keep_alive;
  n->keep_alive = keep_alive;
  Device* device = device_obj.is_none() ? nullptr : &nb::cast<PyDevice&>(device_obj).get();
  std::map<std::string, TensorDesc> descs;
  for (auto& [name, array] : tensors) {
    descs[name] = value_or_raise(device ? describe_tensor(name, array, *device) : describe_host_tensor(name, array));
    keep_alive.append(nb::cast(array));
    if (o.lane == "host-direct") {  // the layout's tensors are kept below
      PdNative::PoolTensor pt;
      pt.name = name;
      for (std::size_t d = 0; d < array.ndim(); ++d) {
        pt.shape.push_back(array.shape(d));
        pt.strides.push_back(array.stride(d));
      }
      pt.dtype = array.dtype();
      n->pool.push_back(std::move(pt));
    }
  }
  Status st = released([&]() -> Status {
    KVTIER_ASSIGN_OR_RETURN(n->layout,
                            layout_from_name_map(descs, o.num_model_layers, o.rank, o.device_label, o.block_tokens));
    KVTIER_ASSIGN_OR_RETURN(BlockSpace space, device_space_from_name_map(descs, n->layout, o.rank, o.device_label,
                                                                         device ? device->ordinal() : 0));
    // Only the layout's tensors are paired, sized, copied or adopted: the others' shapes and strides were never
    // checked, and another rank's tensors in one side's map must not refuse the pairing.
    const std::set<std::string> used = layout_tensor_names(n->layout, o.rank, o.device_label);
    std::erase_if(n->pool, [&](const PdNative::PoolTensor& pt) { return !used.contains(pt.name); });
    std::erase_if(descs, [&](const auto& entry) { return !used.contains(entry.first); });
    const std::uint64_t pairing = pairing_fingerprint(n->layout, descs, o.rank);
    KVTIER_ASSIGN_OR_RETURN(n->transport, make_transport(o, pairing, device));
    transport::PdOptions pd;
    pd.pairing_fingerprint = pairing;
    pd.heartbeat = heartbeat;
    pd.lease = lease;
    pd.request_wait = request_wait;
    if (device == nullptr && o.lane == "host-direct") {
      // The host direct lane: the pool lives in the transport's memory (UCX maps it into the peer), a copy of the
      // engine's tensors, one after another; the engine uses it through kv_pool().
      std::uint64_t total = 0;
      std::map<std::string, std::uint64_t> at;
      for (const auto& [name, t] : descs) {
        at[name] = total;
        total += (tensor_extent_bytes(t) + 63) / 64 * 64;
      }
      KVTIER_ASSIGN_OR_RETURN(std::span<std::byte> mem, n->transport->allocate_host(total));
      for (auto& [name, t] : descs) {
        std::memcpy(mem.data() + at[name], t.data, tensor_extent_bytes(t));
        t.data = mem.data() + at[name];
      }
      for (PdNative::PoolTensor& pt : n->pool) pt.data = mem.data() + at[pt.name];
      KVTIER_ASSIGN_OR_RETURN(space, device_space_from_name_map(descs, n->layout, o.rank, o.device_label, 0));
      pd.host_direct = true;
    }
    if (device == nullptr) {
      // Host memory: the protocol runs on the tensors themselves (the host direct lane: on its pool).
      std::vector<std::vector<Plane>> planes(n->layout.num_layers());
      for (std::uint32_t l = 0; l < n->layout.num_layers(); ++l)
        for (std::uint32_t r = 0; r < n->layout.num_roles(l); ++r) planes[l].push_back(space.plane(l, r));
      KVTIER_ASSIGN_OR_RETURN(n->space, BlockSpace::from_planes(MemoryKind::kPinnedHost, 0, n->layout,
                                                                space.num_blocks(), std::move(planes)));
      if (o.role == "prefill") {
        KVTIER_ASSIGN_OR_RETURN(n->prefill, transport::PdPrefill::create(*n->transport, n->space, pd));
      } else {
        KVTIER_ASSIGN_OR_RETURN(n->decode, transport::PdDecode::create(*n->transport, n->space, pd));
      }
      return Status::Ok();
    }
    n->space = space;
    for (const auto& [name, t] : descs) {
      if (tensor_extent_bytes(t) == 0) continue;  // no blocks: nothing of it is ever copied
      auto b = device->adopt_device_memory(t.data, tensor_extent_bytes(t));
      if (!b.ok()) return b.status().with_context(fmt::format("device tensor '{}'", name));
      n->adopted_device.push_back(std::move(b).value());
    }
    if (o.lane == "direct" || o.lane == "ring") {
      // The device lane: the copy engine's kernel moves each layer straight between the two pools. The ring lane:
      // each side's copy engine moves it between its pool and the decode's shared ring.
      KVTIER_ASSIGN_OR_RETURN(n->engine, CopyEngine::create(*device, transport::lane_engine_options()));
      pd.engine = n->engine.get();
      KVTIER_ASSIGN_OR_RETURN(pd.lane_verify, transport::parse_lane_verify(o.verify));
      pd.lane_read_back_in_copy = o.read_back == "copy";
      if (o.lane == "ring") {
        // PdOptions reads ring_slots 0 as "no ring" (the device lane): refused here, where the lane was asked for.
        if (o.ring_slots == 0)
          return InvalidArgument(
              fmt::format("lane 'ring' with ring_slots 0: 1 to {}", transport::PdOptions::kMaxRingSlots));
        pd.ring_slots = o.ring_slots;
        pd.ring_slot_bytes = o.ring_slot_bytes;
        pd.ring_copy = *ring_copy;
      }
      if (o.role == "prefill") {
        KVTIER_ASSIGN_OR_RETURN(n->prefill, transport::PdPrefill::create(*n->transport, n->space, pd));
      } else {
        KVTIER_ASSIGN_OR_RETURN(n->decode, transport::PdDecode::create(*n->transport, n->space, pd));
      }
      return Status::Ok();
    }
    // Device memory: staged through pinned host memory with the copy engine.
    const std::uint64_t staging_blocks = o.staging_blocks != 0 ? o.staging_blocks : space.num_blocks();
    // From the transport (allocate_host), so that UCX's shared-memory lanes reach the staging directly.
    KVTIER_ASSIGN_OR_RETURN(auto staging,
                            transport::StagingSpace::allocate(*device, n->layout, staging_blocks, n->transport.get()));
    n->staging.emplace(std::move(staging));
    KVTIER_ASSIGN_OR_RETURN(n->engine, CopyEngine::create(*device, transport::lane_engine_options()));
    transport::StagedOptions so;
    so.pd = pd;
    if (o.role == "prefill") {
      KVTIER_ASSIGN_OR_RETURN(n->staged_prefill, transport::PdStagedPrefill::create(*n->transport, *device, *n->engine,
                                                                                    n->space, n->staging->space, so));
    } else {
      KVTIER_ASSIGN_OR_RETURN(n->staged_decode, transport::PdStagedDecode::create(*n->transport, *device, *n->engine,
                                                                                  n->space, n->staging->space, so));
    }
    return Status::Ok();
  });
  if (!st.ok()) {
    {
      GilReleased release;
      n.reset();
    }
    // The name as the error shows it: a name refused for its length is not repeated whole (100 KB of it).
    const std::string shown =
        o.name.size() <= 80 ? o.name : fmt::format("{}... ({} bytes)", o.name.substr(0, 64), o.name.size());
    raise_status(st.with_context(fmt::format("{} endpoint '{}'", o.role, shown)));
  }
  auto out = std::make_unique<PyPdEndpoint>();
  out->options = std::move(o);
  out->lane = device == nullptr             ? (out->options.lane == "host-direct" ? "host-direct" : "host")
              : out->options.lane == "auto" ? "staged"
                                            : out->options.lane;
  out->backend = std::string(n->transport->backend_name());
  out->layout = n->layout.describe();
  out->num_layers = n->layout.num_layers();
  out->num_blocks = n->space.num_blocks();
  out->block_bytes = n->layout.total_block_bytes();
  out->staged = device != nullptr && out->options.lane == "auto";
  out->native = std::move(n);
  return out;
}

}  // namespace

nb::dict decode_status_dict(const transport::DecodeStatus& s) { return decode_dict(s); }
transport::PdMode pd_mode_from(const std::string& mode) { return parse_mode(mode); }

void bind_pd(nb::module_& m) {
  nb::class_<PyPdEndpoint>(m, "PdEndpoint",
                           "One side (prefill or decode) of a prefill/decode KV transfer on its own transport. "
                           "See kvtier.pd and include/kvtier/transport/pd.h for the contract.")
      .def_static(
          "create",
          [](const std::string& role, nb::handle tensors_obj, const std::string& transport, const std::string& name,
             std::uint32_t num_model_layers, nb::object device, nb::bytes peer_secret, const std::string& tls,
             const std::string& net_devices, double heartbeat_s, double lease_s, int rank, int device_label,
             std::uint32_t block_tokens, std::uint64_t staging_blocks, const std::string& lane,
             const std::string& verify, std::uint32_t ring_slots, std::uint64_t ring_slot_bytes,
             const std::string& ring_copy, const std::string& read_back, double request_wait_s) {
            EndpointOptions o;
            o.role = role;
            o.transport = transport;
            o.name = name;
            o.peer_secret.assign(peer_secret.c_str(), peer_secret.size());
            o.tls = tls;
            o.net_devices = net_devices;
            o.heartbeat_s = heartbeat_s;
            o.lease_s = lease_s;
            o.request_wait_s = request_wait_s;
            o.num_model_layers = num_model_layers;
            o.rank = rank;
            o.device_label = device_label;
            o.block_tokens = block_tokens;
            o.staging_blocks = staging_blocks;
            o.lane = lane;
            o.verify = verify;
            o.ring_slots = ring_slots;
            o.ring_slot_bytes = ring_slot_bytes;
            o.ring_copy = ring_copy;
            o.read_back = read_back;
            if (!device.is_none() && !nb::isinstance<PyDevice>(device))
              raise_status(InvalidArgument("device is not a kvtier Device (kvtier.cuda_device() / host_device())"));
            return create_endpoint(tensor_map_arg(tensors_obj, "tensors"), std::move(device), std::move(o));
          },
          "role"_a, "tensors"_a, "transport"_a, "name"_a, "num_model_layers"_a, "device"_a = nb::none(),
          "peer_secret"_a = nb::bytes(""), "tls"_a = "", "net_devices"_a = "", "heartbeat_s"_a = 0.1, "lease_s"_a = 1.0,
          "rank"_a = 0, "device_label"_a = 0, "block_tokens"_a = 64, "staging_blocks"_a = 0, "lane"_a = "auto",
          "verify"_a = "mover", "ring_slots"_a = 4, "ring_slot_bytes"_a = std::uint64_t{32} << 20,
          "ring_copy"_a = "auto", "read_back"_a = "copy", "request_wait_s"_a = 60.0,
          "An endpoint over the engine's tensors (FastDeploy's name map). device=None: host memory, the protocol "
          "on the tensors; a Device: its memory, staged through pinned host memory, or with lane='direct' moved by "
          "the copy kernel straight between the two pools (ipc on CUDA, loopback), or with lane='ring' through the "
          "decode's shared pinned ring of ring_slots slots of ring_slot_bytes (ipc, loopback).")
      .def_prop_ro("role", [](const PyPdEndpoint& e) { return e.options.role; })
      .def_prop_ro("name", [](const PyPdEndpoint& e) { return e.options.name; })
      .def_prop_ro("transport", [](const PyPdEndpoint& e) { return e.backend; })
      .def_prop_ro("staged", [](const PyPdEndpoint& e) { return e.staged; })
      .def_prop_ro("lane", [](const PyPdEndpoint& e) { return e.lane; })
      .def(
          "kv_pool",
          [](PyPdEndpoint& e) {
            auto n = e.get();
            nb::dict out;
            for (const PdNative::PoolTensor& pt : n->pool) {
              // Each array keeps the endpoint's native state (and so the transport's memory) alive; counted as an
              // array, not a call, so that close() does not wait for it (PdNative::pool_arrays).
              auto* ref = new std::shared_ptr<PdNative>(n);
              n->pool_arrays.fetch_add(1);
              nb::capsule owner(ref, [](void* p) noexcept {
                auto* r = static_cast<std::shared_ptr<PdNative>*>(p);
                (*r)->pool_arrays.fetch_sub(1);
                delete r;
              });
              out[pt.name.c_str()] =
                  nb::ndarray<nb::numpy>(pt.data, pt.shape.size(), pt.shape.data(), owner, pt.strides.data(), pt.dtype);
            }
            return out;
          },
          "The host direct lane's pool, by tensor name (numpy arrays over the transport's memory); empty otherwise.")
      .def_prop_ro("layout", [](const PyPdEndpoint& e) { return e.layout; })
      .def_prop_ro("num_layers", [](const PyPdEndpoint& e) { return e.num_layers; })
      .def_prop_ro("num_blocks", [](const PyPdEndpoint& e) { return e.num_blocks; })
      .def_prop_ro("block_bytes", [](const PyPdEndpoint& e) { return e.block_bytes; })
      .def(
          "metadata",
          [](PyPdEndpoint& e) {
            auto n = e.get();
            auto blob = value_or_raise(released([&] { return n->transport->export_metadata(); }));
            // The endpoint's role first, then the transport's blob: add_peer() refuses an endpoint of its own role,
            // which would otherwise wait for requests that never come until a lease or a timeout ended it.
            std::string out(1, e.is_prefill() ? kPrefillTag : kDecodeTag);
            out.append(reinterpret_cast<const char*>(blob.data()), blob.size());
            return nb::bytes(out.data(), out.size());
          },
          "This endpoint's metadata blob, for the peer's add_peer().")
      .def(
          "add_peer",
          [](PyPdEndpoint& e, nb::bytes blob) {
            auto n = e.get();
            const char tag = blob.size() != 0 ? blob.c_str()[0] : '\0';
            if (tag != kPrefillTag && tag != kDecodeTag)
              raise_status(
                  DataLoss(fmt::format("add_peer: a blob of {} bytes that is not a kvtier.pd endpoint's "
                                       "metadata (it starts with neither role)",
                                       blob.size())));
            std::vector<std::byte> b(blob.size() - 1);
            if (!b.empty()) std::memcpy(b.data(), blob.c_str() + 1, b.size());
            if ((tag == kPrefillTag) == e.is_prefill()) {
              auto own = n->transport->export_metadata();
              const bool self = own.ok() && *own == b;
              raise_status(FailedPrecondition(fmt::format(
                  "add_peer: the blob is {0} {1} endpoint's; '{2}' is a {1} and pairs with a {3} endpoint",
                  self ? "this" : "another", e.options.role, e.options.name, e.is_prefill() ? "decode" : "prefill")));
            }
            // Sizes in the transport's messages count the blob without the role byte: say so once.
            auto peer = released([&] { return n->transport->load_peer(b); });
            if (!peer.ok())
              raise_status(peer.status().with_context(
                  fmt::format("add_peer: metadata of {} bytes (a role byte, then the transport's blob)", blob.size())));
            return *peer;
          },
          "metadata"_a, "Loads the peer's metadata blob (checked, authenticated with a peer secret); its peer id.")
      .def(
          "disconnect_peer",
          [](PyPdEndpoint& e, std::int64_t peer) {
            auto n = e.get();
            if (peer < 0 || peer > UINT32_MAX) raise_status(NotFound(fmt::format("peer {} is not a peer id", peer)));
            const auto id = static_cast<transport::PeerId>(peer);
            check(released([&] {
              // Through the endpoint, as its lease expiry does: its copies into the peer's memory end before the
              // transport unmaps it (the transport's own disconnect crashed a host direct copy in flight).
              return n->prefill          ? n->prefill->disconnect_peer(id)
                     : n->decode         ? n->decode->disconnect_peer(id)
                     : n->staged_prefill ? n->staged_prefill->disconnect_peer(id)
                                         : n->staged_decode->disconnect_peer(id);
            }));
          },
          "peer"_a,
          "Drops a peer: nothing more goes to it or lands from it where the transport can refuse it, and its name is "
          "free for add_peer (a fresh connection). FailedPreconditionError while a transfer with it is not final. "
          "Idempotent.")
      // ---- prefill
      .def(
          "begin",
          [](PyPdEndpoint& e, std::uint32_t peer, std::int64_t id, const std::vector<std::int64_t>& src) {
            auto n = e.get("prefill", "begin");
            auto blocks = to_blocks(src, "source");
            const TransferId x = to_xid(id);
            check(released([&] {
              return n->prefill ? n->prefill->begin(peer, x, std::move(blocks))
                                : n->staged_prefill->begin(peer, x, std::move(blocks));
            }));
          },
          "peer"_a, "transfer_id"_a, "src_blocks"_a)
      .def(
          "layer_ready",
          [](PyPdEndpoint& e, std::int64_t id, std::int64_t layer, PyStream* stream) {
            auto n = e.get("prefill", "layer_ready");
            const TransferId x = to_xid(id);
            const std::uint32_t l = to_layer(layer);
            if (stream == nullptr) {
              check(released(
                  [&] { return n->prefill ? n->prefill->layer_ready(x, l) : n->staged_prefill->layer_ready(x, l); }));
              return;
            }
            Device* dev = n->device();
            if (dev == nullptr)
              raise_status(InvalidArgument(
                  fmt::format("layer_ready(stream=...) of transfer {} layer {}: endpoint '{}' was created without a "
                              "device (host memory is ready when layer_ready is called)",
                              id, layer, e.options.name)));
            check_stream(*n, *stream, e.options.name);
            check(released([&]() -> Status {
              KVTIER_ASSIGN_OR_RETURN(auto ev, dev->create_event(EventOptions{}));
              KVTIER_RETURN_IF_ERROR(dev->record(*ev, *stream->stream));
              if (n->prefill) {
                // Direct lane: the progress thread queries the event (no host sync); the check keeps it alive.
                std::shared_ptr<Event> event = std::move(ev);
                return n->prefill->layer_ready(x, l, [dev, event]() { return dev->query(*event); });
              }
              // Only the event's capture matters to the staged endpoint: it may go once the call returned.
              return n->staged_prefill->layer_ready_after(x, l, *ev);
            }));
          },
          "transfer_id"_a, "layer"_a, "stream"_a = nb::none(),
          "Declares the layer ready: now, or (stream=) once the work enqueued so far on the stream completed "
          "(no host sync).")
      .def(
          "layers_ready",
          [](PyPdEndpoint& e, std::int64_t id, const std::vector<std::int64_t>& layers) {
            auto n = e.get("prefill", "layers_ready");
            const TransferId x = to_xid(id);
            std::vector<std::uint32_t> ls;
            ls.reserve(layers.size());
            for (std::int64_t l : layers) ls.push_back(to_layer(l));
            if (n->prefill) {
              check(released([&] { return n->prefill->layers_ready(x, ls); }));
              return;
            }
            check(released([&] { return n->staged_prefill->layers_ready(x, ls); }));
          },
          "transfer_id"_a, "layers"_a,
          "Declares several layers ready now, in one call (the device lane moves them as one copy).")
      // ---- decode
      .def(
          "start",
          [](PyPdEndpoint& e, std::uint32_t peer, std::int64_t id, const std::vector<std::int64_t>& dst,
             const std::string& mode) {
            auto n = e.get("decode", "start");
            auto blocks = to_blocks(dst, "destination");
            const PdMode md = parse_mode(mode);
            const TransferId x = to_xid(id);
            check(released([&] {
              return n->decode ? n->decode->start(peer, x, md, std::move(blocks))
                               : n->staged_decode->start(peer, x, md, std::move(blocks));
            }));
          },
          "peer"_a, "transfer_id"_a, "dst_blocks"_a, "mode"_a = "push")
      .def(
          "wait_layer",
          [](PyPdEndpoint& e, std::int64_t id, std::int64_t layer, std::optional<double> timeout) {
            auto n = e.get("decode", "wait_layer");
            const TransferId x = to_xid(id);
            const std::uint32_t l = to_layer(layer);
            const auto t = to_timeout(timeout);
            auto s = value_or_raise(wait_interruptible(t, [&](std::chrono::nanoseconds slice) {
              return n->decode ? n->decode->wait_layer(x, l, slice) : n->staged_decode->wait_layer(x, l, slice);
            }));
            return std::string(transport::layer_state_name(s));
          },
          "transfer_id"_a, "layer"_a, "timeout"_a.none(), "Until the layer is final: 'loaded', 'partial' or 'failed'.")
      .def(
          "wait_layer_on_stream",
          [](PyPdEndpoint& e, std::int64_t id, std::int64_t layer, PyStream& stream, std::optional<double> timeout) {
            auto n = e.get("decode", "wait_layer_on_stream");
            if (n->decode && n->device() != nullptr) {
              // Direct lane: a layer is final once its bytes are verified in this pool (the kernels that wrote and
              // checked them completed), so the stream needs no device-side wait.
              check_stream(*n, stream, e.options.name);
              const TransferId x = to_xid(id);
              const std::uint32_t l = to_layer(layer);
              const auto t = to_timeout(timeout);
              check(wait_interruptible(
                  t, [&](std::chrono::nanoseconds slice) { return n->decode->wait_layer(x, l, slice).status(); }));
              return;
            }
            if (!n->staged_decode)
              raise_status(InvalidArgument(
                  fmt::format("wait_layer_on_stream of transfer {} layer {}: endpoint '{}' was created without a "
                              "device; use wait_layer",
                              id, layer, e.options.name)));
            const TransferId x = to_xid(id);
            const std::uint32_t l = to_layer(layer);
            const auto t = to_timeout(timeout);
            check_stream(*n, stream, e.options.name);
            Device* dev = n->device();
            check(released([&]() -> Status {
              KVTIER_ASSIGN_OR_RETURN(Event * ev, n->staged_decode->layer_event(x, l, t));
              return dev->wait(*stream.stream, *ev);
            }));
          },
          "transfer_id"_a, "layer"_a, "stream"_a, "timeout"_a.none(),
          "Once the layer's copy into device memory is enqueued (host wait up to the timeout), makes `stream` "
          "wait for it on the device. Check the layer's final state before trusting its blocks.")
      // ---- both
      .def(
          "status",
          [](PyPdEndpoint& e, std::int64_t id) -> nb::dict {
            auto n = e.get();
            const TransferId x = to_xid(id);
            if (e.is_prefill())
              return prefill_dict(value_or_raise(
                  released([&] { return n->prefill ? n->prefill->status(x) : n->staged_prefill->status(x); })));
            return decode_dict(value_or_raise(
                released([&] { return n->decode ? n->decode->status(x) : n->staged_decode->status(x); })));
          },
          "transfer_id"_a)
      .def(
          "wait",
          [](PyPdEndpoint& e, std::int64_t id, std::optional<double> timeout, bool reclaimable) -> nb::dict {
            auto n = e.get();
            const TransferId x = to_xid(id);
            const auto t = to_timeout(timeout);
            if (e.is_prefill())
              return prefill_dict(value_or_raise(wait_interruptible(t, [&](std::chrono::nanoseconds slice) {
                return n->prefill ? n->prefill->wait(x, slice) : n->staged_prefill->wait(x, slice);
              })));
            return decode_dict(value_or_raise(wait_interruptible(t, [&](std::chrono::nanoseconds slice) {
              return n->decode ? n->decode->wait(x, slice, reclaimable) : n->staged_decode->wait(x, slice, reclaimable);
            })));
          },
          "transfer_id"_a, "timeout"_a.none(), "reclaimable"_a = false,
          "Until the transfer is final (prefill: and reclaimable; decode: also reclaimable when asked).")
      .def(
          "forget",
          [](PyPdEndpoint& e, std::int64_t id) {
            auto n = e.get();
            const TransferId x = to_xid(id);
            check(released([&]() -> Status {
              if (n->prefill) return n->prefill->forget(x);
              if (n->staged_prefill) return n->staged_prefill->forget(x);
              if (n->decode) return n->decode->forget(x);
              return n->staged_decode->forget(x);
            }));
          },
          "transfer_id"_a, "Forgets a final, reclaimable transfer (FailedPreconditionError otherwise).")
      .def(
          "cancel",
          [](PyPdEndpoint& e, std::int64_t id) {
            auto n = e.get("decode", "cancel");
            const TransferId x = to_xid(id);
            check(released([&] { return n->decode ? n->decode->cancel(x) : n->staged_decode->cancel(x); }));
          },
          "transfer_id"_a,
          "Gives up on a transfer now: its layers not final fail, the prefill is told and proves its writes over.")
      .def("close", &PyPdEndpoint::close_checked,
           "Stops the endpoint and its transport (idempotent). A call in flight on another thread keeps them until "
           "it returns; kv_pool() arrays keep the transport's memory, not the endpoint. FailedPreconditionError while "
           "a kvtier.pd.Receiver drives the endpoint.");
}

}  // namespace kvtier::python
