#!/usr/bin/env bash
# Runs on a GPU machine from the repository root, with the gpu preset's binaries
# in .gpu-bin/ (built and packed on the build machine by scripts/pack-gpu.sh and
# copied along with the checkout; everything but glibc is linked statically, so
# the GPU machine needs only the NVIDIA driver, plus nvcc for the probes and
# python3 for the summary). Runs the test binaries, the benchmarks (kvtier bench copy, bench
# transfer) and the standalone probes of bench/gpu/ (built with nvcc when
# .gpu-probe/ lacks them); logs under $OUT (default /tmp/kvtier-out); a short
# table last. docs/performance.md says which of its tables this reproduces.
# `python`: installs the kvtier wheel built on the build machine for this machine's python3
# (scripts/build-wheel.sh --python python3.12 --cuda ON --out .gpu-wheel; no compiler step here) with
# pip into $KVTIER_PY_TARGET, runs the pytest suite on torch CUDA tensors and the real-model offload
# proof (python/tests/gpu/llama_offload.py; LLAMA_ARGS passes options to it) and the two-process prefill/decode
# proof (python/tests/gpu/llama_pd.py; LLAMA_PD_ARGS) from it (LLAMA_OFFLOAD=0 leaves the offload proof out).
# `pd`: kvtier bench pd over the direct lane (the device lane of pd.h between two processes on GPU 0: CUDA IPC,
# copy kernels, GPU checksums, bytes checked) beside the same block lists gathered in one process, and, where the
# nixl-cu13 wheel is in .whl/, bench/pd_nixl.py with the same block lists (NIXL's UCX backend, WRITE and READ).
# `ring` (also part of `pd`): kvtier bench pd over the ring lane (the decode's shared pinned ring) beside the
# PCIe ceiling of the same bytes.
# `host` (also part of `pd`): kvtier bench pd over the host lanes (UCX shm and tcp, ipc, and shm-direct, the host
# direct lane) beside the raw transport.
# Usage: scripts/gpu-check.sh [tests|bench|probes|python|pd|ring|host|all] [extra kvtier bench copy args...]
#   GPU_TESTS_ONLY=1: only the test binaries that run on the GPU (the CPU ones run in CI): the gpu-labelled ones,
#   the device conformance suite and the prefill/decode device-lane and ipc tests, whose CUDA cases skip without one.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/kvtier-out}; mkdir -p "$OUT"
BIN=.gpu-bin
PROBES=.gpu-probe
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.sm --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
summary=()
if [ "$what" = tests ] || [ "$what" = all ]; then
  tests=("$BIN"/*_test)
  if [ "${GPU_TESTS_ONLY:-0}" = 1 ]; then
    tests=("$BIN"/device_conformance_test "$BIN"/cuda_device_test "$BIN"/copy_gpu_test "$BIN"/transfer_gpu_test
      "$BIN"/ipc_gpu_test "$BIN"/pd_staged_gpu_test "$BIN"/pd_device_lane_test "$BIN"/pd_ipc_two_process_test)
  fi
  for t in "${tests[@]}"; do
    name=$(basename "$t")
    start=$(date +%s)
    timeout 300 "$t" --gtest_brief=1 > "$OUT/$name.log" 2>&1
    rc=$?
    dur=$(( $(date +%s) - start ))
    pass=$(grep -c '^\[       OK \]' "$OUT/$name.log" || true)
    fail=$(grep -E '^\[  FAILED  \] [A-Za-z]' "$OUT/$name.log" | grep -vc 'listed below' || true)
    skip=$(grep -c '^\[  SKIPPED \]' "$OUT/$name.log" || true)
    total=$(grep -oE '^\[==========\] [0-9]+ tests' "$OUT/$name.log" | grep -oE '[0-9]+' | head -1)
    summary+=("$(printf '%-28s rc=%-3s tests=%-4s fail=%-3s skip=%-3s %4ss' "$name" "$rc" "${total:-?}" "$fail" "$skip" "$dur")")
    if [ "$rc" != 0 ]; then grep -E 'FAILED|Failure|error' "$OUT/$name.log" | head -20; fi
  done
  cat "$OUT"/*_test.log > "$OUT/tests_all.log" 2>/dev/null
  rm -f "$OUT"/*_test.log
fi
if [ "$what" = python ] || [ "$what" = all ]; then
  target=${KVTIER_PY_TARGET:-/tmp/kvtier-site}
  pytag=cp$(python3 -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
  wheel=$(ls .gpu-wheel/kvtier-*-"$pytag"-*.whl 2>/dev/null | head -n 1)
  if [ -z "$wheel" ]; then
    echo "no .gpu-wheel/kvtier-*-$pytag-*.whl: build it with scripts/build-wheel.sh --python python${pytag#cp3} ..." >&2
  fi
  start=$(date +%s)
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$target" "$wheel" > "$OUT/pip.log" 2>&1
  echo "pip install $(basename "$wheel") rc=$? ($(( $(date +%s) - start ))s)"; tail -5 "$OUT/pip.log"
  export PYTHONPATH="$target:${PYTHONPATH:-}"
  # From the test folder, so that the installed package, not python/kvtier of the checkout, is imported.
  (cd python/tests && timeout 300 python3 -m pytest -q -p no:cacheprovider . --ignore=gpu) > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?"; tail -5 "$OUT/pytest.log"
  summary+=("$(printf '%-28s %s' pytest "$(tail -1 "$OUT/pytest.log")")")
  if [ "${LLAMA_OFFLOAD:-1}" = 1 ]; then  # LLAMA_OFFLOAD=0: only the prefill/decode proof below
    # shellcheck disable=SC2086
    timeout 420 python3 python/tests/gpu/llama_offload.py --out "$OUT/llama_offload.json" ${LLAMA_ARGS:-} \
      > "$OUT/llama_offload.log" 2>&1
    echo "llama_offload rc=$?"; tail -30 "$OUT/llama_offload.log"
  fi
  # Prefill in one process, decode in another, layer-wise push over the device lane (LLAMA_PD_ARGS: options).
  # shellcheck disable=SC2086
  timeout 420 python3 python/tests/gpu/llama_pd.py --out "$OUT/llama_pd.json" ${LLAMA_PD_ARGS:-} \
    > "$OUT/llama_pd.log" 2>&1
  echo "llama_pd rc=$?"; tail -30 "$OUT/llama_pd.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 420 "$BIN/kvtier" bench copy --backend cuda --json "$@" > "$OUT/bench_copy.jsonl" 2> "$OUT/bench_copy.err"
  echo "bench copy rc=$?"; tail -5 "$OUT/bench_copy.err"
  timeout 240 "$BIN/kvtier" bench transfer --backend cuda --json > "$OUT/bench_transfer.jsonl" 2> "$OUT/bench_transfer.err"
  echo "bench transfer rc=$?"; tail -5 "$OUT/bench_transfer.err"
fi
if [ "$what" = pd ] || [ "$what" = all ]; then
  pd_args=(--layers 8 --layer-bytes $((64 << 20)) --pool-bytes $((2 << 30)) --block-sizes 16384,1048576 --iters 32)
  # The mover verifying inside its copy kernel (the default), with a separate read-back pass, and the receiver
  # verifying (PdOptions::lane_verify, lane_read_back_in_copy); one transfer at a time and eight in flight.
  timeout 400 "$BIN/kvtier" bench pd --lanes direct --memory device --modes push,pull "${pd_args[@]}" \
    --lane-verify mover,mover-pass,receiver --inflight 1,8 --json > "$OUT/bench_pd.jsonl" 2> "$OUT/bench_pd.err"
  echo "bench pd rc=$?"; tail -5 "$OUT/bench_pd.err"; cat "$OUT/bench_pd.jsonl"
  # 2 GiB per transfer (256 MiB per layer, an 8 GiB pool per side), the default verification, four in flight.
  timeout 300 "$BIN/kvtier" bench pd --lanes direct --memory device --modes push,pull --layers 8 \
    --layer-bytes $((256 << 20)) --pool-bytes $((8 << 30)) --block-sizes 16384,1048576 --iters 8 --inflight 4 \
    --json > "$OUT/bench_pd_2g.jsonl" 2> "$OUT/bench_pd_2g.err"
  echo "bench pd 2g rc=$?"; tail -5 "$OUT/bench_pd_2g.err"; cat "$OUT/bench_pd_2g.jsonl"
  if ls .whl/nixl*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/nixl-site \
      .whl/*.whl > "$OUT/nixl_pip.log" 2>&1
    PYTHONPATH=/tmp/nixl-site:${PYTHONPATH:-} timeout 300 python3 bench/pd_nixl.py --memory device \
      --layers 8 --layer-bytes $((64 << 20)) --pool-bytes $((2 << 30)) --block-bytes 16384,1048576 --iters 8 \
      --json "$OUT/bench_pd_nixl.jsonl" > "$OUT/bench_pd_nixl.log" 2>&1
    echo "pd_nixl rc=$?"; tail -20 "$OUT/bench_pd_nixl.log"
  fi
fi
if [ "$what" = host ] || [ "$what" = pd ] || [ "$what" = all ]; then
  # The host lanes on this machine's cores: UCX shm and tcp and kvtier's ipc backend, each row beside the raw
  # transport (the same descriptors, no protocol) and, where ucx_perftest is installed, beside it; pinned host
  # blocks, then CUDA blocks through the staged path. Blocks from Transport::allocate_host, then (shm) the
  # caller's own memory.
  if [ -x .gpu-pack/bin/ucx_perftest ]; then  # packed by scripts/pack-gpu.sh where the build machine has it
    export PATH="$PWD/.gpu-pack/bin:$PATH" LD_LIBRARY_PATH="$PWD/.gpu-pack/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export UCX_MODULE_DIR="$PWD/.gpu-pack/lib/ucx"
  fi
  perftest=(--no-perftest); command -v ucx_perftest > /dev/null && perftest=()
  timeout 300 "$BIN/kvtier" bench pd --lanes shm,tcp,ipc --memory raw,host,device --backend cuda \
    --block-sizes 16384,1048576 --layers 8 --iters 24 --inflight 1,4 "${perftest[@]}" --json > "$OUT/bench_pd_host.jsonl" 2> "$OUT/bench_pd_host.err"
  echo "bench pd host rc=$?"; tail -5 "$OUT/bench_pd_host.err"
  timeout 120 "$BIN/kvtier" bench pd --lanes shm --memory raw,host --host-alloc caller --block-sizes 16384,1048576 --layers 8 \
    --iters 24 --inflight 1,4 "${perftest[@]}" --json >> "$OUT/bench_pd_host.jsonl" 2>> "$OUT/bench_pd_host.err"
  # The host direct lane (PdOptions::host_direct: the moving side copies through UCX's mapping of the peer's pool).
  timeout 200 "$BIN/kvtier" bench pd --lanes shm-direct --memory raw,host --block-sizes 16384,1048576 --layers 8 \
    --iters 24 --inflight 1,4 "${perftest[@]}" --json >> "$OUT/bench_pd_host.jsonl" 2>> "$OUT/bench_pd_host.err"
  echo "bench pd host direct rc=$?"
  echo "bench pd host (caller memory) rc=$?"; cat "$OUT/bench_pd_host.jsonl"
fi
if [ "$what" = ring ] || [ "$what" = pd ] || [ "$what" = all ]; then
  # The ring lane (forced: the two processes could map each other's pools), a layer of 64 MiB per slot, eight
  # slots; the SM kernel's in-copy checksums and the engine's own copy plus a device-side checksum pass; beside
  # the PCIe ceiling of the same bytes (contiguous D2H and H2D) measured in the decode process.
  timeout 300 "$BIN/kvtier" bench pd --lanes ring --memory device --modes push,pull --layers 8 \
    --layer-bytes $((64 << 20)) --pool-bytes $((2 << 30)) --block-sizes 16384,1048576 --iters 8 --ring-slots 8 \
    --ring-copy auto,sm_kernel --inflight 1,4 --json > "$OUT/bench_pd_ring.jsonl" 2> "$OUT/bench_pd_ring.err"
  echo "bench pd ring rc=$?"; tail -5 "$OUT/bench_pd_ring.err"; cat "$OUT/bench_pd_ring.jsonl"
fi
if [ "$what" = probes ] || [ "$what" = all ]; then
  mkdir -p "$PROBES"
  for p in h2d_probe copy_probe host_pages_probe readback_probe; do
    if [ ! -x "$PROBES/$p" ]; then
      nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -cudart static -Xcompiler -static-libstdc++ -I. \
        -o "$PROBES/$p" "bench/gpu/$p.cu" > "$OUT/build_$p.log" 2>&1
      echo "build $p rc=$?"
    fi
  done
  # Short sections, 4 and 32 KiB: the kernel load variants; the SM kernel shapes (copy_probe's batch
  # section takes minutes at 4 KiB: idle-stream batches and gate watchdogs).
  PROBE_ONLY=a PROBE_SIZES=4096,32768 timeout 200 "$PROBES/h2d_probe" 256 3 > "$OUT/h2d_probe.txt" 2>&1
  echo "h2d_probe rc=$?"
  PROBE_ONLY=sm PROBE_SIZES=4096,32768 timeout 200 "$PROBES/copy_probe" 256 3 > "$OUT/copy_probe.txt" 2>&1
  echo "copy_probe rc=$?"
  PROBE_KINDS=hostalloc,thp PROBE_SIZES=32768 timeout 200 "$PROBES/host_pages_probe" 256 3 > "$OUT/host_pages_probe.txt" 2>&1
  echo "host_pages_probe rc=$?"
  # The device lane's read-back: a separate pass against inside the copy kernel, 32 and 132 CTAs.
  PROBE_CTAS=32,132 timeout 200 "$PROBES/readback_probe" 64 8 5 > "$OUT/readback_probe.txt" 2>&1
  echo "readback_probe rc=$?"; cat "$OUT/readback_probe.txt"
  grep -h -E "ceiling|VERIFY" "$OUT/h2d_probe.txt" "$OUT/copy_probe.txt" "$OUT/host_pages_probe.txt"
fi
echo "================ summary ================"
printf '%s\n' "${summary[@]}"
python3 scripts/gpu_table.py copy="$OUT/bench_copy.jsonl" transfer="$OUT/bench_transfer.jsonl" \
  pd="$OUT/bench_pd.jsonl" pd_2g="$OUT/bench_pd_2g.jsonl" ring="$OUT/bench_pd_ring.jsonl" host="$OUT/bench_pd_host.jsonl"
for f in "$OUT/h2d_probe.txt" "$OUT/copy_probe.txt"; do [ -s "$f" ] && grep -E "^(A |sm_|batch_)" "$f"; done
exit 0
