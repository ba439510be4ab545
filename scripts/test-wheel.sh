#!/usr/bin/env bash
# Installs a kvtier wheel into a fresh virtual environment and runs the pytest suite against it, as a
# user who has only the wheel would: the environment is made anew, the package is imported from its
# site-packages (never from python/kvtier of this checkout), and every shared library that the
# extension and the CLI load must come from the wheel itself or from the C library that every
# manylinux system has, not from the -dev packages this machine has installed.
# Usage: scripts/test-wheel.sh <kvtier-*.whl> [pytest args...]
#        scripts/test-wheel.sh --prepare-env
#   --prepare-env  only makes the environment with everything but kvtier (pytest, SGLang, vLLM, torch: mostly
#                  downloads, so CI does it while it builds); the next run with a wheel then uses that
#                  environment once, installs the wheel into it and makes it anew afterwards
#   PYTHON   interpreter of the environment (default python3; its version must match the wheel's tag)
#   KVTIER_PYTEST_PROCESSES   1: one pytest process (default 2: the suite split in two by file, run side by side;
#            with pytest args given it is always one)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
env=build/wheel-test-venv
prepared=$env/.prepared-without-kvtier
prepare_only=0
if [ "${1:-}" = --prepare-env ]; then
  prepare_only=1
else
  wheel=${1:?usage: scripts/test-wheel.sh <kvtier-*.whl> [pytest args...] | --prepare-env}
  shift
  [ -f "$wheel" ] || { echo "test-wheel: no wheel at '$wheel'" >&2; exit 2; }
fi

# The third-party part of the environment: everything the tests use but kvtier itself.
prepare_env() {
  rm -rf "$env"
  "$py" -m venv "$env"
  "$env/bin/python" -m pip install -q --upgrade pip
  "$env/bin/python" -m pip install -q pytest prometheus-client pyzmq numpy
  # SGLang's HiCache storage interface for kvtier.sglang's tests against the real classes: the package
  # alone (--no-deps: about 40 MB, 220 MB installed, under 10 s; its storage module needs none of its
  # dependencies, see python/tests/sglang_real.py). Where it cannot be installed those tests skip.
  "$env/bin/python" -m pip install -q --no-deps "sglang==0.5.23" ||
    echo "test-wheel: sglang 0.5.23 not installable here; kvtier.sglang's tests against it skip" >&2
  # vLLM's native offloading interface for kvtier.vllm's tests (python/tests/test_vllm.py), pinned: vLLM alone
  # (--no-deps; vllm.v1.kv_offload needs only numpy, packaging and msgspec of its dependencies, and vLLM's logger
  # psutil, urllib3, regex, pydantic and pyzmq when it logs once per rank) and torch (its pure-Python dependencies:
  # typing_extensions, filelock, sympy, networkx, jinja2, fsspec), whose
  # PyPI wheel is a CUDA build: of its CUDA libraries only those the machine's CUDA toolkit lacks (NCCL, cuSPARSELt,
  # NVSHMEM, cuFile) come from PyPI; where torch still does not import, torch's full dependency set is installed.
  # About 1.2 GB downloaded, 2.3 GB installed, 80-85 s on a 2-core machine (docs/engines.md). Where none of it can
  # be installed those tests skip.
  vllm_start=$SECONDS
  if "$env/bin/python" -m pip install -q --no-deps "vllm==0.34.0" "torch==2.14.0" "nvidia-nccl-cu13==2.30.7" \
      "nvidia-cusparselt-cu13==0.8.1" "nvidia-nvshmem-cu13==3.4.5" "nvidia-cufile==1.15.1.6.*" &&
    "$env/bin/python" -m pip install -q numpy packaging msgspec typing_extensions filelock psutil urllib3 regex \
      pydantic sympy networkx jinja2 fsspec; then
    if ! why=$(env_python="$PWD/$env/bin/python" && cd / && "$env_python" -c "import torch, vllm.v1.kv_offload.base" 2>&1); then
      echo "test-wheel: torch does not import with the machine's CUDA libraries ($(tail -n 1 <<<"$why")); installing its dependencies" >&2
      "$env/bin/python" -m pip install -q "torch==2.14.0" ||
        echo "test-wheel: torch 2.14.0 not installable here; kvtier.vllm's tests skip" >&2
    fi
  else
    echo "test-wheel: vllm 0.34.0 / torch 2.14.0 not installable here; kvtier.vllm's tests skip" >&2
  fi
  echo "test-wheel: vLLM's offloading interface installed in $((SECONDS - vllm_start)) s"
}

