#!/usr/bin/env bash
# The test command: builds and runs every CPU test in three configurations:
#   default (CUDA compiled + linked when nvcc is present; GPU tests skip without a GPU),
#   asan (AddressSanitizer + UBSan) and tsan (ThreadSanitizer), both CPU only.
# Test services (Redis on loopback) are started first when the script exists.
# Then installs the Python package into .venv (scripts/install-python.sh) and
# runs its pytest suite (host backend; CUDA too where torch sees a GPU).
# Usage: scripts/test.sh [preset ...]   (default: default asan tsan)
#        KVTIER_SKIP_PYTHON=1 skips the Python part.
# After the presets, scripts/run-fuzzers.sh builds the libFuzzer harnesses (preset fuzz) and runs
# each for 20 s (KVTIER_FUZZ_SECONDS); KVTIER_SKIP_FUZZ=1 skips it.
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
if [ "${KVTIER_SKIP_FUZZ:-0}" != 1 ]; then
  echo "=== fuzzers (preset fuzz) ==="
  scripts/run-fuzzers.sh
fi
if [ "${KVTIER_SKIP_PYTHON:-0}" != 1 ]; then
  echo "=== python package (pip install . into .venv, pytest) ==="
  scripts/install-python.sh
  PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -m pytest -q python/tests
fi
echo "=== all tests passed (${presets[*]} + python) ==="
