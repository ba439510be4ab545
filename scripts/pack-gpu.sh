#!/usr/bin/env bash
# Builds the `gpu` preset here (nvcc, sm_90a, static cudart) and packs the stripped
# binaries the H200 run needs into .gpu-bin/ (ignored by git; carried by the device tool).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --preset gpu >/dev/null
cmake --build --preset gpu -j "$(nproc)"
rm -rf .gpu-bin && mkdir -p .gpu-bin
cp build/gpu/tools/kvtier .gpu-bin/
find build/gpu/tests -maxdepth 2 -type f -executable -name '*_test' -exec cp {} .gpu-bin/ \;
strip .gpu-bin/* 2>/dev/null || true
du -sh .gpu-bin; ls .gpu-bin
