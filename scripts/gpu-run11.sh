#!/usr/bin/env bash
# GPU run 11 (session 2): distribution of random H2D at 4-8 KiB (kAuto, 5
# processes) and explicit split shares 0.85/0.9 with one lane (3 processes each).
set -uo pipefail
B=${B:-.gpu-bin}
OUT=${OUT:-/tmp/kvtier-out}; R=$OUT/r; mkdir -p "$R"
A="--backend cuda --json --reps 7 --directions h2d --block-sizes 4,8,12"
for i in 1 2 3 4 5; do timeout 60 $B/kvtier bench copy $A --strategies sm_kernel,auto > $R/auto_$i.jsonl 2>> $R/err.txt; done
for sh in 0.85 0.9; do for i in 1 2 3; do
  timeout 60 $B/kvtier bench copy $A --strategies split --split-kernel-share $sh --split-dma-lanes 1 > $R/split_${sh}_$i.jsonl 2>> $R/err.txt
done; done
tail -2 $R/err.txt
for f in $R/*.jsonl; do python3 -c "
import json,sys
rows=[json.loads(l) for l in open('$f') if l.startswith('{')]
print('$(basename $f)', ' '.join(f\"{r['strategy'][:5]}{r['block_bytes']//1024}K={r['ratio']:.3f}\" for r in rows))
"; done | tee $OUT/table.txt
tar czf $OUT/run11.tgz -C $OUT r && rm -rf $R
