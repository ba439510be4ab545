#include "kvtier/storage/storage_tier.h"

#include <fmt/format.h>

#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>

#include "storage/object_format.h"
#include "storage/storage_tier_metrics.h"

namespace kvtier::storage {

StorageOptions StorageTier::storage_options(const KvLayout& layout, std::string ns) {
  return format::options_for_layout(std::move(ns), layout, 1);
}

StorageTier::StorageTier(std::unique_ptr<StorageBackend> backend, BlockSpace host, std::uint32_t rank)
    : backend_(std::move(backend)), host_(std::move(host)), rank_(rank) {
  object_bytes_ = host_.layout().total_block_bytes();
}

Result<std::unique_ptr<StorageTier>> StorageTier::create(std::unique_ptr<StorageBackend> backend, BlockSpace host,
                                                         std::uint32_t rank) {
  if (!backend) return InvalidArgument("StorageTier: null backend");
  if (host.kind() != MemoryKind::kPinnedHost)
    return InvalidArgument(
        fmt::format("StorageTier: host space is {} memory, need pinned host", memory_kind_name(host.kind())));
  const StorageOptions want = storage_options(host.layout(), backend->options().ns);
  const StorageOptions& have = backend->options();
  bool roles_equal = have.roles.size() == want.roles.size();
  for (std::size_t i = 0; roles_equal && i < want.roles.size(); ++i)
    roles_equal = have.roles[i].layer == want.roles[i].layer && have.roles[i].role == want.roles[i].role &&
                  have.roles[i].dtype == want.roles[i].dtype && have.roles[i].offset == want.roles[i].offset &&
                  have.roles[i].bytes == want.roles[i].bytes;
  if (have.layout_fingerprint != want.layout_fingerprint || !roles_equal)
    return InvalidArgument(
        fmt::format("StorageTier: backend options (fingerprint {:#018x}, {} roles) do not match the host layout "
                    "(fingerprint {:#018x}, {} roles); create the backend with StorageTier::storage_options()",
                    have.layout_fingerprint, have.roles.size(), want.layout_fingerprint, want.roles.size()));
  std::unique_ptr<StorageTier> t(new StorageTier(std::move(backend), std::move(host), rank));
  // Zero-copy when every role sits at its packed offset inside one page.
  const BlockSpace& h = t->host_;
  bool packed = h.page_bytes() != 0 && h.num_blocks() > 0;
  if (packed) {
    std::uint32_t idx = 0;
    for (std::uint32_t l = 0; packed && l < h.layout().num_layers(); ++l)
      for (std::uint32_t r = 0; packed && r < h.layout().num_roles(l); ++r, ++idx)
        packed =
            h.plane(l, r).base == h.plane(0, 0).base + want.roles[idx].offset && h.plane(l, r).stride == h.page_bytes();
  }
  t->zero_copy_ = packed;
  if (packed) {
    KVTIER_RETURN_IF_ERROR(t->backend_->register_region(h.plane(0, 0).base, h.page_bytes() * h.num_blocks()));
  }
  return t;
}

Status StorageTier::check(std::span<const StorageKey> keys, std::span<const std::uint64_t> host_blocks) const {
  if (keys.size() != host_blocks.size())
    return InvalidArgument(fmt::format("{} keys but {} host blocks", keys.size(), host_blocks.size()));
  for (std::size_t i = 0; i < host_blocks.size(); ++i)
    if (host_blocks[i] >= host_.num_blocks())
      return OutOfRange(
          fmt::format("host block id {} >= num_blocks {} at index {}", host_blocks[i], host_.num_blocks(), i));
  return Status::Ok();
}

void StorageTier::gather(std::uint64_t block, std::byte* dst) const {
  const KvLayout& L = host_.layout();
  for (std::uint32_t l = 0; l < L.num_layers(); ++l)
    for (std::uint32_t r = 0; r < L.num_roles(l); ++r) {
      const std::uint64_t n = L.block_bytes(l, r);
      std::memcpy(dst, host_.block_ptr(l, r, block), n);
      dst += n;
    }
}

void StorageTier::scatter(const std::byte* src, std::uint64_t block) const {
  const KvLayout& L = host_.layout();
  for (std::uint32_t l = 0; l < L.num_layers(); ++l)
    for (std::uint32_t r = 0; r < L.num_roles(l); ++r) {
      const std::uint64_t n = L.block_bytes(l, r);
      std::memcpy(host_.block_ptr(l, r, block), src, n);
      src += n;
    }
}

// The staging of a batch whose host blocks are not packed page-first: one object per key. Its size comes from the
// caller's key count (repeats allowed): a product that wraps or memory that cannot be had is an error, not an
// exception out of the API (a read of 4,096 keys of 1 GiB objects aborted the process).
Status StorageTier::size_staging(StorageTierOp& op, std::size_t keys, const char* what) const {
  // More objects than the host space has blocks can only be repeats, and would stage more than the space holds.
  if (keys > host_.num_blocks())
    return InvalidArgument(
        fmt::format("storage tier {}: {} keys in one staged batch, more than the host space's {} "
                    "blocks",
                    what, keys, host_.num_blocks()));
  if (keys != 0 && object_bytes_ > SIZE_MAX / keys)
    return ResourceExhausted(fmt::format("storage tier {}: staging {} objects of {} bytes overflows the address space",
                                         what, keys, object_bytes_));
  try {
    op.staging_.resize(object_bytes_ * keys);
  } catch (const std::bad_alloc&) {
    return ResourceExhausted(
        fmt::format("storage tier {}: cannot allocate {} bytes of staging for {} objects of {} "
                    "bytes (post fewer keys at once)",
                    what, object_bytes_ * keys, keys, object_bytes_));
  } catch (const std::length_error&) {
    return ResourceExhausted(fmt::format("storage tier {}: staging {} objects of {} bytes exceeds a vector's limit",
                                         what, keys, object_bytes_));
  }
  return Status::Ok();
}

Result<StorageTierOp> StorageTier::write(std::span<const StorageKey> keys, std::span<const std::uint64_t> host_blocks) {
  KVTIER_RETURN_IF_ERROR(check(keys, host_blocks));
  StorageTierOp op;
  op.tier_ = this;
  op.op_ = StorageOp::kPut;
  op.blocks_.assign(host_blocks.begin(), host_blocks.end());
  op.staged_ = !zero_copy_;
  if (op.staged_) KVTIER_RETURN_IF_ERROR(size_staging(op, keys.size(), "write"));
  StorageBatch b;
  b.op = StorageOp::kPut;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    void* src = host_.block_ptr(0, 0, host_blocks[i]);
    if (op.staged_) {
      src = op.staging_.data() + i * object_bytes_;
      gather(host_blocks[i], static_cast<std::byte*>(src));
    }
    b.items.push_back({with_rank(keys[i]), src, object_bytes_});
  }
  op.posted_ = std::chrono::steady_clock::now();
  KVTIER_ASSIGN_OR_RETURN(op.ticket_, backend_->post(std::move(b)));
  return op;
}

