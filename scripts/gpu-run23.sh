#!/usr/bin/env bash
# GPU run 23 (session 3): a late split pauses its size class (any budget). GPU tests,
# H2D auto pre-queued (two processes), streaming (back-to-back pieces from an
# idle stream, CPU cost inside the timing) auto vs sm_kernel, D2H/both auto,
set -uo pipefail
B=${B:-.gpu-bin}
OUT=${OUT:-/tmp/kvtier-out}; R=$OUT/r; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for t in copy_gpu_test; do
  timeout 200 $B/$t --gtest_brief=1 > $R/$t.log 2>&1; echo "$t rc=$?"; grep -E "^\[  FAILED|PASSED|Failure" -A3 $R/$t.log | head -8
done
H2D="--backend cuda --json --reps 7 --strategies auto --directions h2d"
for i in 1 2; do
  timeout 120 $B/kvtier bench copy $H2D --block-sizes 4,8,12,16,20,24,28,32,48,64 > $R/h2d_$i.jsonl 2>> $R/err.txt; echo "h2d_$i rc=$?"
done
for p in 8 32; do
  timeout 120 $B/kvtier bench copy --backend cuda --json --reps 7 --strategies sm_kernel,auto --directions h2d --no-prequeue --pieces $p --block-sizes 4,8,16,32 > $R/stream_$p.jsonl 2>> $R/err.txt; echo "stream_$p rc=$?"
done
tail -3 $R/err.txt
python3 - <<PY | tee $OUT/table.txt
import json,os
for f in ['h2d_1','h2d_2','stream_8','stream_32']:
    p='$R/'+f+'.jsonl'
    if not os.path.exists(p): continue
    for l in open(p):
        if not l.startswith('{'): continue
        r=json.loads(l)
        if 'scenario' in r:
            if r['scenario'] in ('copy','overlap','duplex','gemm'):
                print(f, r['shape'], r['scenario'], {k:(round(v,3) if isinstance(v,float) else v) for k,v in r.items() if k in ('ms','bound_ms','gbps','pass','slowdown','moved_gbps','compute_stall_ms')})
            continue
        sh=' '.join('%.2f'%x for x in r.get('rep_kernel_shares',[])) if r['ran']=='split' else ''
        print(f"{f} {r['direction']} {r['block_bytes']//1024}K {r['strategy']} {r['ran']} {r['ratio']:.3f} {r['gbps']:.1f} api {r['host_api_ms']:.2f} lanes {r.get('lanes',0)} shares {sh}")
PY
tar czf $OUT/run23.tgz -C $OUT r && rm -rf $R
