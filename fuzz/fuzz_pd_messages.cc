// Fuzzes the prefill/decode protocol's message handlers (transport/pd.cc) with messages a peer crafts: a prefill
// and a decode endpoint over loopback transports, on the lane the input picks (transport, host direct, device lane
// on the host backend, ring), driven by a sequence of operations the input encodes: the endpoints' own calls
// (begin, start, layer_ready, cancel, forget, waits) interleaved with notifications built field by field and sent
// in either endpoint's name to the other (types, transfer ids, layers, block and checksum lists of any length).
//
// Invariants: nothing crashes, trips a sanitizer or hangs (libFuzzer's per-input timeout; every wait here has a
// deadline, and the endpoints close within their short leases); the prefill's pool is never written (every lane
// only reads it); blocks that no start() named and no request could name keep their poison; and unless a side
// dropped its peer, a transfer under a fresh id after the crafted traffic moves byte-exact (crafted messages about
// other transfers must not wedge an endpoint).
#include <fmt/format.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "core/byte_codec.h"
#include "fuzz/fuzz_util.h"
#include "kvtier/copy/copy_engine.h"
#include "kvtier/device/host_device.h"
#include "kvtier/transport/pd.h"
#include "transport/pd_test_util.h"

namespace {

using namespace kvtier;
using namespace kvtier::transport;
using namespace std::chrono_literals;

constexpr std::uint32_t kLayers = 2;
constexpr std::uint64_t kBlockBytes = 1024;
constexpr std::uint64_t kPreBlocks = 8;
// The decode's pool: blocks below kNamed may be named by start() or a crafted request (the lists also carry ids past
// the pool's end); blocks kNamed.. are never named anywhere, so they must keep their poison.
constexpr std::uint64_t kDecBlocks = 12, kNamed = 10;
constexpr std::byte kPoison{0xee};

// Reads the fuzzer's bytes in order; past the end every read gives zero.
class Input {
 public:
  explicit Input(std::span<const std::uint8_t> in) : in_(in) {}
  bool done() const { return pos_ >= in_.size(); }
  std::uint8_t u8() { return pos_ < in_.size() ? in_[pos_++] : 0; }
  std::uint32_t u32() {
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= std::uint32_t{u8()} << (8 * i);
    return v;
  }
  std::uint64_t u64() {
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= std::uint64_t{u8()} << (8 * i);
    return v;
  }

 private:
  std::span<const std::uint8_t> in_;
  std::size_t pos_ = 0;
};

struct Rig {
  KvLayout layout = testing::pd_layout(kLayers, kBlockBytes);
  testing::HostBlocks pre_mem = testing::HostBlocks::make(layout, kPreBlocks, true);
  testing::HostBlocks dec_mem = testing::HostBlocks::make(layout, kDecBlocks, false, kPoison);
  std::unique_ptr<HostDevice> device;
  std::unique_ptr<CopyEngine> engine;
  std::unique_ptr<Transport> pre_t, dec_t;
  std::unique_ptr<PdPrefill> pre;
  std::unique_ptr<PdDecode> dec;
  PeerId to_dec = 0, to_pre = 0;

