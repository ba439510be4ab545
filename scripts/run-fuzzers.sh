#!/usr/bin/env bash
# Builds the libFuzzer harnesses (in the `asan` preset's tree: clang-14, ASan + UBSan, the same
# instrumented library the tests use; target `fuzzers`) and runs each for a bounded
# time from its seed corpus (fuzz/corpus/<harness>/, read only; what the run adds goes to a
# scratch directory). Fails when any harness crashes, hangs past the per-input timeout, leaks or
# runs out of memory; the input that did it is kept under $KVTIER_FUZZ_OUT.
# Usage: scripts/run-fuzzers.sh [harness ...]      (default: every harness)
#   KVTIER_FUZZ_SECONDS   time per harness (default 12)
#   KVTIER_FUZZ_TIMEOUT   seconds one input may take (default 10)
#   KVTIER_FUZZ_RSS_MB    memory limit of a harness (default 2048)
#   KVTIER_FUZZ_OUT       scratch corpora and crash inputs (default: a temporary directory)
#   KVTIER_FUZZ_JOBS      harnesses run at once (default: the number of cores)
set -euo pipefail
cd "$(dirname "$0")/.."
harnesses=("$@")
[ ${#harnesses[@]} -gt 0 ] || harnesses=(fuzz_disk_object fuzz_redis_value fuzz_trace fuzz_config fuzz_kv_events fuzz_pd_blob fuzz_pd_messages)
seconds=${KVTIER_FUZZ_SECONDS:-12}
timeout_s=${KVTIER_FUZZ_TIMEOUT:-10}
rss_mb=${KVTIER_FUZZ_RSS_MB:-2048}
# A scratch directory of our own is removed after a clean run; one the caller named is kept.
if [ -n "${KVTIER_FUZZ_OUT:-}" ]; then
  out=$KVTIER_FUZZ_OUT
  own_out=0
else
  out=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-fuzz.XXXXXX")
  own_out=1
fi
mkdir -p "$out"

start=$(date +%s)
cmake --preset asan >/dev/null
cmake --build --preset asan --target fuzzers -j "$(nproc)"
built=$(date +%s)
echo "run-fuzzers: built in $((built - start)) s"

# One harness per core at a time (each is single-threaded); logs are printed in harness order.
run_one() {  # harness
  local h=$1 bin=build/asan/fuzz/$1 seeds=fuzz/corpus/${1#fuzz_}
  mkdir -p "$out/$h/corpus" "$out/$h/artifacts" "$out/$h/tmp"
  # -max_total_time bounds the run; the outer timeout only catches a harness that ignores it.
  # The harnesses' own files (a disk tier's directory, a trace file) go under the scratch directory.
  TMPDIR="$out/$h/tmp" timeout --kill-after=10 $((seconds + timeout_s + 60)) "$bin" \
    -max_total_time="$seconds" -timeout="$timeout_s" -rss_limit_mb="$rss_mb" -max_len=16384 \
    -print_final_stats=1 -artifact_prefix="$out/$h/artifacts/" \
    "$out/$h/corpus" "$seeds" >"$out/$h/log" 2>&1
}
for h in "${harnesses[@]}"; do
  [ -x "build/asan/fuzz/$h" ] || { echo "run-fuzzers: no harness build/asan/fuzz/$h" >&2; exit 2; }
  [ -d "fuzz/corpus/${h#fuzz_}" ] || { echo "run-fuzzers: no seed corpus fuzz/corpus/${h#fuzz_}" >&2; exit 2; }
done
parallel=${KVTIER_FUZZ_JOBS:-$(nproc)}
declare -A pid_of
failed=()
collect() {  # harness
  local h=$1
  if ! wait "${pid_of[$h]}"; then
    failed+=("$h")
    tail -n 60 "$out/$h/log"
    echo "run-fuzzers: $h FAILED; inputs in $out/$h/artifacts/:" >&2
    ls -l "$out/$h/artifacts/" >&2 || true
  else
    echo "=== $h: ${seconds} s ==="
    grep -E "^stat::number_of_executed_units|^Done" "$out/$h/log" | tr '\n' ' '
    echo
  fi
}
running=()
for h in "${harnesses[@]}"; do
  run_one "$h" &
  pid_of[$h]=$!
  running+=("$h")
  if [ ${#running[@]} -ge "$parallel" ]; then
    collect "${running[0]}"
    running=("${running[@]:1}")
  fi
done
for h in "${running[@]}"; do collect "$h"; done
echo "run-fuzzers: build $((built - start)) s, total $(($(date +%s) - start)) s"
if [ ${#failed[@]} -gt 0 ]; then
  echo "run-fuzzers: failed: ${failed[*]}" >&2
  exit 1
fi
echo "run-fuzzers: all harnesses ran clean (${harnesses[*]})"
[ "$own_out" = 0 ] || rm -rf "$out"
