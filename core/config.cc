#include "kvtier/core/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstring>
#include <limits>

namespace kvtier {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

Result<bool> parse_bool(std::string_view t) {
  if (t == "1" || t == "true" || t == "on" || t == "yes") return true;
  if (t == "0" || t == "false" || t == "off" || t == "no") return false;
  return InvalidArgument(fmt::format("'{}' is not a boolean (true/false/1/0/on/off)", t));
}

}  // namespace

Result<std::uint64_t> parse_size(std::string_view text) {
  std::string_view t = trim(text);
  if (t.empty()) return InvalidArgument("empty size");
  std::uint64_t mult = 1;
  char last = static_cast<char>(std::toupper(static_cast<unsigned char>(t.back())));
  if (last == 'B' && t.size() > 1 && std::isalpha(static_cast<unsigned char>(t[t.size() - 2]))) {
    t.remove_suffix(1);  // "64KB"
    last = static_cast<char>(std::toupper(static_cast<unsigned char>(t.back())));
  }
  if (last == 'K') mult = 1ull << 10;
  if (last == 'M') mult = 1ull << 20;
  if (last == 'G') mult = 1ull << 30;
  if (last == 'T') mult = 1ull << 40;
  if (mult != 1) t.remove_suffix(1);
  std::uint64_t v = 0;
  auto [ptr, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (ec != std::errc() || ptr != t.data() + t.size())
    return InvalidArgument(fmt::format("'{}' is not a size (examples: 4096, 64K, 1M, 2G)", text));
  if (v > std::numeric_limits<std::uint64_t>::max() / mult)
    return InvalidArgument(fmt::format("size '{}' overflows 64 bits", text));
  return v * mult;
}

namespace {

struct DurationUnit {
  std::string_view suffix;
  std::int64_t ns;
};
constexpr DurationUnit kDurationUnits[] = {{"ns", 1}, {"us", 1000}, {"ms", 1000000}, {"s", 1000000000}};

std::string_view unit_suffix(std::int64_t unit_ns) {
  for (const DurationUnit& u : kDurationUnits)
    if (u.ns == unit_ns) return u.suffix;
  return {};
}

}  // namespace

Result<std::int64_t> parse_duration(std::string_view text, std::int64_t unit_ns) {
  const std::string_view field_unit = unit_suffix(unit_ns);
  if (field_unit.empty()) return InvalidArgument(fmt::format("unsupported duration unit of {} ns", unit_ns));
  std::string_view t = trim(text);
  std::size_t digits = 0;
  while (digits < t.size() && std::isdigit(static_cast<unsigned char>(t[digits]))) ++digits;
  const std::string_view suffix = trim(t.substr(digits));
  std::int64_t n = 0;
  auto [ptr, ec] = std::from_chars(t.data(), t.data() + digits, n);
  const DurationUnit* unit = nullptr;
  for (const DurationUnit& u : kDurationUnits)
    if (u.suffix == (suffix.empty() ? field_unit : suffix)) unit = &u;
  if (digits > 0 && unit != nullptr && ec == std::errc::result_out_of_range)
    return InvalidArgument(fmt::format("duration '{}' overflows", text));
  if (digits == 0 || unit == nullptr || ec != std::errc() || ptr != t.data() + digits) {
    return InvalidArgument(
        fmt::format("'{}' is not a duration (a non-negative integer with unit ns, us, ms or s, e.g. 50us, 2ms, 60s; "
                    "a bare integer is in {})",
                    text, field_unit));
  }
  // Units are powers of 1000, so one always divides the other.
  if (unit->ns >= unit_ns) {
    const std::int64_t mult = unit->ns / unit_ns;
    if (n > std::numeric_limits<std::int64_t>::max() / mult)
      return InvalidArgument(fmt::format("duration '{}' overflows", text));
    return n * mult;
  }
  const std::int64_t div = unit_ns / unit->ns;
  if (n % div != 0) return InvalidArgument(fmt::format("duration '{}' is not a whole number of {}", text, field_unit));
  return n / div;
}

std::string ConfigTable::env_var_for(std::string_view name) {
  std::string out = "KVTIER_";
  for (char c : name)
    out += (c == '.' || c == '-') ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

void ConfigTable::add_knob(std::string name, std::string type, std::string doc,
                           std::function<Status(std::string_view)> setter, std::function<std::string()> getter) {
  Knob k;
  k.info.name = name;
  k.info.env_var = env_var_for(name);
  k.info.type = std::move(type);
  k.info.default_value = getter();
  k.info.doc = std::move(doc);
  k.setter = std::move(setter);
  k.getter = std::move(getter);
  knobs_[std::move(name)] = std::move(k);
}

void ConfigTable::add(std::string name, std::uint64_t* field, std::string doc) {
  add_knob(
      std::move(name), "uint64", std::move(doc),
      [field](std::string_view v) -> Status {
        KVTIER_ASSIGN_OR_RETURN(*field, parse_size(v));
        return Status::Ok();
      },
      [field] { return std::to_string(*field); });
}

namespace {

// A uint32 knob's value: within [min, max] and a multiple of `multiple_of`.
Result<std::uint32_t> parse_u32(std::string_view v, std::uint32_t min, std::uint32_t max, std::uint32_t multiple_of) {
  KVTIER_ASSIGN_OR_RETURN(std::uint64_t x, parse_size(v));
  if (x > std::numeric_limits<std::uint32_t>::max())
    return InvalidArgument(fmt::format("{} does not fit in 32 bits", x));
  if (x < min || x > max) return InvalidArgument(fmt::format("{} is outside [{}, {}]", x, min, max));
  if (multiple_of > 1 && x % multiple_of != 0)
    return InvalidArgument(fmt::format("{} is not a multiple of {}", x, multiple_of));
  return static_cast<std::uint32_t>(x);
}

}  // namespace

void ConfigTable::add(std::string name, std::uint32_t* field, std::string doc) {
  add_knob(
      std::move(name), "uint32", std::move(doc),
      [field](std::string_view v) -> Status {
        KVTIER_ASSIGN_OR_RETURN(*field, parse_u32(v, 0, std::numeric_limits<std::uint32_t>::max(), 1));
        return Status::Ok();
      },
      [field] { return std::to_string(*field); });
}

void ConfigTable::add(std::string name, std::uint32_t* field, std::string doc, std::uint32_t min, std::uint32_t max,
                      std::uint32_t multiple_of) {
  std::string type = fmt::format("uint32 [{}, {}]", min, max);
  if (multiple_of > 1) type += fmt::format(", multiple of {}", multiple_of);
  add_knob(
      std::move(name), std::move(type), std::move(doc),
      [field, min, max, multiple_of](std::string_view v) -> Status {
        KVTIER_ASSIGN_OR_RETURN(*field, parse_u32(v, min, max, multiple_of));
        return Status::Ok();
      },
      [field] { return std::to_string(*field); });
}

void ConfigTable::add_mode(std::string name, std::uint32_t* field, std::string doc) {
  add_knob(
      std::move(name), "octal mode", std::move(doc),
      [field](std::string_view v) -> Status {
        v = trim(v);
        // Only with its octal marker: a bare number was this knob's decimal value before (416 meant 0640), and
        // read as octal now it would quietly grant other bits.
        const bool marked = v.starts_with("0o") || v.starts_with("0O") || v.starts_with("0");
        std::string_view digits = v.starts_with("0o") || v.starts_with("0O") ? v.substr(2) : v;
        std::uint32_t x = 0;
        bool octal = marked && !digits.empty() && digits.size() <= 4;
        for (const char c : digits) {
          octal = octal && c >= '0' && c <= '7';
          x = x * 8 + static_cast<std::uint32_t>(c - '0');
        }
        if (!octal || x > 0777)
          return InvalidArgument(
              fmt::format("'{}' is not permission bits in octal with a leading 0 (0000..0777, e.g. 0600 or 0o600)", v));
        *field = x;
        return Status::Ok();
      },
      [field] { return fmt::format("0{:o}", *field); });
}

void ConfigTable::add(std::string name, int* field, std::string doc) {
  add_knob(
      std::move(name), "int", std::move(doc),
      [field](std::string_view v) -> Status {
        v = trim(v);
        int x = 0;
        auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
        if (ec != std::errc() || ptr != v.data() + v.size())
          return InvalidArgument(fmt::format("'{}' is not an integer", v));
        *field = x;
        return Status::Ok();
      },
      [field] { return std::to_string(*field); });
}

void ConfigTable::add(std::string name, double* field, std::string doc) {
  add_knob(
      std::move(name), "double", std::move(doc),
      [field](std::string_view v) -> Status {
        std::string s(trim(v));
        char* end = nullptr;
        double x = std::strtod(s.c_str(), &end);
        if (s.empty() || end != s.c_str() + s.size()) return InvalidArgument(fmt::format("'{}' is not a number", v));
        *field = x;
        return Status::Ok();
      },
      [field] { return fmt::format("{}", *field); });
}

void ConfigTable::add(std::string name, double* field, std::string doc, double min, double max) {
  add_knob(
      std::move(name), fmt::format("double [{}, {}]", min, max), std::move(doc),
      [field, min, max](std::string_view v) -> Status {
        std::string s(trim(v));
        char* end = nullptr;
        double x = std::strtod(s.c_str(), &end);
        if (s.empty() || end != s.c_str() + s.size()) return InvalidArgument(fmt::format("'{}' is not a number", v));
        if (!(x >= min && x <= max)) return InvalidArgument(fmt::format("{} is outside [{}, {}]", s, min, max));
        *field = x;
        return Status::Ok();
      },
      [field] { return fmt::format("{}", *field); });
}

void ConfigTable::add(std::string name, bool* field, std::string doc) {
  add_knob(
      std::move(name), "bool", std::move(doc),
      [field](std::string_view v) -> Status {
        KVTIER_ASSIGN_OR_RETURN(*field, parse_bool(trim(v)));
        return Status::Ok();
      },
      [field] { return std::string(*field ? "true" : "false"); });
}

void ConfigTable::add(std::string name, std::string* field, std::string doc) {
  add_knob(
      std::move(name), "string", std::move(doc),
      [field](std::string_view v) -> Status {
        *field = std::string(trim(v));
        return Status::Ok();
      },
      [field] { return *field; });
}

void ConfigTable::add(std::string name, std::string* field, std::string doc,
                      std::function<Status(std::string_view)> validate) {
  add_knob(
      std::move(name), "string", std::move(doc),
      [field, validate = std::move(validate)](std::string_view v) -> Status {
        v = trim(v);
        KVTIER_RETURN_IF_ERROR(validate(v));
        *field = std::string(v);
        return Status::Ok();
      },
      [field] { return *field; });
}

void ConfigTable::add_secret(std::string name, std::string* field, std::string doc,
                             std::function<Status(std::string_view)> validate) {
  const std::string key = name;
  add_knob(
      std::move(name), "string (secret)", std::move(doc),
      [field, validate = std::move(validate)](std::string_view v) -> Status {
        v = trim(v);
        KVTIER_RETURN_IF_ERROR(validate(v));
        *field = std::string(v);
        return Status::Ok();
      },
      [field] { return std::string(field->empty() ? "" : "(set)"); });
  knobs_[key].secret = true;
}

void ConfigTable::add_duration(std::string name, std::string doc, std::int64_t unit_ns,
                               std::function<Status(std::int64_t)> set_count, std::function<std::int64_t()> get_count) {
  const std::string suffix(unit_suffix(unit_ns));
  add_knob(
      std::move(name), fmt::format("duration ({})", suffix), std::move(doc),
      [unit_ns, set_count = std::move(set_count)](std::string_view v) -> Status {
        KVTIER_ASSIGN_OR_RETURN(std::int64_t count, parse_duration(v, unit_ns));
        return set_count(count);
      },
      [suffix, get_count = std::move(get_count)] { return fmt::format("{}{}", get_count(), suffix); });
}

std::string_view ConfigTable::trim_text(std::string_view s) { return trim(s); }

Status ConfigTable::out_of_range(std::int64_t count) {
  return InvalidArgument(fmt::format("{} does not fit in the field", count));
}

namespace {
std::size_t edit_distance(std::string_view a, std::string_view b);
// A slip of a few letters, not another word: at most 3 edits, and at most a quarter of the name.
bool is_slip(std::size_t edits, std::size_t name_size) { return edits <= 3 && edits * 4 <= name_size; }
}  // namespace

Status ConfigTable::set(std::string_view name, std::string_view value) {
  auto it = knobs_.find(name);
  if (it == knobs_.end()) {
    // A slip of a few letters names the knob it was probably meant to be, as unrecognized_env does.
    const std::string* nearest = nullptr;
    std::size_t best = 0;
    for (const auto& [known, knob] : knobs_) {
      const std::size_t d = edit_distance(name, known);
      if (nearest == nullptr || d < best) nearest = &known, best = d;
    }
    if (nearest != nullptr && is_slip(best, name.size()))
      return InvalidArgument(fmt::format("unknown config knob '{}' (did you mean '{}'?)", name, *nearest));
    return InvalidArgument(fmt::format("unknown config knob '{}'", name));
  }
  Status s = it->second.setter(value);
  if (!s.ok() && it->second.secret) return InvalidArgument(fmt::format("config knob '{}': {}", name, s.message()));
  if (!s.ok()) return InvalidArgument(fmt::format("config knob '{}' = '{}': {}", name, value, s.message()));
  return Status::Ok();
}

Status ConfigTable::apply_env(char** env) {
  if (env == nullptr) return Status::Ok();
  for (auto& [name, knob] : knobs_) {
    const std::string& var = knob.info.env_var;
    for (char** e = env; *e != nullptr; ++e) {
      std::string_view entry(*e);
      if (entry.size() > var.size() && entry.substr(0, var.size()) == var && entry[var.size()] == '=') {
        KVTIER_RETURN_IF_ERROR(set(name, entry.substr(var.size() + 1)).with_context(var));
      }
    }
  }
  return Status::Ok();
}

namespace {

// "KVTIER_CACHE_" of "KVTIER_CACHE_DEVICE_BLOCKS"; empty for a name with no second word.
std::string_view env_family(std::string_view var) {
  constexpr std::string_view kPrefix = "KVTIER_";
  if (var.substr(0, kPrefix.size()) != kPrefix) return {};
  const std::size_t end = var.find('_', kPrefix.size());
  return end == std::string_view::npos ? std::string_view{} : var.substr(0, end + 1);
}

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace

std::vector<std::string> ConfigTable::unrecognized_env(char* const* env) const {
  std::vector<std::string> out;
  if (env == nullptr) return out;
  for (char* const* e = env; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const std::string_view var = entry.substr(0, entry.find('='));
    if (var.substr(0, 7) != "KVTIER_") continue;
    const std::string_view family = env_family(var);
    bool known = false, same_family = false;
    const std::string* nearest = nullptr;      // of the same family
    const std::string* nearest_any = nullptr;  // of every knob
    const std::string* extended = nullptr;     // a knob this name extends: KVTIER_METRICS of KVTIER_METRICS_ON
    std::size_t best = 0, best_any = 0;
    for (const auto& [name, knob] : knobs_) {
      const std::string& k = knob.info.env_var;
      if (k == var) {
        known = true;
        break;
      }
      const std::size_t d = edit_distance(var, k);
      if (nearest_any == nullptr || d < best_any) {
        nearest_any = &k;
        best_any = d;
      }
      if (var.size() > k.size() && var.substr(0, k.size()) == k && var[k.size()] == '_') extended = &k;
      if (family.empty() || var.size() == family.size() || env_family(k) != family) continue;
      same_family = true;
      if (nearest == nullptr || d < best) {
        nearest = &k;
        best = d;
      }
    }
    if (known) continue;
    auto near = [&](std::size_t d) { return is_slip(d, var.size()); };
    if (same_family) {
      if (near(best))
        out.push_back(fmt::format("{} is not a kvtier setting and is ignored (did you mean {}?)", var, *nearest));
      else
        out.push_back(
            fmt::format("{} is not a kvtier setting and is ignored (`kvtier info --config` lists them)", var));
      continue;
    }
    // Outside every knob family (KVTIER_METRIC, KVTIER_COPYSM, KVTIER_METRICS_ENABLED): named only when it is
    // near a knob, since scripts and tests use variables of their own under KVTIER_.
    if (extended != nullptr)
      out.push_back(fmt::format("{} is not a kvtier setting and is ignored (did you mean {}?)", var, *extended));
    else if (nearest_any != nullptr && near(best_any))
      out.push_back(fmt::format("{} is not a kvtier setting and is ignored (did you mean {}?)", var, *nearest_any));
  }
  return out;
}

Status ConfigTable::apply_text(std::string_view text) {
  std::size_t line_no = 0;
  while (!text.empty()) {
    ++line_no;
    std::size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view{} : text.substr(nl + 1);
    if (auto hash = line.find('#'); hash != std::string_view::npos) line = line.substr(0, hash);
    line = trim(line);
    if (line.empty()) continue;
    std::size_t eq = line.find('=');
    if (eq == std::string_view::npos) {
      // A secret's line ("name value", the '=' forgotten) is not echoed: errors end up in logs.
      const std::string_view first = line.substr(0, line.find_first_of(" \t"));
      if (auto k = knobs_.find(first); k != knobs_.end() && k->second.secret)
        return InvalidArgument(
            fmt::format("config line {}: expected 'name = value' for the secret knob '{}' (its value is not shown)",
                        line_no, first));
      return InvalidArgument(fmt::format("config line {}: expected 'name = value', got '{}'", line_no, line));
    }
    KVTIER_RETURN_IF_ERROR(
        set(trim(line.substr(0, eq)), trim(line.substr(eq + 1))).with_context(fmt::format("config line {}", line_no)));
  }
  return Status::Ok();
}

std::vector<KnobInfo> ConfigTable::describe() const {
  std::vector<KnobInfo> out;
  for (const auto& [name, knob] : knobs_) {
    KnobInfo info = knob.info;
    info.value = knob.getter();
    out.push_back(std::move(info));
  }
  return out;
}

std::string ConfigTable::markdown() const {
  std::string out = "| knob | env var | type | default | value | meaning |\n|---|---|---|---|---|---|\n";
  for (const KnobInfo& k : describe())
    out += fmt::format("| `{}` | `{}` | {} | {} | {} | {} |\n", k.name, k.env_var, k.type, k.default_value, k.value,
                       k.doc);
  return out;
}

}  // namespace kvtier
