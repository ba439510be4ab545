// Fuzzes the KV event batch decoder (metrics::decode_msgpack, what subscribers and
// kvtier.metrics.decode_kv_event_batch run on bytes off the wire) with arbitrary bytes.
//
// Invariants: every input returns a Result (no crash, no exception; memory in proportion to the
// items actually read, never to a header's count); a batch that decodes encodes again, in both
// encodings, to bytes that decode to the same events.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz/fuzz_util.h"
#include "kvtier/metrics/kv_events.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvtier::metrics;
  auto batch = decode_msgpack(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!batch.ok()) return 0;
  for (EventEncoding enc : {EventEncoding::kMap, EventEncoding::kArray}) {
    auto again = decode_msgpack(encode_msgpack(*batch, enc));
    KVTIER_FUZZ_CHECK(again.ok());
    // NaN timestamps compare unequal to themselves: compare the events and the rank.
    KVTIER_FUZZ_CHECK(again->events == batch->events);
    KVTIER_FUZZ_CHECK(again->data_parallel_rank == batch->data_parallel_rank);
  }
  return 0;
}
