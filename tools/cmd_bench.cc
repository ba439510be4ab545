// `kvtier bench <what>`: the parent subcommand; each benchmark registers a
// sub-subcommand (see tools/cli.h).
#include <cstdio>
#include <vector>

#include "tools/cli.h"

namespace kvtier::cli {

Action register_bench_copy(CLI::App& bench);
Action register_bench_transfer(CLI::App& bench);
Action register_bench_storage(CLI::App& bench);
#if !defined(KVTIER_CLI_NO_BENCH_PD)
Action register_bench_pd(CLI::App& bench);
#endif

namespace {
// Add new benchmarks here (one line each).
constexpr BenchRegistrar kBenchRegistrars[] = {
    &register_bench_copy,
    &register_bench_transfer,
    &register_bench_storage,
#if !defined(KVTIER_CLI_NO_BENCH_PD)
    &register_bench_pd,
#endif
};
}  // namespace

Action register_bench(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "Benchmarks: copy (block copies GPU<->host), ...");
  bench->require_subcommand(1);
  std::vector<Action> actions;
  for (BenchRegistrar r : kBenchRegistrars) actions.push_back(r(*bench));
  return [bench, actions]() -> int {
    if (!bench->parsed()) return -1;
    for (const auto& a : actions) {
      const int rc = a();
      if (rc >= 0) return rc;
    }
    std::fprintf(stderr, "kvtier bench: no benchmark ran\n");
    return 2;
  };
}

}  // namespace kvtier::cli
