#!/usr/bin/env bash
# GPU run 24 (session 3, final code): every GPU test; the copy bench tables
# of docs/performance.md (random and contiguous, pre-queued, idle stream,
# back-to-back pieces); bench transfer (issue 3's bars).
set -uo pipefail
B=${B:-.gpu-bin}
OUT=${OUT:-/tmp/kvtier-out}; R=$OUT/r; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for t in device_conformance_test cuda_device_test copy_gpu_test transfer_gpu_test; do
  timeout 200 $B/$t --gtest_brief=1 > $R/$t.log 2>&1; echo "$t rc=$?"; grep -E "^\[  FAILED|PASSED|Failure" -A3 $R/$t.log | head -8
done
C="--backend cuda --json --reps 7"
timeout 240 $B/kvtier bench copy $C --strategies sm_kernel,auto --directions h2d,d2h,both > $R/matrix.jsonl 2>> $R/err.txt; echo "matrix rc=$?"
for i in 1 2; do
  timeout 120 $B/kvtier bench copy $C --strategies auto --directions h2d --block-sizes 4,8,12,16,20,24,28,32,48 > $R/h2d_$i.jsonl 2>> $R/err.txt; echo "h2d_$i rc=$?"
done
timeout 150 $B/kvtier bench copy $C --pattern contiguous --strategies auto --directions h2d,d2h,both > $R/contig.jsonl 2>> $R/err.txt; echo "contig rc=$?"
timeout 150 $B/kvtier bench copy $C --no-prequeue --strategies sm_kernel,auto --directions h2d,d2h --block-sizes 4,16,32,64,256,1024 > $R/idle.jsonl 2>> $R/err.txt; echo "idle rc=$?"
for p in 8 32; do
  timeout 120 $B/kvtier bench copy $C --strategies sm_kernel,auto --directions h2d --no-prequeue --pieces $p --block-sizes 4,8,16,32 > $R/stream_$p.jsonl 2>> $R/err.txt; echo "stream_$p rc=$?"
done
timeout 150 $B/kvtier bench transfer --backend cuda --json > $R/transfer.jsonl 2>> $R/err.txt; echo "transfer rc=$?"
tail -3 $R/err.txt
python3 scripts/gpu_table.py matrix=$R/matrix.jsonl h2d_1=$R/h2d_1.jsonl h2d_2=$R/h2d_2.jsonl contig=$R/contig.jsonl idle=$R/idle.jsonl stream_8=$R/stream_8.jsonl stream_32=$R/stream_32.jsonl transfer=$R/transfer.jsonl | tee $OUT/table.txt
tar czf $OUT/run24.tgz -C $OUT r && rm -rf $R
