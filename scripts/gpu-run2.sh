#!/usr/bin/env bash
# GPU run 2: all GPU tests, bench copy (random + contiguous host runs), bench transfer.
set -uo pipefail
B=.gpu-bin
for t in cuda_device_test device_conformance_test copy_gpu_test transfer_gpu_test; do
  timeout 150 $B/$t --gtest_brief=1 > $OUT/$t.log 2>&1; echo "$t rc=$?"; grep -E "^\[  FAILED|PASSED|FAILED TEST" $OUT/$t.log | head -8
done
cat $OUT/*_test.log > $OUT/tests.log; rm -f $OUT/*_test.log
timeout 150 $B/kvtier bench copy --backend cuda --json --reps 5 --strategies sm_kernel auto --directions h2d d2h both > $OUT/copy_random.jsonl 2> $OUT/copy_random.err; echo "random rc=$?"; tail -2 $OUT/copy_random.err
timeout 100 $B/kvtier bench copy --backend cuda --json --reps 5 --pattern contiguous --strategies staged_dma auto --block-sizes 4 16 32 64 256 1024 --directions h2d d2h both > $OUT/copy_contig.jsonl 2> $OUT/copy_contig.err; echo "contig rc=$?"; tail -2 $OUT/copy_contig.err
timeout 120 $B/kvtier bench transfer --backend cuda --json > $OUT/transfer.jsonl 2> $OUT/transfer.err; echo "transfer rc=$?"; tail -5 $OUT/transfer.err; cat $OUT/transfer.jsonl | head -20
cat $OUT/copy_*.jsonl | python3 -c "
import json,sys
for l in sys.stdin:
    if not l.startswith('{'): continue
    r=json.loads(l)
    print(f\"{r.get('pattern',''):10} {r['strategy']:10} {r.get('ran',''):26} {r['direction']:4} {r['block_bytes']//1024:5}K {r['gbps']:6.1f} {r['ceiling_gbps']:6.1f} {r['ratio']:.3f} api={r.get('host_api_ms',0):.2f}ms\")
"
