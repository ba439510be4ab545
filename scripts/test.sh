#!/usr/bin/env bash
# The test command (what CI runs). Stages, each timed; a table of their seconds is printed last:
#   format  every C++ and CUDA source formatted as .clang-format says (scripts/check-format.sh), and every
#           folder including only what its layer may (scripts/check-layers.py, docs/architecture.md)
#   asan    every CPU test under AddressSanitizer + UBSan (preset asan: clang-14; the same build makes
#           the libFuzzer harnesses)
#   fuzz    the harnesses, each for KVTIER_FUZZ_SECONDS, one per core at a time (scripts/run-fuzzers.sh)
#   tsan    every test that starts threads, under ThreadSanitizer (preset tsan; SINGLE_THREADED tests
#           and the CLI's tests are left out there: tests/CMakeLists.txt)
#   tidy    clang-tidy 14 with the checks of .clang-tidy over the libraries, the CLI and the Python bindings
#           (scripts/check-tidy.sh), from the asan tree's compile database (its unity files)
#   wheel   the Python wheel built and repaired as users get it (scripts/build-wheel.sh; host backend
#           only, CUDA is compiled by the gpu and default presets), installed into a fresh virtual
#           environment with no access to the source tree's package, its shared libraries checked to
#           come from the wheel, and the pytest suite run against it (scripts/test-wheel.sh)
# With the default stages, the tsan and wheel builds start at once in the background at the lowest CPU
# priority (nice 19), beside them the wheel's test environment (its third-party packages: mostly downloads),
# then clang-tidy (on the asan tree, configured first): they take only the cycles the foreground leaves idle
# (tests waiting on sockets, timers, the other process, a build's serial link steps), so the tests run as
# fast as alone; each stage then waits for its part (logs under
# build/ci-background/). KVTIER_CI_OVERLAP=0 runs everything in turn.
# Test services (Redis on loopback) are started first.
# Usage: scripts/test.sh [stage ...]   (default: format asan fuzz tsan wheel tidy)
#   KVTIER_SKIP_FUZZ=1 / KVTIER_SKIP_PYTHON=1 / KVTIER_SKIP_TIDY=1 leave out the fuzz / wheel / tidy stage.
set -euo pipefail
cd "$(dirname "$0")/.."
wheel_file=build/wheelhouse/.latest
build_wheel() {
  mkdir -p build/wheelhouse
  scripts/build-wheel.sh --cuda OFF --werror ON --out build/wheelhouse | tail -n 1 >"$wheel_file.tmp"
  mv "$wheel_file.tmp" "$wheel_file"
}
if [ "${1:-}" = __background ]; then
  # The background half of the default run (see above): the tsan build, then the wheel.
  bg=build/ci-background
  set +e
  # The wheel's test environment (pytest, SGLang, vLLM, torch: mostly downloads) beside the builds.
  if [ "${KVTIER_SKIP_PYTHON:-0}" != 1 ]; then
    (scripts/test-wheel.sh --prepare-env >$bg/wheelenv.log 2>&1; echo $? >$bg/wheelenv.rc) &
  fi
  (set -eo pipefail; cmake --preset tsan >/dev/null && cmake --build --preset tsan -j "$(nproc)") >$bg/tsan.log 2>&1
  echo $? >$bg/tsan.rc
  if [ "${KVTIER_SKIP_PYTHON:-0}" != 1 ]; then
    (set -eo pipefail; build_wheel) >$bg/wheel.log 2>&1
    echo $? >$bg/wheel.rc
  fi
  if [ "${KVTIER_SKIP_TIDY:-0}" != 1 ]; then
    scripts/check-tidy.sh build/asan >$bg/tidy.log 2>&1
    echo $? >$bg/tidy.rc
  fi
  wait
  exit 0
