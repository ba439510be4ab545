#!/usr/bin/env bash
# Builds kvtier's wheel (scripts/build-wheel.sh: pip wheel + auditwheel repair, into dist/) and installs
# it into the virtual environment .venv at the repo root (Debian's Python refuses system-wide pip
# installs), with the packages its tests use. The same wheel installs anywhere its manylinux tag
# allows: `pip install dist/kvtier-*.whl`.
# Usage: scripts/install-python.sh
#   KVTIER_PYTHON_CUDA=ON|OFF   compile the CUDA backend (default: where nvcc is found)
#   PYTHON                      interpreter of .venv and of the wheel (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
args=(--python "$PY" --out dist)
if [ -n "${KVTIER_PYTHON_CUDA:-}" ]; then args+=(--cuda "$KVTIER_PYTHON_CUDA"); fi
wheel=$(scripts/build-wheel.sh "${args[@]}" | tail -n 1)
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q --force-reinstall --no-deps "$wheel"
.venv/bin/python -m pip install -q numpy pytest prometheus-client pyzmq
(cd / && "$OLDPWD/.venv/bin/python" -c "import kvtier; print('kvtier', kvtier.__version__, 'installed in .venv from', '$wheel', '(backend:', kvtier.open_device().backend + ')')")
