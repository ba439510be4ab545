// Names of enumerators from one table per enum: the name function (`dtype_name`, `tier_name`, ...) and its parse
// twin (`parse_dtype`, ...) read the same table, so a spelling is written once and the two cannot disagree.
//
//   constexpr EnumName<Tier> kTierEntries[] = {{Tier::kDevice, "device"}, {Tier::kHost, "host"}};
//   constexpr auto kTierNames = enum_table("tier", kTierEntries);
//   std::string_view tier_name(Tier t) noexcept { return kTierNames.name(t); }
//   Result<Tier> parse_tier(std::string_view s) { return kTierNames.parse(s); }
//
// The first entry of a value gives its name; later entries of the same value are further spellings that parse
// accepts (aliases: "bfloat16" for bf16). A value with no entry is named `unknown` ("?" unless the table says
// otherwise). parse matches exactly (case-sensitive) and reports InvalidArgument naming the text and listing every
// accepted spelling. Switches with no `default:` made the compiler list the name functions to extend when an
// enumerator was added; a table cannot, so a table over a dense enum with a count (kNumCopyStrategies) checks
// covers_dense(count) in a static_assert, and the facility's tests cover the rest.
//
// Thread-safety: tables are constexpr values; name() never allocates, parse() allocates only for its error.
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include "kvtier/core/status.h"

namespace kvtier {

template <typename E>
struct EnumName {
  E value;
  std::string_view name;
};

template <typename E, std::size_t N>
class EnumTable {
  static_assert(std::is_enum_v<E>);

 public:
  constexpr EnumTable(std::string_view what, const std::array<EnumName<E>, N>& entries, std::string_view unknown)
      : what_(what), entries_(entries), unknown_(unknown) {}

  constexpr std::string_view name(E value) const noexcept {
    for (const auto& e : entries_)
      if (e.value == value) return e.name;
    return unknown_;
  }
  constexpr std::optional<E> find(std::string_view text) const noexcept {
    for (const auto& e : entries_)
      if (e.name == text) return e.value;
    return std::nullopt;
  }
  // InvalidArgument: "unknown <what> '<text>' (expected one of a, b, c)".
  Result<E> parse(std::string_view text) const {
    if (auto v = find(text)) return *v;
    std::string msg = "unknown ";
    msg.append(what_).append(" '").append(text).append("' (expected one of ").append(accepted()).append(")");
    return InvalidArgument(std::move(msg));
  }
  // Every accepted spelling, names first, in table order: "a, b, c".
  std::string accepted() const {
    std::string out;
    for (const auto& e : entries_) {
      if (!out.empty()) out += ", ";
      out.append(e.name);
    }
    return out;
  }
  constexpr std::string_view what() const noexcept { return what_; }
  constexpr const std::array<EnumName<E>, N>& entries() const noexcept { return entries_; }

  // Whether every value 0..count-1 has a name, no entry lies outside that range, and no spelling repeats: true
  // for a complete table of a dense enum with `count` enumerators.
  constexpr bool covers_dense(std::size_t count) const noexcept {
    for (std::size_t v = 0; v < count; ++v) {
      bool found = false;
      for (const auto& e : entries_) found = found || static_cast<std::size_t>(e.value) == v;
      if (!found) return false;
    }
    for (const auto& e : entries_)
      if (static_cast<std::size_t>(e.value) >= count) return false;
    return distinct_names();
  }
  constexpr bool distinct_names() const noexcept {
    for (std::size_t i = 0; i < N; ++i)
      for (std::size_t j = i + 1; j < N; ++j)
        if (entries_[i].name == entries_[j].name) return false;
    return true;
  }

 private:
  std::string_view what_;
  std::array<EnumName<E>, N> entries_;
  std::string_view unknown_;
};

// A table of `what` (the word parse errors use) from an array of {value, name} entries.
template <typename E, std::size_t N>
constexpr EnumTable<E, N> enum_table(std::string_view what, const EnumName<E> (&entries)[N],
                                     std::string_view unknown = "?") {
  std::array<EnumName<E>, N> a{};
  for (std::size_t i = 0; i < N; ++i) a[i] = entries[i];
  return EnumTable<E, N>(what, a, unknown);
}

}  // namespace kvtier
