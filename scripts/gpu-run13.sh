#!/usr/bin/env bash
# GPU run 13 (session 2, final copy tables): kAuto with the split CPU budget
# and the queued-work condition. Pre-queued tables (random all directions,
# small H2D twice more, contiguous) and idle-stream timing (--no-prequeue).
set -uo pipefail
B=${B:-.gpu-bin}
OUT=${OUT:-/tmp/kvtier-out}; R=$OUT/r; mkdir -p "$R"
for t in device_conformance_test copy_gpu_test; do
  timeout 200 $B/$t --gtest_brief=1 > $R/$t.log 2>&1; echo "$t rc=$?"; grep -E "^\[  FAILED|PASSED|Failure" -A3 $R/$t.log | head -12
done
A="--backend cuda --json --reps 7"
timeout 150 $B/kvtier bench copy $A --strategies sm_kernel,auto --directions h2d,d2h,both > $R/random.jsonl 2>> $R/err.txt; echo "random rc=$?"
for i in 2 3; do
  timeout 90 $B/kvtier bench copy $A --strategies auto --directions h2d --block-sizes 4,8,12,16,20,24,28,32,48 > $R/random_h2d_$i.jsonl 2>> $R/err.txt; echo "h2d $i rc=$?"
done
timeout 90 $B/kvtier bench copy $A --pattern contiguous --strategies auto --directions h2d,d2h,both > $R/contig.jsonl 2>> $R/err.txt; echo "contig rc=$?"
timeout 120 $B/kvtier bench copy $A --no-prequeue --strategies sm_kernel,auto --directions h2d,d2h > $R/idle.jsonl 2>> $R/err.txt; echo "idle rc=$?"
tail -2 $R/err.txt
for f in $R/*.jsonl; do python3 -c "
import json
rows=[json.loads(l) for l in open('$f') if l.startswith('{')]
print('$(basename $f)')
for r in rows:
    print(f\"  {r.get('pattern',''):10} {r['direction']:4} {r['block_bytes']//1024:5}K {r['strategy']:9} {r.get('ran',''):24} {r['gbps']:6.1f} {r['ratio']:.3f} api {r['host_api_ms']:.2f} p50 {r['p50_ms']:.2f}\")
"; done | tee $OUT/table.txt
tar czf $OUT/run13.tgz -C $OUT r && rm -rf $R
