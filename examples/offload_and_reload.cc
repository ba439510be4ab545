// Offload a prompt's KV blocks to pinned host memory, then reload them layer by layer while "the forward" waits
// for each layer on its stream: the TransferManager's main use, with kvtier's public API only.
//
//   offload_and_reload [--host]
//
// Runs on the first CUDA GPU when there is one, else (or with --host) on kvtier's host backend (device memory in
// RAM, streams as threads), so it runs in CI. Exit status 0 only when every reloaded byte equals what was offloaded.
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "kvtier/core/layout.h"
#include "kvtier/core/status.h"
#include "kvtier/device/cuda_device.h"
#include "kvtier/device/host_device.h"
#include "kvtier/transfer/registration.h"
#include "kvtier/transfer/transfer_manager.h"

namespace {

using namespace kvtier;

// The byte at offset i of block b of (layer l, role r): what the "prefill" wrote.
std::byte pattern(std::uint32_t l, std::uint32_t r, BlockId b, std::uint64_t i) {
  return static_cast<std::byte>((l * 131 + r * 71 + static_cast<std::uint32_t>(b) * 17 + i) & 0xff);
}

Status run(bool force_host) {
  // 1. A device: a CUDA GPU, or the host backend.
  std::unique_ptr<Device> device;
  if (!force_host && cuda_device_count() > 0) {
    KVTIER_ASSIGN_OR_RETURN(device, create_cuda_device(0));
  } else {
    KVTIER_ASSIGN_OR_RETURN(auto host, HostDevice::create());
    device = std::move(host);
  }
  KVTIER_ASSIGN_OR_RETURN(auto compute, device->create_stream({StreamPriority::kNormal, "forward"}));

  // 2. The model's KV layout (8 layers of GQA K and V, 16 tokens per block) and the engine's device cache: one
  //    region per (layer, role), as an engine allocates it.
  GqaShape shape;
  shape.num_layers = 8;
  shape.kv_heads = 2;
  shape.block_tokens = 16;
  shape.head_dim = 64;
  KVTIER_ASSIGN_OR_RETURN(KvLayout layout, KvLayout::gqa(shape));
  const std::uint64_t device_blocks = 64;
  std::vector<Buffer> regions;
  std::vector<std::vector<void*>> bases(layout.num_layers());
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
      KVTIER_ASSIGN_OR_RETURN(Buffer b, device->allocate_device(layout.block_bytes(l, r) * device_blocks));
      bases[l].push_back(b.data());
      regions.push_back(std::move(b));
    }
  KvCacheRegistration reg;
  KVTIER_ASSIGN_OR_RETURN(
      reg.device, BlockSpace::layer_first(MemoryKind::kDevice, device->ordinal(), layout, device_blocks, bases));
  reg.host.num_blocks = 256;  // kvtier allocates and pins the host tier
  KVTIER_ASSIGN_OR_RETURN(auto tm, TransferManager::create(*device, *compute, std::move(reg)));
  const BlockSpace& space = tm->device_space();

  // 3. The prompt's blocks 3..10 hold its KV (written by the "prefill"; here from the host).
  std::vector<BlockId> prompt(8), host(8);
  std::iota(prompt.begin(), prompt.end(), 3);
  std::iota(host.begin(), host.end(), 100);
  auto write_blocks = [&](const std::vector<BlockId>& blocks, bool poison) -> Status {
    for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
      for (std::uint32_t r = 0; r < layout.num_roles(l); ++r)
        for (BlockId b : blocks) {
          std::vector<std::byte> bytes(layout.block_bytes(l, r));
          for (std::uint64_t i = 0; i < bytes.size(); ++i) bytes[i] = poison ? std::byte{0xDB} : pattern(l, r, b, i);
          KVTIER_RETURN_IF_ERROR(device->memcpy_sync(space.block_ptr(l, r, b), bytes.data(), bytes.size()));
        }
    return Status::Ok();
  };
  KVTIER_RETURN_IF_ERROR(write_blocks(prompt, false));

  // 4. Offload them to host blocks 100..107 (after the work on the compute stream), and wait.
  KVTIER_ASSIGN_OR_RETURN(TaskId evict, tm->evict_to_host_async(prompt, host, {}));
  KVTIER_RETURN_IF_ERROR(tm->wait(evict, std::chrono::seconds(30)));
  std::printf("offloaded %zu blocks of %u layers\n", prompt.size(), layout.num_layers());

  // 5. The device blocks are reused (poisoned here); later the prompt comes back into blocks 20..27 (poisoned
  //    too), layer by layer.
  std::vector<BlockId> reload(8);
  std::iota(reload.begin(), reload.end(), 20);
  KVTIER_RETURN_IF_ERROR(write_blocks(prompt, true));
  KVTIER_RETURN_IF_ERROR(write_blocks(reload, true));
  LoadOptions options;
  options.on_layer = [](std::uint32_t layer, const Status& st) {
    std::printf("  layer %u %s\n", layer, st.ok() ? "loaded" : st.to_string().c_str());
  };
  KVTIER_ASSIGN_OR_RETURN(TaskId load, tm->load_layers_to_device_async({}, host, reload, std::move(options)));

  // 6. The forward: before layer l's attention, its stream waits for the layer on the device (no host block).
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l) {
    KVTIER_RETURN_IF_ERROR(tm->wait_for_layer(load, l, *compute));
    // ... the layer's kernels would be enqueued on `compute` here ...
  }
  KVTIER_RETURN_IF_ERROR(device->synchronize(*compute, std::chrono::seconds(30)));
  KVTIER_RETURN_IF_ERROR(tm->wait(load, std::chrono::seconds(30)));  // the load's status: OK or the copy's error

  // 7. Every byte came back.
  std::uint64_t checked = 0;
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r)
      for (std::size_t i = 0; i < reload.size(); ++i) {
        std::vector<std::byte> got(layout.block_bytes(l, r));
        KVTIER_RETURN_IF_ERROR(device->memcpy_sync(got.data(), space.block_ptr(l, r, reload[i]), got.size()));
        for (std::uint64_t k = 0; k < got.size(); ++k)
          if (got[k] != pattern(l, r, prompt[i], k))
            return DataLoss("layer " + std::to_string(l) + " block " + std::to_string(reload[i]) + " byte " +
                            std::to_string(k) + " differs from what was offloaded");
        checked += got.size();
      }
  std::printf("reloaded and checked %llu bytes on the %s backend\n", static_cast<unsigned long long>(checked),
              std::string(backend_name(device->backend())).c_str());
  return tm->shutdown();
}

}  // namespace

int main(int argc, char** argv) {
  const bool force_host = argc > 1 && std::strcmp(argv[1], "--host") == 0;
  const Status st = run(force_host);
  if (!st.ok()) {
    std::fprintf(stderr, "offload_and_reload: %s\n", st.to_string().c_str());
    return 1;
  }
  return 0;
}
