#!/usr/bin/env bash
# GPU run 9 (session 2): final kAuto tables (split profile with one lane when
# the kernel has a share; duplex DMA from 24 KiB): random h2d/d2h/both at the
# issue's sizes, small H2D sizes twice more, contiguous; copy GPU tests.
set -uo pipefail
B=${B:-.gpu-bin}
OUT=${OUT:-/tmp/kvtier-out}; R=$OUT/r; mkdir -p "$R"
timeout 150 $B/copy_gpu_test --gtest_brief=1 > $R/copy_gpu_test.log 2>&1; echo "copy_gpu_test rc=$?"; grep -E "^\[  FAILED|PASSED|Failure" -A3 $R/copy_gpu_test.log | head -12
A="--backend cuda --json --reps 7"
timeout 150 $B/kvtier bench copy $A --strategies sm_kernel,auto --directions h2d,d2h,both > $R/random.jsonl 2>> $R/err.txt; echo "random rc=$?"
for i in 2 3; do
  timeout 90 $B/kvtier bench copy $A --strategies sm_kernel,auto --directions h2d --block-sizes 4,8,12,16,20,24,28,32 > $R/random_h2d_$i.jsonl 2>> $R/err.txt; echo "random h2d $i rc=$?"
done
timeout 90 $B/kvtier bench copy $A --pattern contiguous --strategies auto --directions h2d,d2h,both > $R/contig.jsonl 2>> $R/err.txt; echo "contig rc=$?"
tail -3 $R/err.txt
cat $R/random*.jsonl $R/contig.jsonl | python3 -c "
import json,sys
for l in sys.stdin:
    if not l.startswith('{'): continue
    r=json.loads(l)
    print(f\"{r.get('pattern',''):10} {r['strategy']:9} {r.get('ran',''):22} {r['direction']:4} {r['block_bytes']//1024:5}K {r['gbps']:6.1f} {r['ceiling_gbps']:6.1f} {r['ratio']:.3f}\")
" > $OUT/table.txt
cat $OUT/table.txt
tar czf $OUT/run9.tgz -C $OUT r && rm -rf $R
