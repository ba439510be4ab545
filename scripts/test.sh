#!/usr/bin/env bash
# The test command: builds and runs every CPU test in three configurations:
#   default (CUDA compiled + linked when nvcc is present; GPU tests skip without a GPU),
#   asan (AddressSanitizer + UBSan) and tsan (ThreadSanitizer), both CPU only.
# Test services (Redis on loopback) are started first when the script exists.
# Usage: scripts/test.sh [preset ...]   (default: default asan tsan)
set -euo pipefail
cd "$(dirname "$0")/.."
presets=("$@")
[ ${#presets[@]} -gt 0 ] || presets=(default asan tsan)
if [ -x scripts/start-test-services.sh ]; then
  eval "$(scripts/start-test-services.sh)"
fi
jobs=$(nproc)
for p in "${presets[@]}"; do
  echo "=== preset $p ==="
  cmake --preset "$p" >/dev/null
  cmake --build --preset "$p" -j "$jobs"
  ctest --preset "$p" -j "$jobs"
done
echo "=== all tests passed (${presets[*]}) ==="