fi
stages=("$@")
overlap=0
if [ ${#stages[@]} -eq 0 ]; then
  stages=(format asan)
  [ "${KVTIER_SKIP_FUZZ:-0}" = 1 ] || stages+=(fuzz)
  stages+=(tsan)
  [ "${KVTIER_SKIP_PYTHON:-0}" = 1 ] || stages+=(wheel)
  [ "${KVTIER_SKIP_TIDY:-0}" = 1 ] || stages+=(tidy)
  overlap=${KVTIER_CI_OVERLAP:-1}
fi
jobs=$(nproc)
# One test more than cores: a third of the tests' time is waiting (injected delays, deadlines, the peer process),
# and a waiting test holds its ctest slot.
test_jobs=$((jobs + 1))
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
bg_pid=""
trap 'status=$?; [ -z "$bg_pid" ] || kill -- -"$bg_pid" 2>/dev/null || true; if [ $status -ne 0 ]; then print_timings; echo "=== FAILED (exit $status) ==="; fi' EXIT

if [ -x scripts/start-test-services.sh ]; then
  eval "$(scripts/start-test-services.sh)"
fi
finish_stage services

bg=build/ci-background
if [ "$overlap" = 1 ]; then
  rm -rf "$bg" && mkdir -p "$bg"
  # The tidy part reads the asan tree's compile database: configured here, before either side uses it.
  cmake --preset asan >/dev/null
  # Its own process group (set -m), so that the trap can end all of it on failure.
  set -m
  nice -n 19 "$0" __background &
  bg_pid=$!
  set +m
fi
# Waits (at most an hour) for a background build; prints its log; fails with its status (an `optional` step's
# failure only prints its log: its stage does the work itself).
await_background() {  # name [optional]
  local rc_file=$bg/$1.rc waited=0
  while [ ! -f "$rc_file" ]; do
    if [ $waited -ge 3600 ]; then
      echo "test.sh: the background $1 build did not finish within 3600 s" >&2
      exit 1
    fi
    sleep 1
    waited=$((waited + 1))
  done
  tail -n 25 "$bg/$1.log"
  [ "$(cat "$rc_file")" = 0 ] && return 0
  cat "$bg/$1.log"
  [ "${2:-}" = optional ] && { echo "test.sh: the background $1 step failed; its stage does it again" >&2; return 0; }
  echo "test.sh: the $1 build failed" >&2
  exit 1
}

for s in "${stages[@]}"; do
  echo "=== $s ==="
  case "$s" in
    asan | tsan | default | debug)
      if [ "$s" = tsan ] && [ "$overlap" = 1 ]; then
        await_background tsan
      else
        # The presets CI does not build with warnings as errors get them here.
        werror=()
        [ "$s" != default ] || werror=(-DKVTIER_WERROR=ON)
        cmake --preset "$s" "${werror[@]}" >/dev/null
        cmake --build --preset "$s" -j "$jobs"
      fi
      finish_stage "$s build"
      ctest --preset "$s" -j "$test_jobs"
      finish_stage "$s tests"
      ;;
    format)
      scripts/check-format.sh
      python3 scripts/check-layers.py
      finish_stage format
      ;;
    fuzz)
      scripts/run-fuzzers.sh
      finish_stage fuzz
      ;;
    wheel)
      if [ "$overlap" = 1 ]; then
        await_background wheel
        await_background wheelenv optional
      else
        build_wheel
      fi
      finish_stage "wheel build"
      scripts/test-wheel.sh "$(cat "$wheel_file")"
      finish_stage "wheel pytest"
      ;;
    tidy)
      if [ "$overlap" = 1 ]; then
        await_background tidy
      else
        [ -f build/asan/compile_commands.json ] || cmake --preset asan >/dev/null
        scripts/check-tidy.sh build/asan
      fi
      finish_stage tidy
      ;;
    *)
      echo "test.sh: unknown stage '$s' (format, asan, fuzz, tsan, wheel, tidy, default, debug)" >&2
      exit 2
      ;;
  esac
done
print_timings
echo "=== all tests passed (${stages[*]}) ==="
