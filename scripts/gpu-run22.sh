#!/usr/bin/env bash
# GPU run 22 (session 3): + split pause when the CPU cannot keep up, bench --warmup 5. GPU tests,
# H2D auto pre-queued (two processes), streaming (back-to-back pieces from an
# idle stream, CPU cost inside the timing) auto vs sm_kernel, D2H/both auto,
set -uo pipefail
B=${B:-.gpu-bin}
OUT=${OUT:-/tmp/kvtier-out}; R=$OUT/r; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for t in copy_gpu_test; do
  timeout 200 $B/$t --gtest_brief=1 > $R/$t.log 2>&1; echo "$t rc=$?"; grep -E "^\[  FAILED|PASSED|Failure" -A3 $R/$t.log | head -8
done
H2D="--backend cuda --json --reps 7 --strategies auto --directions h2d"
for i in 1 2; do
  timeout 120 $B/kvtier bench copy $H2D --block-sizes 4,8,12,16,20,24,28,32,48,64 > $R/h2d_$i.jsonl 2>> $R/err.txt; echo "h2d_$i rc=$?"
done
for p in 8 32; do
  timeout 120 $B/kvtier bench copy --backend cuda --json --reps 7 --strategies sm_kernel,auto --directions h2d --no-prequeue --pieces $p --block-sizes 4,8,16,32 > $R/stream_$p.jsonl 2>> $R/err.txt; echo "stream_$p rc=$?"
done
tail -3 $R/err.txt
python3 scripts/gpu_table.py h2d_1=$R/h2d_1.jsonl h2d_2=$R/h2d_2.jsonl stream_8=$R/stream_8.jsonl stream_32=$R/stream_32.jsonl | tee $OUT/table.txt
tar czf $OUT/${RUN_NAME:-run22}.tgz -C $OUT r && rm -rf $R
