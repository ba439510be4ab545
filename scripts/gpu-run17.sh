#!/usr/bin/env bash
# GPU run 17 (session 3): h2d_probe (load-instruction variants of the SM
# gather kernel, kernel + DMA split with threaded lane submission) and the
# engine's current H2D auto/sm_kernel numbers on the same machine.
set -uo pipefail
OUT=${OUT:-/tmp/kvtier-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
timeout 300 .gpu-probe/h2d_probe 256 5 > $OUT/probe.txt 2>&1; echo "probe rc=$?"
timeout 150 .gpu-bin/kvtier bench copy --backend cuda --json --reps 5 --strategies sm_kernel,auto --directions h2d --block-sizes 4,8,16,32,48 > $OUT/copy.jsonl 2>> $OUT/err.txt; echo "copy rc=$?"
grep -E "ceiling|VERIFY|^A|^B" $OUT/probe.txt | awk '{print}' > /dev/null
python3 - <<PY | tee $OUT/table.txt
import json,re
for l in open('$OUT/probe.txt'):
    if l.startswith(('ceiling','VERIFY','#')) or l.startswith('A '): print(l.rstrip())
best={}
for l in open('$OUT/probe.txt'):
    if l.startswith('B '):
        m=re.search(r'bs=\s*(\d+)K kern=(\S+)\s+lanes=(\d) share=([\d.]+)\s+([\d.]+) GB/s ratio ([\d.]+) api ([\d.]+)',l)
        bs,k,ln,sh,g,r,api=m.groups()
        print(f'B {bs}K {k} l{ln} s{sh} {r} api{api}')
for l in open('$OUT/copy.jsonl'):
    if l.startswith('{'):
        r=json.loads(l); print(f"engine {r['direction']} {r['block_bytes']//1024}K {r['strategy']} {r.get('ran','')} {r['ratio']:.3f}")
PY
