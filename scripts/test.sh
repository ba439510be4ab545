#!/usr/bin/env bash
# The test command (what CI runs). Stages, each timed; a table of their seconds is printed last:
#   asan    every CPU test under AddressSanitizer + UBSan (preset asan)
#   fuzz    the libFuzzer harnesses, each for KVTIER_FUZZ_SECONDS (scripts/run-fuzzers.sh, preset fuzz)
#   tsan    every test that starts threads, under ThreadSanitizer (preset tsan; SINGLE_THREADED tests
#           are left out there: tests/CMakeLists.txt)
#   wheel   the Python wheel built and repaired as users get it (scripts/build-wheel.sh; host backend
#           only, CUDA is compiled by the gpu and default presets), installed into a fresh virtual
#           environment with no access to the source tree's package, its shared libraries checked to
#           come from the wheel, and the pytest suite run against it (scripts/test-wheel.sh)
# Test services (Redis on loopback) are started first.
# Usage: scripts/test.sh [stage ...]   (default: asan fuzz tsan wheel)
#   KVTIER_SKIP_FUZZ=1 / KVTIER_SKIP_PYTHON=1 leave out the fuzz / wheel stage.
set -euo pipefail
cd "$(dirname "$0")/.."
stages=("$@")
if [ ${#stages[@]} -eq 0 ]; then
  stages=(asan)
  [ "${KVTIER_SKIP_FUZZ:-0}" = 1 ] || stages+=(fuzz)
  stages+=(tsan)
  [ "${KVTIER_SKIP_PYTHON:-0}" = 1 ] || stages+=(wheel)
fi
jobs=$(nproc)
timings=()
total_start=$(date +%s)
stage_start=$total_start
finish_stage() {  # name
  local now
  now=$(date +%s)
  timings+=("$(printf '%-22s %6d s' "$1" $((now - stage_start)))")
  stage_start=$now
}
print_timings() {
  echo "=== seconds per stage ==="
  printf '%s\n' "${timings[@]}"
  printf '%-22s %6d s\n' total $(($(date +%s) - total_start))
}
trap 'status=$?; if [ $status -ne 0 ]; then print_timings; echo "=== FAILED (exit $status) ==="; fi' EXIT

if [ -x scripts/start-test-services.sh ]; then
  eval "$(scripts/start-test-services.sh)"
fi
finish_stage services

for s in "${stages[@]}"; do
  echo "=== $s ==="
  case "$s" in
    asan | tsan | default)
      cmake --preset "$s" >/dev/null
      cmake --build --preset "$s" -j "$jobs"
      finish_stage "$s build"
      ctest --preset "$s" -j "$jobs"
      finish_stage "$s tests"
      ;;
    fuzz)
      scripts/run-fuzzers.sh
      finish_stage fuzz
      ;;
    wheel)
      wheel=$(scripts/build-wheel.sh --cuda OFF --out build/wheelhouse | tail -n 1)
      finish_stage "wheel build"
      scripts/test-wheel.sh "$wheel"
      finish_stage "wheel pytest"
      ;;
    *)
      echo "test.sh: unknown stage '$s' (asan, fuzz, tsan, wheel, default)" >&2
      exit 2
      ;;
  esac
done
print_timings
echo "=== all tests passed (${stages[*]}) ==="
