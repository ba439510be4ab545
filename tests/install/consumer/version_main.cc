// Links the installed package and checks what it says of itself: the version header and a call into the library.
#include <cstdio>
#include <cstring>

#include "kvtier/cache/cache_manager.h"
#include "kvtier/version.h"

int main() {
  kvtier::cache::CacheConfig config;
  config.device_blocks = 8;
  auto cache = kvtier::cache::CacheManager::create(config);
  if (!cache.ok()) {
    std::fprintf(stderr, "CacheManager::create: %s\n", cache.status().to_string().c_str());
    return 1;
  }
  if (std::strcmp(KVTIER_VERSION_STRING, KVTIER_EXPECTED_VERSION) != 0) {
    std::fprintf(stderr, "version.h says %s, the build %s\n", KVTIER_VERSION_STRING, KVTIER_EXPECTED_VERSION);
    return 1;
  }
  std::printf("kvtier %s: a cache of %u device blocks\n", KVTIER_VERSION_STRING, (*cache)->stats().tiers[0].capacity);
  return 0;
}
