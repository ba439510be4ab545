#!/usr/bin/env bash
# Builds the `gpu` preset (nvcc, sm_90a, static cudart) and packs the stripped
# binaries a GPU machine needs (kvtier and the *_test binaries) into .gpu-bin/
# (ignored by git). Copy the checkout with .gpu-bin/ to the GPU machine and run
# scripts/gpu-check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --preset gpu >/dev/null
cmake --build --preset gpu -j "$(nproc)"
rm -rf .gpu-bin && mkdir -p .gpu-bin
cp build/gpu/tools/kvtier .gpu-bin/
find build/gpu/tests -maxdepth 2 -type f -executable -name '*_test' -exec cp {} .gpu-bin/ \;
strip .gpu-bin/* 2>/dev/null || true
du -sh .gpu-bin; ls .gpu-bin
