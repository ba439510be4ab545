#!/usr/bin/env bash
# First GPU run of the copy engine: GPU tests, then bench copy variants (logs in $OUT).
set -uo pipefail
B=.gpu-bin
for t in cuda_device_test device_conformance_test copy_gpu_test; do
  timeout 240 $B/$t --gtest_brief=1 > $OUT/$t.log 2>&1; echo "$t rc=$?"; grep -E "^\[  FAILED|Failure|PASSED|FAILED TEST" $OUT/$t.log | head -12
done
timeout 200 $B/kvtier bench copy --backend cuda --json --reps 5 --strategies sm_kernel dma_per_run auto --directions h2d d2h both > $OUT/bench_random.jsonl 2> $OUT/bench_random.err; echo "random rc=$?"; tail -3 $OUT/bench_random.err
timeout 60 $B/kvtier bench copy --backend cuda --json --reps 5 --strategies dma_batch --block-sizes 32 64 256 1024 --gate-max-kib 0 --directions h2d d2h both > $OUT/bench_batch.jsonl 2> $OUT/bench_batch.err; echo "batch rc=$?"; tail -3 $OUT/bench_batch.err
timeout 90 $B/kvtier bench copy --backend cuda --json --reps 5 --strategies auto sm_kernel --pattern contiguous --directions h2d d2h both > $OUT/bench_contig.jsonl 2> $OUT/bench_contig.err; echo "contig rc=$?"; tail -3 $OUT/bench_contig.err
cat $OUT/bench_*.jsonl | python3 -c "
import json,sys
for l in sys.stdin:
    if not l.startswith('{'): continue
    r=json.loads(l)
    print(f\"{r.get('pattern',''):10} {r['strategy']:11} {r.get('ran',''):22} {r['direction']:4} {r['block_bytes']//1024:5}K {r['gbps']:6.1f} {r['ceiling_gbps']:6.1f} {r['ratio']:.3f} ctas={r.get('ctas',0)}\")
"
