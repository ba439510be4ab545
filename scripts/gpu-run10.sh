#!/usr/bin/env bash
# GPU run 10 (session 2): every GPU test after the registration and host->host
# fixes (device conformance, copy, cuda device, transfer) + a transfer bench.
set -uo pipefail
B=${B:-.gpu-bin}
OUT=${OUT:-/tmp/kvtier-out}; R=$OUT/r; mkdir -p "$R"
for t in device_conformance_test copy_gpu_test cuda_device_test transfer_gpu_test; do
  timeout 200 $B/$t --gtest_brief=1 > $R/$t.log 2>&1; echo "$t rc=$?"; grep -E "^\[  FAILED|PASSED|Failure" -A3 $R/$t.log | head -12
done
timeout 150 $B/kvtier bench transfer --backend cuda --json > $R/transfer.jsonl 2>> $R/err.txt; echo "transfer rc=$?"
python3 -c "
import json
for l in open('$R/transfer.jsonl'):
    if not l.startswith('{'): continue
    r=json.loads(l)
    if r.get('scenario') in ('copy','overlap','duplex','gemm'):
        print(r.get('shape'), r.get('scenario'), {k:(round(v,3) if isinstance(v,float) else v) for k,v in r.items() if k in ('ms','bound_ms','gbps','ratio','compute_stall_ms','pass','slowdown','moved_gbps')})
" | tee $OUT/table.txt
tar czf $OUT/run10.tgz -C $OUT r && rm -rf $R
