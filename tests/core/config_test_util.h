// Helpers shared by the tests of the config bindings (cache, transfer).
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <string>

#include "kvtier/core/config.h"

namespace kvtier::testing {

// describe() by knob name.
inline std::map<std::string, KnobInfo> knobs(const ConfigTable& t) {
  std::map<std::string, KnobInfo> out;
  for (KnobInfo& k : t.describe()) out.emplace(k.name, std::move(k));
  return out;
}

// Applies one "VAR=value" through apply_env.
inline Status apply_one_env(ConfigTable& t, const std::string& var, const std::string& value) {
  std::string entry = var + "=" + value, other = "PATH=/usr/bin";
  char* env[] = {other.data(), entry.data(), nullptr};
  return t.apply_env(env);
}

template <class Config>
struct KnobCase {
  std::string text;                          // what is set
  std::string printed;                       // what describe() shows afterwards
  std::function<bool(const Config&)> check;  // the struct field holds it
};

// Every case, set from its text and from its env var, lands in the struct
// (which held something else by default), prints as `printed`, and the
// printed value is accepted back and means the same. `bind(table, config)`
// binds a config to a table. Wrap in ASSERT_NO_FATAL_FAILURE.
template <class Config, class Bind>
void expect_knobs_round_trip(const std::map<std::string, KnobCase<Config>>& cases, Bind bind) {
  for (const auto& [name, cs] : cases) {
    for (bool via_env : {false, true}) {
      SCOPED_TRACE(name + (via_env ? " (env)" : " (set)"));
      Config c;
      ConfigTable t;
      bind(t, c);
      ASSERT_FALSE(cs.check(c)) << "the case value must differ from the default";
      Status s = via_env ? apply_one_env(t, ConfigTable::env_var_for(name), cs.text) : t.set(name, cs.text);
      ASSERT_TRUE(s.ok()) << s.to_string();
      EXPECT_TRUE(cs.check(c));
      EXPECT_EQ(knobs(t).at(name).value, cs.printed);
      Config c2;
      ConfigTable t2;
      bind(t2, c2);
      ASSERT_TRUE(t2.set(name, cs.printed).ok());
      EXPECT_TRUE(cs.check(c2));
    }
  }
}

}  // namespace kvtier::testing
