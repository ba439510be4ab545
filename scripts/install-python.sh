#!/usr/bin/env bash
# Installs the kvtier Python package (extension + CLI) into the virtual
# environment .venv at the repo root (Debian's Python refuses system-wide pip
# installs), with its build and test dependencies from PyPI. Incremental: the
# CMake build tree build/python/ is kept between runs.
# Usage: scripts/install-python.sh [extra pip args, e.g. -C cmake.define.KVTIER_CUDA=OFF]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.0" numpy pytest prometheus-client pyzmq
# CUDA kernels are compiled when nvcc is found (KVTIER_CUDA=ON by default);
# KVTIER_PYTHON_CUDA=OFF builds the CPU-only extension (the host backend).
args=()
if [ -n "${KVTIER_PYTHON_CUDA:-}" ]; then args+=(-C "cmake.define.KVTIER_CUDA=${KVTIER_PYTHON_CUDA}"); fi
.venv/bin/python -m pip install -q --no-build-isolation "${args[@]}" "$@" .
.venv/bin/python -c "import kvtier; print('kvtier', kvtier.__version__, 'installed in .venv (backend:', kvtier.open_device().backend + ')')"
