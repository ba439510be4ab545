#!/usr/bin/env bash
# GPU run 27 (session 3, final code): the 4 KiB margin. H2D auto pre-queued at
# 4 and 8 KiB with the adaptive CPU budget's floor at 16 KiB (default), 12 KiB
# and 8 KiB per descriptor, three processes each, alternating.
set -uo pipefail
B=${B:-.gpu-bin}
OUT=${OUT:-/tmp/kvtier-out}; R=$OUT/r; mkdir -p "$R"
C="--backend cuda --json --reps 7 --strategies auto --directions h2d --block-sizes 4,8"
for i in 1 2 3; do
  for m in 16K 12K 8K; do
    KVTIER_COPY_AUTO_SPLIT_MIN_PAYLOAD_BYTES_PER_DMA_DESCRIPTOR=$m timeout 60 $B/kvtier bench copy $C > $R/min${m}_$i.jsonl 2>> $R/err.txt; echo "min$m $i rc=$?"
  done
done
tail -3 $R/err.txt
args=""; for i in 1 2 3; do for m in 16K 12K 8K; do args="$args min${m}_$i=$R/min${m}_$i.jsonl"; done; done
python3 scripts/gpu_table.py $args | tee $OUT/table.txt
tar czf $OUT/run27.tgz -C $OUT r && rm -rf $R
