// A typed configuration table: every knob is declared once with its name,
// type, default and doc string, bound to a field of a typed config struct.
// Environment variables (KVTIER_<NAME>) and config files (name = value lines)
// are read only here, never with scattered getenv calls; `kvtier info` prints
// the effective values.
//
// Thread-safety: a ConfigTable is built and applied on one thread; the struct
// it fills is then an ordinary value.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <ratio>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvtier/core/status.h"

namespace kvtier {

struct KnobInfo {
  std::string name;     // e.g. "copy.sm_ctas_h2d"
  std::string env_var;  // e.g. "KVTIER_COPY_SM_CTAS_H2D"
  // "uint64", "uint32", "uint32 [min, max]" (", multiple of m"), "int", "double", "double [min, max]", "bool",
  // "string", "octal mode", "duration (<unit>)" or "enum: a, b, c".
  std::string type;
  std::string default_value;
  std::string value;  // current value
  std::string doc;
};

// The table keeps pointers to the bound fields: the bound struct must stay
// where it is (not moved or destroyed) while the table is used.
class ConfigTable {
 public:
  // Binds a knob to a field; the field's current value is its default.
  void add(std::string name, std::uint64_t* field, std::string doc);
  void add(std::string name, std::uint32_t* field, std::string doc);
  // A uint32 knob limited to [min, max] and, with multiple_of > 1, to that number's multiples: a value the knob's
  // consumer would refuse is refused where it is set, naming the knob (and its variable), not later by its field.
  void add(std::string name, std::uint32_t* field, std::string doc, std::uint32_t min, std::uint32_t max,
           std::uint32_t multiple_of = 1);
  void add(std::string name, int* field, std::string doc);
  // Permission bits, written in octal with a leading 0 ("0600", "0o600"; at most 0777). Read as a plain
  // integer, "0440" was decimal 440, i.e. 0670: group-writable files from a value meant owner-only; a bare number
  // (once this knob's decimal form) is refused rather than read either way.
  void add_mode(std::string name, std::uint32_t* field, std::string doc);
  void add(std::string name, double* field, std::string doc);
  // A double knob limited to [min, max] (NaN rejected).
  void add(std::string name, double* field, std::string doc, double min, double max);
  void add(std::string name, bool* field, std::string doc);
  void add(std::string name, std::string* field, std::string doc);
  // A string knob whose values are checked by `validate` (its error should
  // name the value); the field is left unchanged on error.
  void add(std::string name, std::string* field, std::string doc, std::function<Status(std::string_view)> validate);
  // A string knob holding a secret: describe() and markdown() show "(set)" or nothing, and set()'s errors
  // leave the value out (so should `validate`'s).
  void add_secret(std::string name, std::string* field, std::string doc,
                  std::function<Status(std::string_view)> validate);

  // A std::chrono duration knob (ns, us, ms or s resolution). Accepts an
  // integer with a unit suffix (ns, us, ms, s; "50us", "2 s") or a bare
  // integer in the field's own unit; values that are not a whole number of
  // that unit, negative or overflowing are rejected. Printed as "<n><unit>".
  template <typename Rep, typename Period>
  void add(std::string name, std::chrono::duration<Rep, Period>* field, std::string doc) {
    static_assert(std::is_integral_v<Rep> && std::is_signed_v<Rep>, "duration knobs need a signed integer Rep");
    static_assert(std::ratio_equal_v<Period, std::nano> || std::ratio_equal_v<Period, std::micro> ||
                      std::ratio_equal_v<Period, std::milli> || std::ratio_equal_v<Period, std::ratio<1>>,
                  "duration knobs have ns, us, ms or s resolution");
    using Dur = std::chrono::duration<Rep, Period>;
    const std::int64_t unit_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Dur(1)).count();
    add_duration(
        std::move(name), std::move(doc), unit_ns,
        [field](std::int64_t count) -> Status {
          if (count > static_cast<std::int64_t>(std::numeric_limits<Rep>::max())) return out_of_range(count);
          *field = Dur(static_cast<Rep>(count));
          return Status::Ok();
        },
        [field] { return static_cast<std::int64_t>(field->count()); });
  }

