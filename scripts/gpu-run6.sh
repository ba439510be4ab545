#!/usr/bin/env bash
# GPU run 6 (session 2): async-submission TransferManager and the kSplit copy
# strategy. GPU tests, bench transfer (auto and split), and a kSplit sweep
# (kernel share x DMA lanes) at 16-32 KiB random blocks, h2d and both ways.
set -uo pipefail
B=.gpu-bin
OUT=${OUT:-/tmp/kvtier-out}; mkdir -p "$OUT"
for t in copy_gpu_test transfer_gpu_test; do
  timeout 150 $B/$t --gtest_brief=1 > $OUT/$t.log 2>&1; echo "$t rc=$?"; grep -E "^\[  FAILED|PASSED|Failure" $OUT/$t.log | head -8
done
timeout 120 $B/kvtier bench transfer --backend cuda --json > $OUT/transfer_auto.jsonl 2> $OUT/transfer_auto.err; echo "transfer auto rc=$?"
timeout 120 $B/kvtier bench transfer --backend cuda --json --strategy split > $OUT/transfer_split.jsonl 2> $OUT/transfer_split.err; echo "transfer split rc=$?"
S="--backend cuda --json --reps 5 --block-sizes 16,24,28,32"
timeout 60 $B/kvtier bench copy $S --strategies sm_kernel,dma_batch,auto --directions h2d,both > $OUT/copy_base.jsonl 2>> $OUT/copy.err; echo "base rc=$?"
for cfg in "0 2" "0 4" "0.5 1" "0.5 2" "0.65 1" "0.65 2" "0.8 1" "0.35 2"; do
  set -- $cfg
  timeout 60 $B/kvtier bench copy $S --strategies split --directions h2d,both --split-kernel-share $1 --split-dma-lanes $2 \
    > $OUT/copy_split_$1_$2.jsonl 2>> $OUT/copy.err; echo "split $1 $2 rc=$?"
done
tail -3 $OUT/copy.err
cat $OUT/transfer_*.jsonl | python3 -c "
import json,sys
for l in sys.stdin:
    if not l.startswith('{'): continue
    r=json.loads(l)
    sc=r.get('scenario')
    if sc in ('overlap','duplex','copy','gemm'):
        print(r.get('shape'), r.get('strategy'), sc, {k: (round(v,3) if isinstance(v,float) else v) for k,v in r.items() if k in ('ms','bound_ms','gbps','ratio','compute_stall_ms','pass','slowdown','moved_gbps')})
"
cat $OUT/copy_*.jsonl | python3 -c "
import json,sys
for l in sys.stdin:
    if not l.startswith('{'): continue
    r=json.loads(l)
    print(f\"{r['strategy']:9} {r.get('ran',''):22} s={r['split_kernel_share']:<4} l={r['split_dma_lanes']} {r['direction']:4} {r['block_bytes']//1024:3}K {r['gbps']:6.1f} {r['ceiling_gbps']:6.1f} {r['ratio']:.3f}\")
"
