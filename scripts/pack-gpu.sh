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
# ucx_perftest for kvtier bench pd's host-lane rows, where this machine has it (Debian's ucx-utils): the binary,
# the UCX and libnuma / libgomp libraries it loads and UCX's transport modules, into .gpu-pack/ (ignored by git);
# scripts/gpu-check.sh puts them on PATH / LD_LIBRARY_PATH / UCX_MODULE_DIR on the GPU machine.
if perftest=$(command -v ucx_perftest); then
  rm -rf .gpu-pack && mkdir -p .gpu-pack/bin .gpu-pack/lib/ucx
  cp "$perftest" .gpu-pack/bin/
  ldd "$perftest" | awk '/=> \// && /libuc[pstm]|libnuma|libgomp/ {print $3}' | xargs -r -I{} cp -L {} .gpu-pack/lib/
  moddir=$(dirname "$(ldd "$perftest" | awk '/libuct\.so/ {print $3}')")/ucx
  [ -d "$moddir" ] || moddir=/usr/lib/x86_64-linux-gnu/ucx
  cp -L "$moddir"/*.so.0 .gpu-pack/lib/ucx/ 2>/dev/null || true
  du -sh .gpu-pack
fi
