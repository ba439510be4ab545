// Prints the keys of the golden input, one hex key per line (run as a second process by cache_test).
#include <cstdio>

#include "kvtier/cache/block_key.h"
#include "tests/cache/key_fixture.h"

int main() {
  using namespace kvtier::cache;
  auto h = KeyHasher::create(testing::golden_namespace());
  if (!h.ok()) return 1;
  auto tokens = testing::golden_tokens();
  auto keys = h->keys_for(tokens);
  if (!keys.ok()) return 1;
  std::printf("%s\n", h->root().hex().c_str());
  for (const BlockKey& k : *keys) std::printf("%s\n", k.hex().c_str());
  return 0;
}
