#!/usr/bin/env bash
# GPU run 15 (session 2): kAuto's idle-stream rule (kernel below 512 KiB when
# nothing is queued). Idle-stream and pre-queued timing, h2d/d2h; copy tests.
set -uo pipefail
B=${B:-.gpu-bin}
OUT=${OUT:-/tmp/kvtier-out}; R=$OUT/r; mkdir -p "$R"
timeout 150 $B/copy_gpu_test --gtest_brief=1 > $R/copy_gpu_test.log 2>&1; echo "copy_gpu_test rc=$?"; grep -E "^\[  FAILED|PASSED|Failure" -A3 $R/copy_gpu_test.log | head -12
A="--backend cuda --json --reps 7 --directions h2d,d2h --strategies sm_kernel,dma_batch,auto"
timeout 120 $B/kvtier bench copy $A --no-prequeue > $R/idle.jsonl 2>> $R/err.txt; echo "idle rc=$?"
timeout 120 $B/kvtier bench copy $A > $R/queued.jsonl 2>> $R/err.txt; echo "queued rc=$?"
tail -2 $R/err.txt
for f in $R/*.jsonl; do python3 -c "
import json
rows=[json.loads(l) for l in open('$f') if l.startswith('{')]
print('$(basename $f)')
for r in rows:
    print(f\"  {r['direction']:4} {r['block_bytes']//1024:5}K {r['strategy']:9} {r.get('ran',''):10} {r['gbps']:6.1f} {r['ratio']:.3f} api {r['host_api_ms']:.2f} p50 {r['p50_ms']:.2f}\")
"; done | tee $OUT/table.txt
tar czf $OUT/run15.tgz -C $OUT r && rm -rf $R
