#!/usr/bin/env bash
# GPU run 18 (session 3): adaptive split share (timing events, SplitTuner).
# Every GPU test, then H2D auto at 4-64 KiB in two processes, CPU-budget
# variants, adaptive off for comparison, and the full auto matrix.
set -uo pipefail
B=${B:-.gpu-bin}
OUT=${OUT:-/tmp/kvtier-out}; R=$OUT/r; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for t in device_conformance_test cuda_device_test copy_gpu_test transfer_gpu_test; do
  timeout 200 $B/$t --gtest_brief=1 > $R/$t.log 2>&1; echo "$t rc=$?"; grep -E "^\[  FAILED|PASSED|Failure" -A3 $R/$t.log | head -8
done
H2D="--backend cuda --json --reps 7 --strategies auto --directions h2d"
for i in 1 2; do
  timeout 120 $B/kvtier bench copy $H2D --block-sizes 4,8,12,16,20,24,28,32,48,64 > $R/h2d_$i.jsonl 2>> $R/err.txt; echo "h2d_$i rc=$?"
done
KVTIER_COPY_AUTO_SPLIT_PAYLOAD_BYTES_PER_DMA_DESCRIPTOR=32K timeout 60 $B/kvtier bench copy $H2D --block-sizes 4,8,16 > $R/cap32.jsonl 2>> $R/err.txt; echo "cap32 rc=$?"
KVTIER_COPY_AUTO_SPLIT_PAYLOAD_BYTES_PER_DMA_DESCRIPTOR=16K timeout 60 $B/kvtier bench copy $H2D --block-sizes 4,8,16 > $R/cap16.jsonl 2>> $R/err.txt; echo "cap16 rc=$?"
KVTIER_COPY_AUTO_SPLIT_ADAPTIVE=0 timeout 60 $B/kvtier bench copy $H2D --block-sizes 4,16,32,48 > $R/fixed.jsonl 2>> $R/err.txt; echo "fixed rc=$?"
timeout 200 $B/kvtier bench copy --backend cuda --json --reps 7 --strategies sm_kernel,auto --directions h2d,d2h,both > $R/matrix.jsonl 2>> $R/err.txt; echo "matrix rc=$?"
tail -3 $R/err.txt
python3 scripts/gpu_table.py h2d_1=$R/h2d_1.jsonl h2d_2=$R/h2d_2.jsonl cap32=$R/cap32.jsonl cap16=$R/cap16.jsonl fixed=$R/fixed.jsonl matrix=$R/matrix.jsonl | tee $OUT/table.txt
tar czf $OUT/${RUN_NAME:-run18}.tgz -C $OUT r && rm -rf $R
