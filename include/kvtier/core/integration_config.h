// Knobs of the engine integrations of the Python package (kvtier.fastdeploy) and of its process-wide
// metrics switch: declared here, in the one config table, so that `kvtier info --config` lists them, a bad
// value is rejected naming it, and the Python side reads them through the table (kvtier._native) instead of
// the environment. Defaults and meanings: the doc strings below (docs/configuration.md).
//
// Thread-safety: as ConfigTable: bind and apply on one thread; the struct is then a plain value.
#pragma once

#include <string>

#include "kvtier/core/config.h"

namespace kvtier {

struct IntegrationConfig {
  // kvtier.fastdeploy.CacheTransferManager
  std::string fastdeploy_backend = "auto";  // auto | host | cuda
  bool fastdeploy_fence_evictions = true;
  double fastdeploy_sync_timeout_s = 300;
  // kvtier.fastdeploy.create_transfer_connector
  std::string fastdeploy_pd_role;    // empty: the engine's splitwise_role
  std::string fastdeploy_pd_secret;  // hex; never printed
  std::string fastdeploy_pd_transport = "ipc";
  std::string fastdeploy_pd_tls = "auto";  // auto: tcp with ucx, none otherwise
  std::string fastdeploy_pd_net_devices;
  // The process registry of kvtier.metrics: attach managers the integrations create.
  bool metrics = true;
};

// Binds fastdeploy.* (KVTIER_FASTDEPLOY_*) and metrics (KVTIER_METRICS).
void bind_integration_config(ConfigTable& table, IntegrationConfig& config);

}  // namespace kvtier
