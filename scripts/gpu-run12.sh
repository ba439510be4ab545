#!/usr/bin/env bash
# GPU run 12 (session 2): kAuto split with the CPU budget cap. Random H2D
# 4-64 KiB, sm_kernel vs auto, 3 processes (pre-queued), then once timed from
# an idle stream (--no-prequeue: CPU submission inside the timing); copy tests.
set -uo pipefail
B=${B:-.gpu-bin}
OUT=${OUT:-/tmp/kvtier-out}; R=$OUT/r; mkdir -p "$R"
timeout 150 $B/copy_gpu_test --gtest_brief=1 > $R/copy_gpu_test.log 2>&1; echo "copy_gpu_test rc=$?"; grep -E "^\[  FAILED|PASSED|Failure" -A3 $R/copy_gpu_test.log | head -12
A="--backend cuda --json --reps 7 --directions h2d --block-sizes 4,8,12,16,20,24,28,32,48,64"
for i in 1 2 3; do timeout 90 $B/kvtier bench copy $A --strategies sm_kernel,auto > $R/auto_$i.jsonl 2>> $R/err.txt; echo "auto $i rc=$?"; done
timeout 90 $B/kvtier bench copy $A --strategies sm_kernel,auto --no-prequeue > $R/noprequeue.jsonl 2>> $R/err.txt; echo "noprequeue rc=$?"
tail -2 $R/err.txt
for f in $R/*.jsonl; do python3 -c "
import json
rows=[json.loads(l) for l in open('$f') if l.startswith('{')]
print('$(basename $f)')
for r in rows:
    print(f\"  {r['block_bytes']//1024:3}K {r['strategy']:9} {r.get('ran',''):9} {r['ratio']:.3f} api {r['host_api_ms']:.2f} ms p50 {r['p50_ms']:.2f} ms\")
"; done | tee $OUT/table.txt
tar czf $OUT/run12.tgz -C $OUT r && rm -rf $R
