#!/usr/bin/env bash
# Runs clang-tidy 14 with the checks of .clang-tidy over kvtier's own C++ sources: the libraries and backends,
# the test doubles and the simulator (testing/, sim/) and the Python bindings (python/src/); not the tests, not
# the CLI (tools/: a program of its own; its unity files cost CI a minute, `KVTIER_TIDY_TOOLS=1` adds them), not
# third-party code, not build outputs.
# Fails on any finding (.clang-tidy: WarningsAsErrors). Cheap by reuse: the translation units and flags
# come from the compile database of a build tree CI configures anyway (default build/asan: its unity
# files, a few large translation units that include the sources, so the standard library and fmt are
# parsed a few times, not once per source; findings are reported at the source's own file and line). The
# Python bindings, which no CI tree compiles outside the wheel, get a core unity file's flags plus the
# Python and nanobind include folders (nanobind from build/tidy-venv, made on first use; skipped with a
# note when neither it nor network access is there).
# Usage: scripts/check-tidy.sh [build-dir [regex]]   (default build/asan; configured, e.g. `cmake --preset asan`;
#   regex: only the translation units whose path matches, e.g. 'python/src|/transport/')
#   CLANG_TIDY  the binary (default clang-tidy-14);  KVTIER_TIDY_JOBS  parallel runs (default nproc)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
tidy=${CLANG_TIDY:-clang-tidy-14}
build=${1:-build/asan}
only=${2:-}
jobs=${KVTIER_TIDY_JOBS:-$(nproc)}
command -v "$tidy" >/dev/null || { echo "check-tidy: no $tidy (scripts/install-deps.sh installs it)" >&2; exit 2; }
[ -f "$build/compile_commands.json" ] ||
  { echo "check-tidy: no $build/compile_commands.json (configure it first: cmake --preset asan)" >&2; exit 2; }

# Python and nanobind headers for python/src (checked as one unity file, like the libraries).
py_includes=""
if [ -d python/src ]; then
  venv=build/tidy-venv
  # The wheel build's environment has nanobind already (scripts/build-wheel.sh).
  for w in build/wheel-env-*; do
    if [ ! -x "$venv/bin/python" ] && [ -x "$w/bin/python" ] && "$w/bin/python" -c "import nanobind" 2>/dev/null; then
      venv=$w
    fi
  done
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import nanobind" 2>/dev/null; then
    (python3 -m venv "$venv" && "$venv/bin/python" -m pip install -q "nanobind>=2.10") >/dev/null 2>&1 ||
      echo "check-tidy: nanobind not installable here; python/src is not checked" >&2
  fi
  if "$venv/bin/python" -c "import nanobind" 2>/dev/null; then
    py_includes="$("$venv/bin/python" -c 'import nanobind, sysconfig; i = nanobind.include_dir(); print(":".join([i, i + "/../ext/robin_map/include", sysconfig.get_paths()["include"]]))')"
  fi
fi

db=$(mktemp -d)
trap 'rm -rf "$db"' EXIT
# The compile database of what is checked: the libraries' and the CLI's entries of the build tree (their
# precompiled header dropped: clang-tidy reads the header it was made from), and one entry per python/src file.
python3 - "$root" "$build" "$db" "$py_includes" <<'PY'
import json, os, re, shlex, sys
root, build, out, py_includes = sys.argv[1:5]
entries = json.load(open(os.path.join(build, "compile_commands.json")))
folders = "core|metrics|device|copy|backends|transfer|storage|transport|cache|pd|testing|sim"
if os.environ.get("KVTIER_TIDY_TOOLS") == "1":
    folders += "|tools"
tree = os.path.realpath(build)
mine = re.compile(r"^%s/(%s)/CMakeFiles/[^/]+/Unity/unity_\d+_cxx\.cxx$|^%s/(%s)/.*\.cc$" %
                  (re.escape(tree), folders, re.escape(root), folders))
keep = []
for e in entries:
    args = e["arguments"] if "arguments" in e else shlex.split(e["command"])
    f = os.path.join(e["directory"], e["file"])
    if not mine.search(f):
        continue
    clean = []
    i = 0
    while i < len(args):
        if args[i] == "-Xclang" and i + 3 < len(args) and args[i + 1] == "-include-pch":
            i += 4
            continue
        clean.append(args[i])
        i += 1
    keep.append({"directory": e["directory"], "file": f, "arguments": clean})
if py_includes:
    base = next(e for e in keep if "/core/" in e["file"])
    flags = [a for a in base["arguments"][1:] if a.startswith(("-D", "-I", "-std="))]
    flags += ["-I" + p for p in py_includes.split(":")] + ["-I" + os.path.join(root, "python/src")]
    flags.append("-DKVTIER_PYTHON_WITH_CACHE=1")
    # One unity file, as the libraries': nanobind and the standard library parsed once, not once per file.
    unity = os.path.join(out, "python_src_unity.cc")
    with open(unity, "w") as u:
        for name in sorted(os.listdir(os.path.join(root, "python/src"))):
            if name.endswith(".cc"):
                u.write('#include "%s"\n' % os.path.join(root, "python/src", name))
    keep.append({"directory": root, "file": unity, "arguments": [base["arguments"][0], *flags, "-c", unity]})
json.dump(keep, open(os.path.join(out, "compile_commands.json"), "w"), indent=1)
print(f"check-tidy: {len(keep)} translation units", file=sys.stderr)
PY
mapfile -t files < <(python3 -c "import json,sys; [print(e['file']) for e in json.load(open(sys.argv[1]))]" "$db/compile_commands.json" |
  grep -E -- "${only:-.}")
# Findings in kvtier's own headers and sources only (a unity file's includes are the sources it stands for).
filter="^$root/(include|core|metrics|device|copy|backends|transfer|storage|transport|cache|pd|testing|sim|tools|python/src)/"
log=$db/tidy.log
printf '%s\n' "${files[@]}" | xargs -P "$jobs" -I{} "$tidy" -p "$db" --quiet --header-filter="$filter" {} >"$log" 2>&1 ||
  status=$?
# Each finding once (a header's is reported by every unity file that includes it), with its source lines.
python3 - "$log" <<'PY'
import re, sys
head = re.compile(r"^\S+:\d+:\d+: (warning|error): ")
seen, block = set(), []
def flush():
    if block and block[0] not in seen:
        seen.add(block[0])
        print("\n".join(block))
for line in open(sys.argv[1], errors="replace").read().splitlines():
    if head.match(line):
        flush()
        block = [line]
    elif block and not re.match(r"^\d+ (warnings?|errors?) (generated|treated)|^Suppressed|^Use -header-filter", line):
        block.append(line)
flush()
PY
if [ "${status:-0}" != 0 ]; then
  grep -q -E '(warning|error):' "$log" || cat "$log"
  echo "check-tidy: findings above (fix them, or NOLINT(<check>) with the reason where a finding is wrong)" >&2
  exit 1
fi
echo "check-tidy: ${#files[@]} translation units clean"
