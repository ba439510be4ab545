// Fuzzes the Mooncake trace reader of `kvtier replay` (cache::load_mooncake_trace): the input is
// written to a file and read as a trace, whole and with a request limit. Invariants: it returns
// (a Result, never an exception or a crash); a trace read with a limit holds at most that many
// requests and is a prefix of the whole trace.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/fuzz_util.h"
#include "sim/replay.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvtier;
  using namespace kvtier::fuzz;
  static storage::testing::TempDir* dir = new storage::testing::TempDir();
  static const std::string path = dir->path() + "/trace.jsonl";
  KVTIER_FUZZ_CHECK(write_file(path, data, size));
  auto all = cache::load_mooncake_trace(path);
  auto some = cache::load_mooncake_trace(path, 2);
  if (all.ok()) {
    KVTIER_FUZZ_CHECK(some.ok() && some->size() <= 2 && some->size() <= all->size());
    for (std::size_t i = 0; i < some->size(); ++i) {
      KVTIER_FUZZ_CHECK((*some)[i].timestamp_ms == (*all)[i].timestamp_ms);
      KVTIER_FUZZ_CHECK((*some)[i].hash_ids == (*all)[i].hash_ids);
    }
  } else {
    some.status().ignore_error();  // a limited read may stop before the line that fails the whole trace
  }
  return 0;
}
