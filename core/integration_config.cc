#include "kvtier/core/integration_config.h"

#include <fmt/format.h>

#include <cctype>
#include <initializer_list>
#include <limits>
#include <string_view>

namespace kvtier {
namespace {

// A validator accepting exactly `names` (the error names the value and lists them).
std::function<Status(std::string_view)> one_of(std::initializer_list<std::string_view> names) {
  std::vector<std::string> accepted(names.begin(), names.end());
  return [accepted](std::string_view v) -> Status {
    std::string list;
    for (const std::string& a : accepted) {
      if (v == a) return Status::Ok();
      list += list.empty() ? "" : ", ";
      list += a.empty() ? "(empty)" : a;
    }
    return InvalidArgument(fmt::format("'{}' is not one of {}", v, list));
  };
}

// Checks hex without echoing it: the value is a secret. Empty (no secret), or the 32 to 64 bytes a peer secret
// needs (transport_base.h, check_peer_secret): a shorter one was accepted here and refused only when the first
// prefill/decode endpoint was made.
Status check_hex_secret(std::string_view v) {
  if (v.size() % 2 != 0) return InvalidArgument(fmt::format("not hex: an odd number ({}) of digits", v.size()));

  for (std::size_t i = 0; i < v.size(); ++i)
    if (!std::isxdigit(static_cast<unsigned char>(v[i])))
      return InvalidArgument(fmt::format("not hex: character {} is not a hex digit", i));
  if (!v.empty() && (v.size() < 64 || v.size() > 128))
    return InvalidArgument(fmt::format("{} hex digits ({} bytes); a peer secret needs 64 to 128 (32 to 64 bytes)",
                                       v.size(), v.size() / 2));
  return Status::Ok();
}

}  // namespace

void bind_integration_config(ConfigTable& t, IntegrationConfig& c) {
  t.add("fastdeploy.backend", &c.fastdeploy_backend,
        "kvtier.fastdeploy's device backend: auto (CUDA for CUDA tensors, host for CPU arrays), host or cuda",
        one_of({"auto", "host", "cuda"}));
  t.add("fastdeploy.fence_evictions", &c.fastdeploy_fence_evictions,
        "kvtier.fastdeploy: a load waits for evictions out of the blocks it overwrites (false: the engine fences "
        "reuse itself)");
  t.add("fastdeploy.sync_timeout", &c.fastdeploy_sync_timeout_s,
        "kvtier.fastdeploy: seconds sync_input_stream / sync_output_stream wait for each pending transfer", 0.0,
        std::numeric_limits<double>::infinity());
  t.add("fastdeploy.pd_role", &c.fastdeploy_pd_role,
        "kvtier.fastdeploy's P/D role: prefill, decode or mixed (no connector); empty: the engine's splitwise_role",
        one_of({"", "prefill", "decode", "mixed"}));
  t.add_secret("fastdeploy.pd_secret", &c.fastdeploy_pd_secret,
               "kvtier.fastdeploy's P/D peer secret in hex (32 to 64 bytes, the same on both sides); empty: none",
               check_hex_secret);
  t.add("fastdeploy.pd_transport", &c.fastdeploy_pd_transport,
        "kvtier.fastdeploy's P/D transport: ipc (same host), ucx or loopback (one process: tests)",
        one_of({"ipc", "ucx", "loopback"}));
  t.add("fastdeploy.pd_tls", &c.fastdeploy_pd_tls,
        "kvtier.fastdeploy's UCX transports (UCX_TLS), e.g. tcp or shm; auto: tcp with ucx, none otherwise");
  t.add("fastdeploy.pd_net_devices", &c.fastdeploy_pd_net_devices,
        "kvtier.fastdeploy's UCX network devices (UCX_NET_DEVICES), e.g. lo; empty: UCX's choice");
  t.add("metrics", &c.metrics,
        "attach the managers the engine integrations create to kvtier.metrics' process registry");
}

}  // namespace kvtier
