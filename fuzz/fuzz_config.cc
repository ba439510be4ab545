// Fuzzes the configuration parsers: ConfigTable::apply_text (config files: "name = value"
// lines) and apply_env (KVTIER_<NAME>=value variables), over every knob of the library
// (cache::ConfigKnobs, what `kvtier info --config` lists), then reads every knob back; also
// parse_size and parse_duration on the raw text.
//
// Input: one control byte, then the text. Bit 0: environment (one variable a line) instead of a
// config file; bits 1-2: the unit parse_duration is asked for (ns, us, ms, s).
// Invariants: every call returns a Status (no exception, no crash); a knob set without error
// prints back a value that sets it again without error.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz/fuzz_util.h"
#include "kvtier/cache/config_knobs.h"
#include "kvtier/core/config.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvtier;
  if (size < 1) return 0;
  const std::uint8_t ctl = data[0];
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  cache::ConfigKnobs c;  // every knob of the library, fresh defaults per input
  Status st;
  if (ctl & 1) {
    std::vector<std::string> lines;
    for (std::size_t pos = 0; pos <= text.size();) {
      const std::size_t nl = std::min(text.find('\n', pos), text.size());
      lines.emplace_back(text.c_str() + pos);  // up to a NUL, as environ holds C strings
      lines.back().resize(std::min(lines.back().size(), nl - pos));
      pos = nl + 1;
    }
    std::vector<char*> env;
    for (auto& l : lines) env.push_back(l.data());
    env.push_back(nullptr);
    st = c.table.apply_env(env.data());
  } else {
    st = c.table.apply_text(text);
  }
  st.ignore_error();  // most inputs are invalid; what is checked is below
  // What the table prints is what it accepts back (a secret is printed as "(set)", never itself).
  for (const KnobInfo& k : c.table.describe()) {
    if (k.type == "string (secret)") continue;
    Status again = c.table.set(k.name, k.value);
    if (!again.ok()) {
      std::fprintf(stderr, "knob %s printed '%s', which it refuses: %s\n", k.name.c_str(), k.value.c_str(),
                   again.to_string().c_str());
      KVTIER_FUZZ_CHECK(again.ok());
    }
  }
  static constexpr std::int64_t kUnits[4] = {1, 1000, 1000000, 1000000000};
  // Only that they return (no crash, no sanitizer report) is checked, not what.
  parse_size(text).ignore_error();
  parse_duration(text, kUnits[(ctl >> 1) & 3]).ignore_error();
  return 0;
}
