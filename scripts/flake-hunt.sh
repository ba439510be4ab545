#!/usr/bin/env bash
# Runs the whole CPU suite N times per preset (default 5; tsan asan), as CI
# does (ctest -j$(nproc), Redis services up), and prints one line per run. Logs of
# every run stay in $FLAKE_LOG_DIR (default /tmp/kvtier-flake-hunt). Use it before
# merging a change that touched tests with threads, timing or services: CI is one
# run, so a 1-in-100 flake still fails it now and then.
# Usage: scripts/flake-hunt.sh [N] [preset ...]
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
shift || true
presets=("$@")
[ ${#presets[@]} -gt 0 ] || presets=(tsan asan)
logs=${FLAKE_LOG_DIR:-/tmp/kvtier-flake-hunt}
mkdir -p "$logs"
eval "$(scripts/start-test-services.sh 2>/dev/null)"
failed=0
for p in "${presets[@]}"; do
  if ! { cmake --preset "$p" >/dev/null && cmake --build --preset "$p" -j "$(nproc)"; } >"$logs/build-$p.log" 2>&1; then
    echo "$p: build failed ($logs/build-$p.log)"
    failed=1
    continue
  fi
  for i in $(seq 1 "$runs"); do
    ctest --preset "$p" -j "$(nproc)" --output-on-failure >"$logs/$p-$i.log" 2>&1
    rc=$?
    echo "$p run $i rc=$rc $(grep -E 'tests passed' "$logs/$p-$i.log") $(grep -A20 'The following tests FAILED' "$logs/$p-$i.log" | grep -E '^\s+[0-9]+ -' | tr -s ' ' | tr '\n' ';')"
    [ $rc -eq 0 ] || failed=1
  done
done
exit $failed