  // An enum knob. `parse(text) -> Result<E>` (its error should list the
  // accepted names) and `format(E) -> string_view` are the enum's own name
  // functions (e.g. parse_copy_strategy / copy_strategy_name); `values`, the
  // values to list in the knob's type (documentation only: anything `parse`
  // accepts is accepted).
  template <typename E, typename Parse, typename Format>
  void add_enum(std::string name, E* field, Parse parse, Format format, const std::vector<E>& values, std::string doc) {
    static_assert(std::is_enum_v<E>, "add_enum binds an enum field");
    std::string type = "enum:";
    const char* sep = " ";
    for (E v : values) {
      type += sep;
      type += std::string_view(format(v));
      sep = ", ";
    }
    add_knob(
        std::move(name), std::move(type), std::move(doc),
        [field, parse](std::string_view v) -> Status {
          auto r = parse(trim_text(v));
          if (!r.ok()) return r.status();
          *field = *r;
          return Status::Ok();
        },
        [field, format] { return std::string(std::string_view(format(*field))); });
  }

  // Sets one knob from text. Unknown name or unparsable value: InvalidArgument
  // naming both. Integers accept K/M/G suffixes (powers of 1024).
  Status set(std::string_view name, std::string_view value);
  // Applies every KVTIER_<NAME> variable present in `env` (name upper-cased,
  // '.' -> '_'). `env` is a list of "KEY=VALUE" strings (pass environ).
  Status apply_env(char** env);
  // Applies "name = value" lines; '#' starts a comment.
  Status apply_text(std::string_view text);
  // The variables of `env` that look meant for this table but name none of its knobs (apply_env ignores
  // them, so a misspelt one would change nothing, silently): KVTIER_* names whose family (KVTIER_<WORD>_, e.g.
  // KVTIER_CACHE_) is one of its knobs' families, and others near a knob's variable or extending one
  // (KVTIER_METRIC, KVTIER_METRICS_ON for KVTIER_METRICS; other KVTIER_* names are left alone: scripts and tests
  // have their own). One message per variable, naming it and, when one is near, the knob variable it probably
  // meant. Callers log them; apply_env does not (the log reads its own level
  // through a table).
  std::vector<std::string> unrecognized_env(char* const* env) const;

  std::vector<KnobInfo> describe() const;
  // Markdown table of every knob (docs and `kvtier info --config`).
  std::string markdown() const;

  static std::string env_var_for(std::string_view name);

 private:
  struct Knob {
    KnobInfo info;
    std::function<Status(std::string_view)> setter;
    std::function<std::string()> getter;
    bool secret = false;
  };
  std::map<std::string, Knob, std::less<>> knobs_;
  void add_knob(std::string name, std::string type, std::string doc, std::function<Status(std::string_view)> setter,
                std::function<std::string()> getter);
  // unit_ns: the field's unit in nanoseconds (1, 1000, 1000000 or 1000000000).
  void add_duration(std::string name, std::string doc, std::int64_t unit_ns,
                    std::function<Status(std::int64_t)> set_count, std::function<std::int64_t()> get_count);
  static std::string_view trim_text(std::string_view s);
  static Status out_of_range(std::int64_t count);
};

// Parses "64K", "1M", "2G", "1234" (powers of 1024). InvalidArgument names the text.
Result<std::uint64_t> parse_size(std::string_view text);

// Parses a non-negative duration for a field whose unit is `unit_ns`
// nanoseconds: "50us", "2 ms", "60s", "5ns", or a bare integer in that unit.
// Returns the count of units; InvalidArgument names the text (unknown suffix,
// not a whole number of units, overflow).
Result<std::int64_t> parse_duration(std::string_view text, std::int64_t unit_ns);

}  // namespace kvtier
