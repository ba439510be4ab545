// A typed configuration table: every knob is declared once with its name,
// type, default and doc string, bound to a field of a typed config struct.
// Environment variables (KVTIER_<NAME>) and config files (name = value lines)
// are read only here, never with scattered getenv calls; `kvtier info` prints
// the effective values.
//
// Thread-safety: a ConfigTable is built and applied on one thread; the struct
// it fills is then an ordinary value.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "kvtier/core/status.h"

namespace kvtier {

struct KnobInfo {
  std::string name;     // e.g. "copy.sm_ctas_h2d"
  std::string env_var;  // e.g. "KVTIER_COPY_SM_CTAS_H2D"
  std::string type;     // "uint64", "bool", "string", "double", "int"
  std::string default_value;
  std::string value;  // current value
  std::string doc;
};

class ConfigTable {
 public:
  // Binds a knob to a field; the field's current value is its default.
  void add(std::string name, std::uint64_t* field, std::string doc);
  void add(std::string name, std::uint32_t* field, std::string doc);
  void add(std::string name, int* field, std::string doc);
  void add(std::string name, double* field, std::string doc);
  void add(std::string name, bool* field, std::string doc);
  void add(std::string name, std::string* field, std::string doc);

  // Sets one knob from text. Unknown name or unparsable value: InvalidArgument
  // naming both. Integers accept K/M/G suffixes (powers of 1024).
  Status set(std::string_view name, std::string_view value);
  // Applies every KVTIER_<NAME> variable present in `env` (name upper-cased,
  // '.' -> '_'). `env` is a list of "KEY=VALUE" strings (pass environ).
  Status apply_env(char** env);
  // Applies "name = value" lines; '#' starts a comment.
  Status apply_text(std::string_view text);

  std::vector<KnobInfo> describe() const;
  // Markdown table of every knob (docs and `kvtier info --config`).
  std::string markdown() const;

  static std::string env_var_for(std::string_view name);

 private:
  struct Knob {
    KnobInfo info;
    std::function<Status(std::string_view)> setter;
    std::function<std::string()> getter;
  };
  std::map<std::string, Knob, std::less<>> knobs_;
  void add_knob(std::string name, std::string type, std::string doc, std::function<Status(std::string_view)> setter,
                std::function<std::string()> getter);
};

// Parses "64K", "1M", "2G", "1234" (powers of 1024). InvalidArgument names the text.
Result<std::uint64_t> parse_size(std::string_view text);

}  // namespace kvtier