  // lane: 0 transport, 1 host direct, 2 device lane (host backend), 3 ring lane (host backend).
  explicit Rig(int lane) {
    static int seq = 0;
    const int n = ++seq;
    PdOptions opt;
    // Leases long enough that a machine busy with other harnesses (CI runs one per core, under ASan) never
    // starves a heartbeat past one: a lease that ran out would fail the fresh transfer for the wrong reason.
    opt.heartbeat = 20ms;
    opt.lease = 1000ms;
    opt.request_wait = 1000ms;
    opt.idle_wait = 200us;
    opt.checksum_helpers = 0;
    BlockSpace pre_space = pre_mem.space, dec_space = dec_mem.space;
    if (lane == 1) opt.host_direct = true;
    if (lane >= 2) {
      device = HostDevice::create().value();
      engine = CopyEngine::create(*device, lane_engine_options()).value();
      opt.engine = engine.get();
      pre_space = testing::as_device(pre_space);
      dec_space = testing::as_device(dec_space);
      if (lane == 3) {
        opt.ring_slots = 2;
        opt.ring_slot_bytes = 4 * kBlockBytes * 2;  // four blocks of a layer's two roles: layers in pieces
      }
    }
    pre_t = create_loopback_transport({fmt::format("fz-pre{}", n), layout.fingerprint(), 1, 0}).value();
    dec_t = create_loopback_transport({fmt::format("fz-dec{}", n), layout.fingerprint(), 1, 0}).value();
    pre = PdPrefill::create(*pre_t, pre_space, opt).value();
    dec = PdDecode::create(*dec_t, dec_space, opt).value();
    to_dec = pre_t->load_peer(dec_t->export_metadata().value()).value();
    to_pre = dec_t->load_peer(pre_t->export_metadata().value()).value();
  }
  ~Rig() {
    pre.reset();
    dec.reset();
  }
};

// A few transfer ids (the crafted messages mostly name these), or now and then any id.
TransferId pick_id(Input& in) {
  const std::uint8_t b = in.u8();
  return b < 0xf0 ? 100 + (b & 3) : in.u64();
}

// Mostly ids below `bound`, now and then one past either pool's end.
std::uint64_t pick_block(Input& in, std::uint64_t bound) {
  const std::uint8_t b = in.u8();
  return b < 0xf0 ? b % bound : kDecBlocks + (b & 7);
}

std::vector<BlockId> pick_blocks(Input& in, std::uint64_t bound) {
  std::vector<BlockId> ids(in.u8() % 7);
  for (BlockId& b : ids) b = pick_block(in, bound);
  return ids;
}

// A notification built field by field: its type, the transfer id, then fields until the input says stop.
std::string craft(Input& in) {
  static constexpr char kTypes[] = "RWAKDXFQYGPH";
  codec::ByteWriter<std::string> w;
  const std::uint8_t t = in.u8();
  w.u8(t < 0xf0 ? static_cast<std::uint8_t>(kTypes[t % (sizeof kTypes - 1)]) : in.u8());
  w.u64(pick_id(in));
  for (int fields = 0; fields < 12; ++fields) {
    switch (in.u8() % 8) {
      case 0: return w.out;
      case 1:
        w.u8(in.u8() % 5);  // a mode or lane byte
        break;
      case 2:
        w.u32(in.u8() % (kLayers + 2));  // a layer, piece or slot
        break;
      case 3: w.u32(in.u32()); break;
      case 4: {  // a list of small numbers: block ids, strides in blocks
        std::vector<std::uint64_t> v(in.u8() % 9);
        for (auto& x : v) x = pick_block(in, kNamed);
        w.u64s(v);
        break;
      }
      case 5: {  // a list of plane strides (the layout's are kBlockBytes)
        std::vector<std::uint64_t> v(in.u8() % 6);
        for (auto& x : v) x = in.u8() < 0xc0 ? kBlockBytes : in.u64();
        w.u64s(v);
        break;
      }
      case 6: w.u64(in.u64()); break;
      default: {  // raw bytes, any length field included
        const std::uint8_t n = in.u8() % 24;
        for (std::uint8_t i = 0; i < n; ++i) w.u8(in.u8());
        break;
      }
    }
  }
  return w.out;
}

bool pool_holds_pattern(const BlockSpace& s, std::uint64_t blocks) {
  for (std::uint32_t l = 0; l < kLayers; ++l)
    for (std::uint64_t b = 0; b < blocks; ++b)
      for (std::uint32_t r = 0; r < 2; ++r) {
        const std::byte* p = s.block_ptr(l, r, b);
        for (std::uint64_t i = 0; i < kBlockBytes; ++i)
          if (p[i] != testing::pattern(l, r, b, i)) return false;
      }
  return true;
}

bool block_poisoned(const BlockSpace& s, std::uint64_t b) {
  for (std::uint32_t l = 0; l < kLayers; ++l)
    for (std::uint32_t r = 0; r < 2; ++r) {
      const std::byte* p = s.block_ptr(l, r, b);
      for (std::uint64_t i = 0; i < kBlockBytes; ++i)
        if (p[i] != kPoison) return false;
    }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in({data, size});
  Rig rig(in.u8() % 4);
  for (int ops = 0; ops < 48 && !in.done(); ++ops) {
    switch (in.u8() % 10) {
      case 0: rig.pre->begin(rig.to_dec, pick_id(in), pick_blocks(in, kPreBlocks)).ignore_error(); break;
      case 1: {
        const TransferId id = pick_id(in);
        const PdMode mode = in.u8() & 1 ? PdMode::kPull : PdMode::kPush;
        rig.dec->start(rig.to_pre, id, mode, pick_blocks(in, kNamed)).ignore_error();
        break;
      }
      case 2: rig.pre->layer_ready(pick_id(in), in.u8() % (kLayers + 1)).ignore_error(); break;
      case 3:
      case 4:  // in the decode's name to the prefill
        rig.dec_t->send_notification(rig.to_pre, craft(in)).ignore_error();
        break;
      case 5:
      case 6:  // in the prefill's name to the decode
        rig.pre_t->send_notification(rig.to_dec, craft(in)).ignore_error();
        break;
      case 7: rig.dec->cancel(pick_id(in)).ignore_error(); break;
      case 8:
        if (in.u8() & 1)
          rig.pre->forget(pick_id(in)).ignore_error();
        else
          rig.dec->forget(pick_id(in)).ignore_error();
        break;
      default: rig.dec->wait_layer(pick_id(in), in.u8() % kLayers, 1ms).status().ignore_error(); break;
    }
  }
  // Let the progress threads handle what is queued.
  for (TransferId id = 100; id < 104; ++id) {
    rig.pre->wait(id, 5ms).status().ignore_error();
    rig.dec->wait(id, 5ms).status().ignore_error();
  }

  // A transfer under a fresh id still moves, unless a side dropped its peer.
  if (!rig.pre_t->peer_revoked(rig.to_dec) && !rig.dec_t->peer_revoked(rig.to_pre)) {
    const std::vector<BlockId> src = {6, 0}, dst = {7, 5};
    const TransferId fresh = 7000;
    Status b = rig.pre->begin(rig.to_dec, fresh, src);
    Status s = rig.dec->start(rig.to_pre, fresh, data[0] & 0x80 ? PdMode::kPull : PdMode::kPush, dst);
    if (b.ok() && s.ok()) {
      for (std::uint32_t l = 0; l < kLayers; ++l) KVTIER_FUZZ_CHECK(rig.pre->layer_ready(fresh, l).ok());
      auto fin = rig.dec->wait(fresh, 5s);
      KVTIER_FUZZ_CHECK(fin.ok());
      // Peers may have fallen out since (a crafted message can make a side drop its peer while this runs).
      if (!rig.pre_t->peer_revoked(rig.to_dec) && !rig.dec_t->peer_revoked(rig.to_pre)) {
        if (!fin->error.ok()) std::fprintf(stderr, "fresh transfer failed: %s\n", fin->error.to_string().c_str());
        KVTIER_FUZZ_CHECK(fin->error.ok());
        for (std::uint32_t l = 0; l < kLayers; ++l)
          for (std::size_t i = 0; i < dst.size(); ++i)
            KVTIER_FUZZ_CHECK(testing::layer_matches(rig.dec_mem.space, dst[i], l, src[i]));
      }
    } else {
      b.ignore_error();
      s.ignore_error();
    }
  }
  KVTIER_FUZZ_CHECK(pool_holds_pattern(rig.pre_mem.space, kPreBlocks));
  for (std::uint64_t b = kNamed; b < kDecBlocks; ++b) KVTIER_FUZZ_CHECK(block_poisoned(rig.dec_mem.space, b));
  return 0;
}
