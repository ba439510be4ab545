#!/usr/bin/env bash
# GPU run 7 (session 2): kSplit fine sweep (H2D, 4-48 KiB random blocks, kernel
# share x DMA lanes) to set kAuto's split profile; both directions at 32 KiB
# repeated (noise); device conformance incl. the re-record variants.
set -uo pipefail
B=.gpu-bin
OUT=${OUT:-/tmp/kvtier-out}; R=$OUT/r; mkdir -p "$R"
for t in copy_gpu_test device_conformance_test; do
  timeout 150 $B/$t --gtest_brief=1 > $R/$t.log 2>&1; echo "$t rc=$?"; grep -E "^\[  FAILED|PASSED|Failure" -A3 $R/$t.log | head -24
done
S="--backend cuda --json --reps 7 --block-sizes 4,8,12,16,20,24,28,32,40,48 --directions h2d"
timeout 90 $B/kvtier bench copy $S --strategies sm_kernel,dma_batch > $R/h2d_base.jsonl 2>> $R/err.txt; echo "base rc=$?"
for cfg in "0.95 1" "0.9 1" "0.8 1" "0.7 1" "0.6 1" "0.65 2" "0.5 2" "0 2" "0 3"; do
  set -- $cfg
  timeout 60 $B/kvtier bench copy $S --strategies split --split-kernel-share $1 --split-dma-lanes $2 \
    > $R/h2d_split_$1_$2.jsonl 2>> $R/err.txt; echo "split $1 $2 rc=$?"
done
for i in 1 2 3; do
  timeout 60 $B/kvtier bench copy --backend cuda --json --reps 9 --block-sizes 32 --directions both --strategies dma_batch,split,auto \
    > $R/both32_$i.jsonl 2>> $R/err.txt; echo "both32 $i rc=$?"
done
tail -3 $R/err.txt
cat $R/*.jsonl | python3 -c "
import json,sys
rows=[json.loads(l) for l in sys.stdin if l.startswith('{')]
for r in rows:
    print(f\"{r['strategy']:9} {r.get('ran',''):22} s={r['split_kernel_share']:<4} l={r['split_dma_lanes']} {r['direction']:4} {r['block_bytes']//1024:3}K {r['gbps']:6.1f} {r['ceiling_gbps']:6.1f} {r['ratio']:.3f}\")
" > $OUT/table.txt
cat $OUT/table.txt
tar czf $OUT/run7.tgz -C $OUT r && rm -rf $R