if [ $prepare_only = 1 ]; then
  prepare_env
  echo "$py" >"$prepared"
  exit 0
fi
# A prepared environment is used once: the marker goes, so that the next run starts from a fresh one.
if [ -f "$prepared" ] && [ "$(cat "$prepared")" = "$py" ]; then
  rm -f "$prepared"
  echo "test-wheel: using the environment prepared in $env"
else
  prepare_env
fi
"$env/bin/python" -m pip install -q "$wheel"

# The package must be the installed one, and its native code must resolve to the wheel's libraries.
# Run from outside the checkout so that no source folder can shadow site-packages.
"$env/bin/python" - "$PWD" <<'EOF'
import os, subprocess, sys, sysconfig

checkout = sys.argv[1]
os.chdir("/")
import kvtier, kvtier._native as native

site = sysconfig.get_paths()["purelib"]
assert kvtier.__file__.startswith(site), f"kvtier imported from {kvtier.__file__}, not from {site}"
pkg = os.path.dirname(kvtier.__file__)
libs = os.path.join(site, "kvtier.libs")
# What every manylinux system provides (the glibc family); everything else must be bundled.
system_ok = ("linux-vdso.so", "libc.so", "libm.so", "libpthread.so", "libdl.so", "librt.so", "ld-linux",
             "libgcc_s.so", "libstdc++.so")
elves = [native.__file__] + [os.path.join(pkg, "bin", f) for f in os.listdir(os.path.join(pkg, "bin"))] \
    if os.path.isdir(os.path.join(pkg, "bin")) else [native.__file__]
for elf in elves:
    out = subprocess.run(["ldd", elf], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        name = line.strip().split()[0]
        if "not found" in line:
            sys.exit(f"{elf}: {name} not found")
        if name.startswith(system_ok) or name.startswith("/"):
            continue
        path = os.path.realpath(line.split("=>")[1].split()[0]) if "=>" in line else ""
        if not path.startswith(os.path.realpath(libs) + os.sep):
            sys.exit(f"{elf}: {name} resolves to {path}, outside the wheel ({libs})")
    print(f"test-wheel: {os.path.relpath(elf, site)}: every library from the wheel or the C library")
print("test-wheel: kvtier", kvtier.__version__, "from", pkg, "backend", kvtier.open_device().backend)
EOF
cd python/tests
pytest=("../../$env/bin/python" -m pytest -q -p no:cacheprovider)
if [ $# -gt 0 ] || [ "${KVTIER_PYTEST_PROCESSES:-2}" = 1 ]; then
  "${pytest[@]}" "$@" .
  exit
fi
# Two pytest processes over disjoint sets of files: most of the suite's time is waiting (deadlines, peer processes,
# injected pauses), so two processes share two cores well. The prefill/decode fault suite (peer processes killed and
# paused past their leases: about half of the suite's time, nearly all of it waiting) in one, the rest in the other;
# each prints its own report, and the run fails if either does.
faults=(test_pd_faults*.py)
if [ ! -f "${faults[0]}" ]; then
  "${pytest[@]}" .
  exit
fi
rest=(.)
for f in "${faults[@]}"; do rest+=(--ignore="$f"); done
log=$(mktemp -d)
"${pytest[@]}" "${faults[@]}" >"$log/faults.txt" 2>&1 &
faults_pid=$!
rc_rest=0 rc_faults=0
"${pytest[@]}" "${rest[@]}" >"$log/rest.txt" 2>&1 || rc_rest=$?
wait "$faults_pid" || rc_faults=$?
echo "=== pytest: every file but ${faults[*]}"
cat "$log/rest.txt"
echo "=== pytest: ${faults[*]}"
cat "$log/faults.txt"
rm -rf "$log"
[ $rc_rest = 0 ] && [ $rc_faults = 0 ]
