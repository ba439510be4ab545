#!/usr/bin/env bash
# GPU run 4: kAuto in full duplex after the rule change; batched DMA one-way, pre-queued.
set -uo pipefail
B=.gpu-bin
timeout 60 $B/kvtier bench copy --backend cuda --json --reps 5 --strategies auto --block-sizes 4 16 32 64 256 --directions both > $OUT/auto_both_random.jsonl 2> $OUT/err.txt; echo "rc=$?"
timeout 60 $B/kvtier bench copy --backend cuda --json --reps 5 --pattern contiguous --strategies auto --block-sizes 4 16 32 64 256 --directions both > $OUT/auto_both_contig.jsonl 2>> $OUT/err.txt; echo "rc=$?"
timeout 60 $B/kvtier bench copy --backend cuda --json --reps 5 --strategies dma_batch --block-sizes 32 64 256 1024 --directions h2d d2h > $OUT/batch_random.jsonl 2>> $OUT/err.txt; echo "rc=$?"
tail -3 $OUT/err.txt
cat $OUT/*.jsonl | python3 -c "
import json,sys
for l in sys.stdin:
    if not l.startswith('{'): continue
    r=json.loads(l)
    print(f\"{r.get('pattern',''):10} {r['strategy']:10} {r.get('ran',''):30} {r['direction']:4} {r['block_bytes']//1024:5}K {r['gbps']:6.1f} {r['ceiling_gbps']:6.1f} {r['ratio']:.3f}\")
"
