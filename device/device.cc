#include "kvtier/backend/device.h"

#include <fmt/format.h>

#include <atomic>
#include <memory>

#include "kvtier/core/enum_names.h"

namespace kvtier {
namespace {
// Stream ids are process-wide and never reused, so that they can key maps
// that outlive a stream (stats, hazard records).
std::atomic<std::uint64_t> g_next_stream_id{1};
}  // namespace

constexpr EnumName<BackendKind> kBackendEntries[] = {
    {BackendKind::kHost, "host"},
    {BackendKind::kCuda, "cuda"},
};
constexpr auto kBackendNames = enum_table("backend", kBackendEntries, "unknown");
std::string_view backend_name(BackendKind kind) noexcept { return kBackendNames.name(kind); }

Stream::Stream() : id_(g_next_stream_id.fetch_add(1, std::memory_order_relaxed)) {}

Result<std::unique_ptr<Stream>> Device::adopt_stream(void* native_handle, const std::string& name) {
  return NotSupported(
      fmt::format("adopt_stream('{}', handle {}): the {} backend has no native streams; use create_stream", name,
                  native_handle, backend_name(backend())));
}

Result<Buffer> Device::adopt_device_memory(void* data, std::uint64_t bytes) {
  if (data == nullptr) return InvalidArgument(fmt::format("adopt_device_memory: null pointer ({} bytes)", bytes));
  if (bytes == 0) return InvalidArgument(fmt::format("adopt_device_memory: 0 bytes at {}", data));
  if (reinterpret_cast<std::uintptr_t>(data) + bytes < reinterpret_cast<std::uintptr_t>(data))
    return InvalidArgument(fmt::format("adopt_device_memory: {} + {} bytes wraps around", data, bytes));
  return Buffer(data, bytes, MemoryKind::kDevice, [] {});
}

}  // namespace kvtier
