// TransferManager on a real GPU: thousands of random interleaved
// evict / load / reuse operations, with compute-stream reads after
// wait_for_layer, byte-exact against the CPU model (tests/transfer/transfer_model.h).
// Skipped where no GPU is visible. Performance targets are measured by
// `kvtier bench transfer`, not asserted here.
#include <gtest/gtest.h>

#include "kvtier/device/cuda_device.h"
#include "transfer/transfer_model.h"

namespace kvtier {
namespace {

std::unique_ptr<Device> open_gpu() {
  if (cuda_device_count() == 0) return nullptr;
  auto d = create_cuda_device(0);
  if (!d.ok()) return nullptr;
  return std::move(d).value();
}

transfer_test::RigOptions options(KvLayout layout, CopyStrategy strategy, std::uint32_t dev_blocks,
                                  std::uint32_t host_blocks) {
  transfer_test::RigOptions o;
  o.layout = std::move(layout);
  o.device_blocks = dev_blocks;
  o.host_blocks = host_blocks;
  o.config.evict_strategy = strategy;
  o.config.load_strategy = strategy;
  o.arena_bytes = 256u << 20;
  return o;
}

KvLayout gqa_layout() {
  GqaShape s;
  s.num_layers = 8;
  s.num_draft_layers = 1;
  s.kv_heads = 2;
  s.block_tokens = 16;
  s.head_dim = 64;  // 4 KiB per (layer, role, block)
  s.fp8_scales = true;
  s.dtype = DType::kFp8E4M3;
  return *KvLayout::gqa(s);
}

KvLayout mla_layout() {
  MlaShape s;
  s.num_layers = 6;
  s.block_tokens = 64;
  s.latent_dim = 576;  // 72 KiB
  s.indexer_dim = 128;
  return *KvLayout::mla(s);
}

TEST(TransferGpu, RandomInterleavedGqaAuto) {
  auto dev = open_gpu();
  if (!dev) GTEST_SKIP() << "no CUDA device";
  transfer_test::RandomOptions ro;
  ro.ops = 4000;
  ro.phase_ops = 200;
  ro.max_pairs = 8;
  ro.seed = 101;
  transfer_test::run_random_interleaving(*dev, options(gqa_layout(), CopyStrategy::kAuto, 96, 128), ro);
}

TEST(TransferGpu, RandomInterleavedEveryStrategy) {
  auto dev = open_gpu();
  if (!dev) GTEST_SKIP() << "no CUDA device";
  for (CopyStrategy s : {CopyStrategy::kDmaPerRun, CopyStrategy::kDmaBatch, CopyStrategy::kSmKernel}) {
    SCOPED_TRACE(std::string(copy_strategy_name(s)));
    transfer_test::RandomOptions ro;
    ro.ops = 1500;
    ro.phase_ops = 150;
    ro.max_pairs = 8;
    ro.seed = 200 + static_cast<int>(s);
    transfer_test::run_random_interleaving(*dev, options(gqa_layout(), s, 64, 96), ro);
  }
}

TEST(TransferGpu, RandomInterleavedMla) {
  auto dev = open_gpu();
  if (!dev) GTEST_SKIP() << "no CUDA device";
  transfer_test::RandomOptions ro;
  ro.ops = 2000;
  ro.phase_ops = 100;
  ro.max_pairs = 6;
  ro.seed = 303;
  transfer_test::run_random_interleaving(*dev, options(mla_layout(), CopyStrategy::kAuto, 48, 64), ro);
}

// The engine's patterns (decode steps with per-layer declared writes during
// loads, reuse right after submission, callbacks waiting for other tasks,
// shutdown with work in flight) at length on the GPU.
TEST(TransferGpu, RandomInterleavedEnginePatternsLong) {
  auto dev = open_gpu();
  if (!dev) GTEST_SKIP() << "no CUDA device";
  transfer_test::RandomOptions ro;
  ro.ops = 20000;
  ro.phase_ops = 400;
  ro.max_pairs = 8;
  ro.seed = 91;
  ro.engine_patterns = true;
  ro.shutdown_in_flight = true;
  transfer_test::run_random_interleaving(*dev, options(gqa_layout(), CopyStrategy::kAuto, 96, 128), ro);
}

}  // namespace
}  // namespace kvtier
