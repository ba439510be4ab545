#!/usr/bin/env bash
# GPU run 3: tests after the chunk-split and transfer-strategy fixes; bench transfer; duplex copy variants.
set -uo pipefail
B=.gpu-bin
for t in cuda_device_test device_conformance_test copy_gpu_test transfer_gpu_test; do
  timeout 120 $B/$t --gtest_brief=1 > $OUT/$t.log 2>&1; echo "$t rc=$?"; grep -E "^\[  FAILED|PASSED" $OUT/$t.log | head -8
done
cat $OUT/*_test.log > $OUT/tests.log; rm -f $OUT/*_test.log
timeout 120 $B/kvtier bench transfer --backend cuda --json > $OUT/transfer.jsonl 2> $OUT/transfer.err; echo "transfer rc=$?"; tail -3 $OUT/transfer.err
timeout 60 $B/kvtier bench copy --backend cuda --json --reps 5 --pattern contiguous --strategies staged_dma dma_batch sm_kernel --block-sizes 32 --directions both > $OUT/copy_dup_contig.jsonl 2> $OUT/copy_dup.err; echo "dup contig rc=$?"
timeout 60 $B/kvtier bench copy --backend cuda --json --reps 5 --strategies dma_batch --block-sizes 32 --directions both > $OUT/copy_dup_random.jsonl 2>> $OUT/copy_dup.err; echo "dup random rc=$?"; tail -2 $OUT/copy_dup.err
python3 - <<'PY'
import json, glob, os
out = os.environ['OUT']
for f in sorted(glob.glob(out + '/*.jsonl')):
    for l in open(f):
        if not l.startswith('{'): continue
        r = json.loads(l)
        if r.get('bench') == 'transfer':
            if r['scenario'] == 'stats': continue
            keep = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k not in ('backend', 'bench', 'prefix_bytes', 'blocks')}
            print('transfer', keep)
        else:
            print(f"{r.get('pattern',''):10} {r['strategy']:10} {r.get('ran',''):30} {r['direction']:4} {r['block_bytes']//1024:5}K {r['gbps']:6.1f} {r['ceiling_gbps']:6.1f} {r['ratio']:.3f}")
PY
