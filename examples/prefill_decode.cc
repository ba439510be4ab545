// Move one prompt's KV from a prefill instance to a decode instance, layer by layer, every block verified on
// arrival: kvtier's prefill/decode protocol (include/kvtier/transport/pd.h) with the public API only.
//
//   prefill_decode [push|pull]
//
// Both endpoints live in this one process on loopback transports so that the example runs anywhere (CI
// included). In a deployment each runs in its own process; only the transport's factory changes
// (create_ipc_transport on one host, create_ucx_transport across hosts) and the metadata blobs travel between
// the processes out of band (the router, a socket). Exit status 0 only when every block arrived verified and
// byte-exact.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "kvtier/backend/transport.h"
#include "kvtier/core/layout.h"
#include "kvtier/core/status.h"
#include "kvtier/transport/pd.h"

namespace {

using namespace kvtier;
using namespace kvtier::transport;
using namespace std::chrono_literals;

// One side's KV cache in host memory: a region per (layer, role), block b at base + b * block_bytes.
struct HostCache {
  std::vector<std::vector<std::byte>> regions;
  BlockSpace space;
};

Result<HostCache> make_cache(const KvLayout& layout, std::uint64_t num_blocks, std::byte fill) {
  HostCache c;
  std::vector<std::vector<void*>> bases(layout.num_layers());
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
      c.regions.emplace_back(layout.block_bytes(l, r) * num_blocks, fill);
      bases[l].push_back(c.regions.back().data());
    }
  KVTIER_ASSIGN_OR_RETURN(c.space, BlockSpace::layer_first(MemoryKind::kPinnedHost, 0, layout, num_blocks, bases));
  return c;
}

Status run(PdMode mode) {
  // The model's per-block layout: both sides must agree on it (its fingerprint is in the metadata).
  KVTIER_ASSIGN_OR_RETURN(KvLayout layout, KvLayout::uniform(/*layers=*/8, /*roles=*/2, /*block_bytes=*/4096));
  KVTIER_ASSIGN_OR_RETURN(HostCache prefill_kv, make_cache(layout, 32, std::byte{0}));
  KVTIER_ASSIGN_OR_RETURN(HostCache decode_kv, make_cache(layout, 48, std::byte{0xDB}));  // poisoned
  // The prompt's KV, written by the prefill's forward into its blocks 4..9.
  const std::vector<BlockId> src{4, 5, 6, 7, 8, 9}, dst{40, 12, 33, 2, 17, 25};
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (std::uint32_t r = 0; r < 2; ++r)
      for (std::uint64_t b : src)
        for (std::uint64_t i = 0; i < 4096; ++i)
          prefill_kv.space.block_ptr(l, r, b)[i] = static_cast<std::byte>((l * 31 + r * 7 + b * 3 + i) & 0xff);

  // A transport per endpoint, a shared secret authenticating the metadata (32..64 bytes, from a secret store).
  const std::string secret(32, 'k');
  LoopbackOptions loopback;
  loopback.peer_secret = secret;
  KVTIER_ASSIGN_OR_RETURN(auto prefill_t,
                          create_loopback_transport({"prefill-0", layout.fingerprint(), 1, 0}, loopback));
  KVTIER_ASSIGN_OR_RETURN(auto decode_t, create_loopback_transport({"decode-0", layout.fingerprint(), 1, 0}, loopback));
  PdOptions options;
  options.heartbeat = 100ms;
  options.lease = 1000ms;
  KVTIER_ASSIGN_OR_RETURN(auto prefill, PdPrefill::create(*prefill_t, prefill_kv.space, options));
  KVTIER_ASSIGN_OR_RETURN(auto decode, PdDecode::create(*decode_t, decode_kv.space, options));

  // The metadata exchange (out of band between two processes).
  KVTIER_ASSIGN_OR_RETURN(auto prefill_blob, prefill_t->export_metadata());
  KVTIER_ASSIGN_OR_RETURN(auto decode_blob, decode_t->export_metadata());
  KVTIER_ASSIGN_OR_RETURN(PeerId prefill_peer, decode_t->load_peer(prefill_blob));
  KVTIER_ASSIGN_OR_RETURN(PeerId decode_peer, prefill_t->load_peer(decode_blob));

  // The decode side starts the transfer into its destination blocks; the prefill declares its source blocks and
  // each layer as its forward finishes it (here at once).
  const TransferId id = 1;
  KVTIER_RETURN_IF_ERROR(decode->start(prefill_peer, id, mode, dst));
  KVTIER_RETURN_IF_ERROR(prefill->begin(decode_peer, id, src));
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l) KVTIER_RETURN_IF_ERROR(prefill->layer_ready(id, l));

  // The decode's forward: layer by layer, attention may read a layer once it is loaded (verified).
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l) {
    KVTIER_ASSIGN_OR_RETURN(LayerState s, decode->wait_layer(id, l, 5s));
    if (s != LayerState::kLoaded) return DataLoss("layer " + std::to_string(l) + " did not load");
  }
  KVTIER_ASSIGN_OR_RETURN(DecodeStatus ds, decode->wait(id, 10s, /*reclaimable=*/true));
  KVTIER_RETURN_IF_ERROR(ds.error);
  std::printf("%s: %u of %zu blocks loaded and verified\n", mode == PdMode::kPush ? "push" : "pull",
              ds.leading_loaded_blocks(), dst.size());
  KVTIER_RETURN_IF_ERROR(prefill->wait(id, 10s).status());
  KVTIER_RETURN_IF_ERROR(prefill->forget(id));
  KVTIER_RETURN_IF_ERROR(decode->forget(id));

  // Byte-exact, and nothing but the destination blocks written.
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (std::uint32_t r = 0; r < 2; ++r)
      for (std::size_t k = 0; k < src.size(); ++k)
        if (std::memcmp(decode_kv.space.block_ptr(l, r, dst[k]), prefill_kv.space.block_ptr(l, r, src[k]), 4096) != 0)
          return DataLoss("layer " + std::to_string(l) + " block " + std::to_string(dst[k]) + " differs");
  if (decode_kv.space.block_ptr(0, 0, 0)[0] != std::byte{0xDB}) return DataLoss("a block outside the list changed");
  return Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  const char* mode_arg = argc > 1 ? argv[1] : "push";
  if (argc > 2 || (std::strcmp(mode_arg, "push") != 0 && std::strcmp(mode_arg, "pull") != 0)) {
    std::fprintf(stderr, "prefill_decode: mode '%s' is not 'push' or 'pull' (usage: prefill_decode [push|pull])\n",
                 mode_arg);
    return 2;
  }
  const Status st = run(std::strcmp(mode_arg, "pull") == 0 ? PdMode::kPull : PdMode::kPush);
  if (!st.ok()) {
    std::fprintf(stderr, "prefill_decode: %s\n", st.to_string().c_str());
    return 1;
  }
  return 0;
}
