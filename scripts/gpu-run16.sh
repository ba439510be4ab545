#!/usr/bin/env bash
# GPU run 16 (session 2, after the review commit: CudaDevice tracks device
# allocations, memcpy_sync reuses split_memcpy): every GPU test, the copy
# bench (per-run strategy uses memcpy_async per segment) and bench transfer.
set -uo pipefail
B=${B:-.gpu-bin}
OUT=${OUT:-/tmp/kvtier-out}; R=$OUT/r; mkdir -p "$R"
for t in device_conformance_test cuda_device_test copy_gpu_test transfer_gpu_test; do
  timeout 200 $B/$t --gtest_brief=1 > $R/$t.log 2>&1; echo "$t rc=$?"; grep -E "^\[  FAILED|PASSED|Failure" -A3 $R/$t.log | head -8
done
timeout 150 $B/kvtier bench copy --backend cuda --json --reps 5 --strategies dma_per_run,sm_kernel,auto --directions h2d,d2h --block-sizes 4,32,256,1024 > $R/copy.jsonl 2>> $R/err.txt; echo "copy rc=$?"
timeout 150 $B/kvtier bench transfer --backend cuda --json > $R/transfer.jsonl 2>> $R/err.txt; echo "transfer rc=$?"
tail -2 $R/err.txt
python3 -c "
import json
for f in ('$R/copy.jsonl','$R/transfer.jsonl'):
    for l in open(f):
        if not l.startswith('{'): continue
        r=json.loads(l)
        if 'scenario' in r:
            if r['scenario'] in ('copy','overlap','duplex','gemm'):
                print(r['shape'], r['scenario'], {k:(round(v,3) if isinstance(v,float) else v) for k,v in r.items() if k in ('ms','bound_ms','gbps','pass','slowdown','moved_gbps','compute_stall_ms')})
        else:
            print(f\"{r['direction']} {r['block_bytes']//1024}K {r['strategy']} {r.get('ran','')} {r['ratio']:.3f} api {r['host_api_ms']:.2f}\")
" | tee $OUT/table.txt
tar czf $OUT/run16.tgz -C $OUT r && rm -rf $R
