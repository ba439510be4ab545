#!/usr/bin/env bash
# GPU run 28 (session 3, final code: CPU budget floor 12 KiB per descriptor).
# Every GPU test; H2D auto pre-queued in three processes; back-to-back 8 MiB
# requests (auto vs kernel).
set -uo pipefail
B=${B:-.gpu-bin}
OUT=${OUT:-/tmp/kvtier-out}; R=$OUT/r; mkdir -p "$R"
for t in device_conformance_test cuda_device_test copy_gpu_test transfer_gpu_test; do
  timeout 200 $B/$t --gtest_brief=1 > $R/$t.log 2>&1; echo "$t rc=$?"; grep -E "^\[  FAILED|PASSED|Failure" -A3 $R/$t.log | head -8
done
C="--backend cuda --json --reps 7"
for i in 1 2 3; do
  timeout 120 $B/kvtier bench copy $C --strategies auto --directions h2d --block-sizes 4,8,12,16,24,32,48,64 > $R/h2d_$i.jsonl 2>> $R/err.txt; echo "h2d_$i rc=$?"
done
timeout 120 $B/kvtier bench copy $C --strategies sm_kernel,auto --directions h2d --no-prequeue --pieces 32 --block-sizes 4,16 > $R/stream_32.jsonl 2>> $R/err.txt; echo "stream_32 rc=$?"
tail -3 $R/err.txt
python3 scripts/gpu_table.py h2d_1=$R/h2d_1.jsonl h2d_2=$R/h2d_2.jsonl h2d_3=$R/h2d_3.jsonl stream_32=$R/stream_32.jsonl | tee $OUT/table.txt
tar czf $OUT/run28.tgz -C $OUT r && rm -rf $R
