#!/usr/bin/env bash
# GPU run 14 (session 2): why kAuto H2D at 32/48 KiB fell to 0.83-0.86 in run 13's
# auto-only runs: order (after 28 KiB auto) vs configuration. Short.
set -uo pipefail
B=${B:-.gpu-bin}
OUT=${OUT:-/tmp/kvtier-out}; R=$OUT/r; mkdir -p "$R"
A="--backend cuda --json --reps 7 --directions h2d"
timeout 60 $B/kvtier bench copy $A --strategies auto --block-sizes 32,48 > $R/a_32_48.jsonl 2>> $R/err.txt
timeout 60 $B/kvtier bench copy $A --strategies auto --block-sizes 28,32,48 > $R/b_28_32_48.jsonl 2>> $R/err.txt
timeout 60 $B/kvtier bench copy $A --strategies sm_kernel,auto --block-sizes 28,32,48 > $R/c_sm_auto.jsonl 2>> $R/err.txt
timeout 60 $B/kvtier bench copy $A --strategies auto --block-sizes 32,48 > $R/d_32_48_again.jsonl 2>> $R/err.txt
timeout 60 $B/kvtier bench copy $A --strategies split --split-kernel-share 0 --split-dma-lanes 2 --block-sizes 32,48 > $R/e_split02.jsonl 2>> $R/err.txt
for f in $R/*.jsonl; do python3 -c "
import json
rows=[json.loads(l) for l in open('$f') if l.startswith('{')]
print('$(basename $f)', ' | '.join(f\"{r['block_bytes']//1024}K {r['strategy']} {r['ratio']:.3f} api {r['host_api_ms']:.1f}\" for r in rows))
"; done | tee $OUT/table.txt
tar czf $OUT/run14.tgz -C $OUT r && rm -rf $R
