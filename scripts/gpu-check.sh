#!/usr/bin/env bash
# Runs on the GPU machine (device tool) from the repo root, with .gpu-bin carried:
#   all test binaries (GPU tests + CPU tests, whose conformance suites also
#   instantiate the CUDA backend), then the benchmarks; logs under $OUT; a short
#   table last.
# Usage: scripts/gpu-check.sh [tests|bench|all] [extra kvtier bench copy args...]
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/kvtier-out}; mkdir -p "$OUT"
BIN=.gpu-bin
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.sm --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
summary=()
if [ "$what" = tests ] || [ "$what" = all ]; then
  for t in "$BIN"/*_test; do
    name=$(basename "$t")
    start=$(date +%s)
    timeout 300 "$t" --gtest_brief=1 > "$OUT/$name.log" 2>&1
    rc=$?
    dur=$(( $(date +%s) - start ))
    pass=$(grep -c '^\[       OK \]' "$OUT/$name.log" || true)
    fail=$(grep -E '^\[  FAILED  \] [A-Za-z]' "$OUT/$name.log" | grep -vc 'listed below' || true)
    skip=$(grep -c '^\[  SKIPPED \]' "$OUT/$name.log" || true)
    summary+=("$(printf '%-28s rc=%-3s fail=%-3s skip=%-3s %4ss' "$name" "$rc" "$fail" "$skip" "$dur")")
    if [ "$rc" != 0 ]; then grep -E 'FAILED|Failure|error' "$OUT/$name.log" | head -20; fi
  done
  cat "$OUT"/*_test.log > "$OUT/tests_all.log" 2>/dev/null
  rm -f "$OUT"/*_test.log
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 420 "$BIN/kvtier" bench copy --backend cuda --json "$@" > "$OUT/bench_copy.jsonl" 2> "$OUT/bench_copy.err"
  echo "bench copy rc=$?"; tail -5 "$OUT/bench_copy.err"
  if "$BIN/kvtier" bench --help 2>/dev/null | grep -q transfer; then
    timeout 240 "$BIN/kvtier" bench transfer --backend cuda --json > "$OUT/bench_transfer.jsonl" 2> "$OUT/bench_transfer.err"
    echo "bench transfer rc=$?"; tail -5 "$OUT/bench_transfer.err"
  fi
fi
echo "================ summary ================"
printf '%s\n' "${summary[@]}"
if [ -s "$OUT/bench_copy.jsonl" ]; then
  python3 - "$OUT/bench_copy.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
print(f"{'strategy':12} {'dir':5} {'pattern':10} {'KiB':>6} {'GB/s':>7} {'ceil':>7} {'ratio':>6} {'ctas':>4}")
for r in rows:
    print(f"{r.get('strategy',''):12} {r.get('direction',''):5} {r.get('pattern',''):10} {r.get('block_bytes',0)//1024:>6} {r.get('gbps',0):7.1f} {r.get('ceiling_gbps',0):7.1f} {r.get('ratio',0):6.3f} {r.get('ctas',0):>4}")
PY
fi
