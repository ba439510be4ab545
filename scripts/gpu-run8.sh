#!/usr/bin/env bash
# GPU run 8 (session 2): the issue-2/3 tables with the final kAuto (split
# profile) and the async TransferManager; GPU tests incl. the host->host fix.
set -uo pipefail
B=${B:-.gpu-bin}
OUT=${OUT:-/tmp/kvtier-out}; R=$OUT/r; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
for t in device_conformance_test copy_gpu_test cuda_device_test transfer_gpu_test; do
  timeout 150 $B/$t --gtest_brief=1 > $R/$t.log 2>&1; echo "$t rc=$?"; grep -E "^\[  FAILED|PASSED|Failure" -A3 $R/$t.log | head -12
done
A="--backend cuda --json --reps 7"
timeout 150 $B/kvtier bench copy $A --strategies sm_kernel,dma_batch,split,auto --directions h2d,d2h,both > $R/random.jsonl 2>> $R/err.txt; echo "random rc=$?"
timeout 90 $B/kvtier bench copy $A --strategies auto --directions h2d --block-sizes 4,8,12,16,20,24,28,32,48 > $R/random_h2d_again.jsonl 2>> $R/err.txt; echo "random h2d again rc=$?"
timeout 90 $B/kvtier bench copy $A --pattern contiguous --strategies auto --directions h2d,d2h,both > $R/contig.jsonl 2>> $R/err.txt; echo "contig rc=$?"
timeout 150 $B/kvtier bench transfer --backend cuda --json > $R/transfer.jsonl 2>> $R/err.txt; echo "transfer rc=$?"
tail -3 $R/err.txt
cat $R/random*.jsonl $R/contig.jsonl | python3 -c "
import json,sys
for l in sys.stdin:
    if not l.startswith('{'): continue
    r=json.loads(l)
    print(f\"{r.get('pattern',''):10} {r['strategy']:9} {r.get('ran',''):22} {r['direction']:4} {r['block_bytes']//1024:5}K {r['gbps']:6.1f} {r['ceiling_gbps']:6.1f} {r['ratio']:.3f}\")
" > $OUT/table.txt
python3 -c "
import json
for l in open('$R/transfer.jsonl'):
    if not l.startswith('{'): continue
    r=json.loads(l)
    if r.get('scenario') in ('ceiling','copy','overlap','duplex','gemm','stats'):
        print(r.get('shape'), r.get('scenario'), {k:(round(v,3) if isinstance(v,float) else v) for k,v in r.items() if k in ('ms','bound_ms','gbps','ratio','compute_stall_ms','pass','slowdown','moved_gbps','h2d_gbps','d2h_gbps','both_gbps','compute_ms','copy_ms')})
" >> $OUT/table.txt
cat $OUT/table.txt
tar czf $OUT/run8.tgz -C $OUT r && rm -rf $R
