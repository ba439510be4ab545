#!/usr/bin/env bash
# GPU run 5 (final of the session): copy tests, bench copy (random + contiguous, all directions), bench transfer.
set -uo pipefail
B=.gpu-bin
timeout 120 $B/copy_gpu_test --gtest_brief=1 > $OUT/copy_gpu_test.log 2>&1; echo "copy_gpu_test rc=$?"; grep -E "^\[  FAILED|PASSED" $OUT/copy_gpu_test.log
timeout 150 $B/kvtier bench copy --backend cuda --json --reps 5 --strategies sm_kernel dma_batch auto --directions h2d d2h both > $OUT/copy_random.jsonl 2> $OUT/err.txt; echo "random rc=$?"
timeout 90 $B/kvtier bench copy --backend cuda --json --reps 5 --pattern contiguous --strategies staged_dma auto --directions h2d d2h both > $OUT/copy_contig.jsonl 2>> $OUT/err.txt; echo "contig rc=$?"
tail -3 $OUT/err.txt
timeout 100 $B/kvtier bench transfer --backend cuda --json > $OUT/transfer.jsonl 2> $OUT/transfer.err; echo "transfer rc=$?"
cat $OUT/copy_*.jsonl | python3 -c "
import json,sys
for l in sys.stdin:
    if not l.startswith('{'): continue
    r=json.loads(l)
    if r['strategy']!='auto': continue
    print(f\"{r.get('pattern',''):10} {r['strategy']:10} {r.get('ran',''):30} {r['direction']:4} {r['block_bytes']//1024:5}K {r['gbps']:6.1f} {r['ceiling_gbps']:6.1f} {r['ratio']:.3f}\")
"
