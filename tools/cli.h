// Subcommand registry for the kvtier CLI. Each tools/cmd_<name>.cc defines a
// registration function and adds it to the list in main.cc.
#pragma once

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <functional>
#include <string>
#include <string_view>

namespace kvtier::cli {

// A subcommand registers its options on `app` and returns the action run when
// it was selected. The action returns the process exit code.
using Action = std::function<int()>;
using Registrar = Action (*)(CLI::App& app);

// `kvtier bench <what>` (tools/cmd_bench.cc owns the `bench` subcommand).
// To add a benchmark:
//   1. write tools/cmd_bench_<what>.cc defining
//        Action register_bench_<what>(CLI::App& bench);
//      which adds its sub-subcommand to `bench` (bench.add_subcommand("<what>",
//      ...)) and returns an action that returns -1 unless that sub-subcommand
//      was parsed, else the exit code;
//   2. declare it and add it to kBenchRegistrars in tools/cmd_bench.cc.
// Conventions for bench output: a human table by default, `--json` prints one
// JSON object per line (nlohmann-json); a nonzero exit code on any failed
// verification.
using BenchRegistrar = Action (*)(CLI::App& bench);

// A number of at least `min`, named in the message when not (CLI::PositiveNumber / NonNegativeNumber print the
// largest double instead).
inline CLI::Validator at_least(int min) {
  return CLI::Validator(
      [min](std::string& v) -> std::string {
        char* end = nullptr;
        const double d = std::strtod(v.c_str(), &end);
        return end != v.c_str() && *end == '\0' && d >= min ? std::string()
                                                            : "'" + v + "' is not a number >= " + std::to_string(min);
      },
      "NUMBER >= " + std::to_string(min));
}
// A finite number in [lo, hi], named in the message when not (CLI::Range lets NaN through: every comparison with
// it is false).
inline CLI::Validator finite_in(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& v) -> std::string {
        char* end = nullptr;
        const double d = std::strtod(v.c_str(), &end);
        return end != v.c_str() && *end == '\0' && d >= lo && d <= hi
                   ? std::string()
                   : fmt::format("'{}' is not a number in [{:g}, {:g}]", v, lo, hi);
      },
      fmt::format("NUMBER in [{:g}, {:g}]", lo, hi));
}
// Counts and sizes that must be at least 1 (a 0 divides by zero or measures nothing), and counts that may be 0.
inline const CLI::Validator kAtLeastOne = at_least(1);
inline const CLI::Validator kAtLeastZero = at_least(0);

// A decimal integer: CLI11 reads integers in the base their prefix implies, so "--block-tokens 0512" was 330 (octal)
// and "--device-blocks 0x10" 16, where the replay's list flags refuse both; and an unsigned option took "-4" as
// 2^64 - 4. Leading zeros, other bases and (`is_signed` false) signs are refused, naming the value. So is a value
// beyond 64 bits: CLI11 saturates those for 64-bit options ("--seed 18446744073709551616" ran as 2^64 - 1, and an
// error then named the saturated value, not the one typed); narrower options it refuses itself.
inline CLI::Validator decimal_integer(bool is_signed) {
  return CLI::Validator(
      [is_signed](std::string& v) -> std::string {
        const bool negative = is_signed && v.size() > 1 && v[0] == '-';
        const std::size_t i = is_signed && v.size() > 1 && (v[0] == '-' || v[0] == '+') ? 1 : 0;
        const std::string_view digits = std::string_view(v).substr(i);
        const bool ok = !digits.empty() && digits.find_first_not_of("0123456789") == std::string_view::npos &&
                        (digits.size() == 1 || digits[0] != '0');
        if (!ok)
          return fmt::format("'{}' is not a {}decimal integer (no leading zeros, no other base)", v,
                             is_signed ? "" : "non-negative ");
        // Without leading zeros, equal lengths compare as numbers do.
        const std::string_view limit = !is_signed ? "18446744073709551615"
                                       : negative ? "9223372036854775808"
                                                  : "9223372036854775807";
        if (digits.size() > limit.size() || (digits.size() == limit.size() && digits > limit))
          return fmt::format("'{}' is out of range for a {}-bit integer", v, is_signed ? "signed 64" : "64");
        return std::string();
      },
      "");
}

// A number given as an empty string: CLI11 reads "" as 0 for a floating-point option ("--failure-rate ''" ran with
// no failures, exit 0), and a range check then named 0, not what was given.
inline CLI::Validator non_empty_number() {
  return CLI::Validator(
      [](std::string& v) -> std::string {
        return v.find_first_not_of(" \t") == std::string::npos ? fmt::format("'{}' is not a number (empty)", v)
                                                               : std::string();
      },
      "");
}

// Puts decimal_integer on every integer option of `app` and its subcommands, and non_empty_number on every
// floating-point one: their type name says INT, UINT or FLOAT (followed by ":" and the descriptions of validators
// already set, as in "UINT:NUMBER >= 0").
inline void require_decimal_integers(CLI::App& app) {
  for (CLI::Option* o : app.get_options()) {
    const std::string type = o->get_type_name();
    const std::string base = type.substr(0, type.find(':'));
    if (base == "INT") o->check(decimal_integer(true));
    if (base == "UINT") o->check(decimal_integer(false));
    if (base == "FLOAT") o->check(non_empty_number());
  }
  for (CLI::App* sub : app.get_subcommands({})) require_decimal_integers(*sub);
}

}  // namespace kvtier::cli
