#!/usr/bin/env bash
# Installs the Debian packages kvtier builds and tests with. Idempotent.
set -euo pipefail
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
PKGS=(build-essential cmake ninja-build pkg-config
      libgtest-dev libgmock-dev libbenchmark-dev
      libfmt-dev libcli11-dev nlohmann-json3-dev
      liburing-dev libhiredis-dev libxxhash-dev libnuma-dev libsodium-dev
      libucx-dev ucx-utils
      libzmq3-dev
      clang-14 libclang-rt-14-dev clang-format-14 clang-tidy-14 lld-14
      redis-server redis-tools
      python3 python3-venv python3-dev)
missing=()
for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q || echo "apt-get update failed; trying with the cached package lists" >&2
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
echo "install-deps: all packages present"
