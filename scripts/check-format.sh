#!/usr/bin/env bash
# Checks that every C++ and CUDA source is formatted as .clang-format says (clang-format 14, the version CI
# installs); with --fix, formats them in place. Lists the files that differ and fails when there are any.
# Usage: scripts/check-format.sh [--fix]
#   CLANG_FORMAT   the binary (default clang-format-14)
set -euo pipefail
cd "$(dirname "$0")/.."
cf=${CLANG_FORMAT:-clang-format-14}
command -v "$cf" >/dev/null || { echo "check-format: no $cf (scripts/install-deps.sh installs it)" >&2; exit 2; }
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')
else
  mapfile -t files < <(find . -path ./build -prune -o -type f \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o \
    -name '*.cuh' \) -print | sed 's|^\./||' | sort)
fi
if [ "${1:-}" = --fix ]; then
  "$cf" -i "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  "$cf" --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  printf 'check-format: not formatted (scripts/check-format.sh --fix):\n' >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "check-format: ${#files[@]} files formatted"