Result<StorageTierOp> StorageTier::read(std::span<const StorageKey> keys, std::span<const std::uint64_t> host_blocks) {
  KVTIER_RETURN_IF_ERROR(check(keys, host_blocks));
  StorageTierOp op;
  op.tier_ = this;
  op.op_ = StorageOp::kGet;
  op.blocks_.assign(host_blocks.begin(), host_blocks.end());
  op.staged_ = !zero_copy_;
  if (op.staged_) KVTIER_RETURN_IF_ERROR(size_staging(op, keys.size(), "read"));
  StorageBatch b;
  b.op = StorageOp::kGet;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    void* dst = op.staged_ ? static_cast<void*>(op.staging_.data() + i * object_bytes_)
                           : static_cast<void*>(host_.block_ptr(0, 0, host_blocks[i]));
    b.items.push_back({with_rank(keys[i]), dst, object_bytes_});
  }
  op.posted_ = std::chrono::steady_clock::now();
  KVTIER_ASSIGN_OR_RETURN(op.ticket_, backend_->post(std::move(b)));
  return op;
}

Result<StorageTierOp> StorageTier::exists(std::span<const StorageKey> keys) {
  StorageTierOp op;
  op.tier_ = this;
  op.op_ = StorageOp::kExists;
  op.blocks_.assign(keys.size(), 0);
  StorageBatch b;
  b.op = StorageOp::kExists;
  for (const auto& k : keys) b.items.push_back({with_rank(k), nullptr, 0});
  op.posted_ = std::chrono::steady_clock::now();
  KVTIER_ASSIGN_OR_RETURN(op.ticket_, backend_->post(std::move(b)));
  return op;
}

Result<StorageTierOp> StorageTier::remove(std::span<const StorageKey> keys) {
  StorageTierOp op;
  op.tier_ = this;
  op.op_ = StorageOp::kDelete;
  op.blocks_.assign(keys.size(), 0);
  StorageBatch b;
  b.op = StorageOp::kDelete;
  for (const auto& k : keys) b.items.push_back({with_rank(k), nullptr, 0});
  op.posted_ = std::chrono::steady_clock::now();
  KVTIER_ASSIGN_OR_RETURN(op.ticket_, backend_->post(std::move(b)));
  return op;
}

bool StorageTierOp::poll() {
  if (finished_) return true;
  if (!ticket_.poll()) return false;
  const auto results = ticket_.results();
  statuses_.clear();
  for (std::size_t i = 0; i < results.size(); ++i) {
    Status st = results[i].status;
    if (st.ok() && op_ == StorageOp::kGet && results[i].bytes != tier_->object_bytes_)
      st = DataLoss(
          fmt::format("block {}: object of {} bytes, layout needs {}", i, results[i].bytes, tier_->object_bytes_));
    if (st.ok() && op_ == StorageOp::kGet && staged_)
      tier_->scatter(staging_.data() + i * tier_->object_bytes_, blocks_[i]);
    statuses_.push_back(std::move(st));
  }
  staging_.clear();
  staging_.shrink_to_fit();
  finished_ = true;
  if (StorageTierMetrics* m = tier_->metrics_.load(std::memory_order_acquire)) record_metrics(*m, *this);
  return true;
}

Status StorageTierOp::wait(std::chrono::milliseconds timeout) {
  if (!ticket_.valid()) return InvalidArgument("wait on an empty StorageTierOp");
  KVTIER_RETURN_IF_ERROR(ticket_.wait(timeout));
  poll();
  return Status::Ok();
}

Status StorageTierOp::status(std::size_t i) const {
  if (!finished_) return FailedPrecondition("StorageTierOp not finished; poll() first");
  if (i >= statuses_.size()) return OutOfRange(fmt::format("block index {} >= {}", i, statuses_.size()));
  return statuses_[i];
}

std::size_t StorageTierOp::ok_prefix() const {
  std::size_t n = 0;
  while (n < statuses_.size() && statuses_[n].ok()) ++n;
  return n;
}

}  // namespace kvtier::storage
