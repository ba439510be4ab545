#!/usr/bin/env bash
# GPU run 26 (session 3, final code): run 25's ceilings moved 1-5 % within a
# process (host noise); H2D auto pre-queued again, three processes.
set -uo pipefail
B=${B:-.gpu-bin}
OUT=${OUT:-/tmp/kvtier-out}; R=$OUT/r; mkdir -p "$R"
C="--backend cuda --json --reps 7"
for i in 1 2 3; do
  timeout 120 $B/kvtier bench copy $C --strategies auto --directions h2d --block-sizes 4,8,12,16,24,32,48 > $R/h2d_$i.jsonl 2>> $R/err.txt; echo "h2d_$i rc=$?"
done
tail -3 $R/err.txt
python3 scripts/gpu_table.py h2d_1=$R/h2d_1.jsonl h2d_2=$R/h2d_2.jsonl h2d_3=$R/h2d_3.jsonl | tee $OUT/table.txt
python3 - <<PY
import json
for i in (1,2,3):
    for l in open('$R/h2d_%d.jsonl' % i):
        if l.startswith('{'):
            r = json.loads(l); print('ceiling', i, r['block_bytes']//1024, round(r['ceiling_gbps'], 2))
PY
tar czf $OUT/run26.tgz -C $OUT r && rm -rf $R
