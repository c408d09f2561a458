#!/usr/bin/env bash
# Newton-Schulz throughput and an 8B-shaped dmuon optimizer step on one GPU.
#
#   bash examples/benchmarks/gpu.sh [out_dir] [extra gpu_ns.py flags...]
#
# Runs unattended in under 8 minutes (gpu_ns.py budgets itself to 360 s, a
# `timeout 400` backs that up; then gpu_groups.py, owner groups and TP on
# every local GPU, under 80 s; then gpu_route.py, the dedicated step under
# plain nnx.jit, under 120 s) and writes gpu_ns.json (one JSON object per
# line, appended as the run goes), gpu_ns.md, gpu_groups.json,
# gpu_groups.md, gpu_route.json and gpu_route.md to out_dir (default:
# examples/benchmarks/results/gpu). Without a GPU, gpu_ns.py falls back to
# its CPU smoke run (tiny shapes, gpu_ns_cpu_smoke.*, well under a minute).
# Set PYTHON to choose the interpreter (default: python).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out_dir="${1:-$here/results/gpu}"
shift || true
mkdir -p "$out_dir"

if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi -L || true
else
  echo 'nvidia-smi not found'
fi

export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# JAX preallocates 75% of GPU memory by default; the 8B step wants more.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"

rc=0
timeout 400 "${PYTHON:-python}" "$here/gpu_ns.py" --budget-s 360 \
  --out-dir "$out_dir" "$@" || rc=$?
if [ "$rc" -eq 124 ]; then
  echo "gpu_ns.py hit the 400 s timeout; partial rows are in $out_dir" >&2
fi
# Owner groups (k = 2) and TP on every local GPU (each case needs 2 or 4;
# fewer are recorded as skipped); without a GPU, on 8 CPU devices.
smoke=()
command -v nvidia-smi >/dev/null 2>&1 || smoke=(--cpu-smoke)
rc2=0
timeout 80 "${PYTHON:-python}" "$here/gpu_groups.py" ${smoke[@]+"${smoke[@]}"} \
  --out-dir "$out_dir" || rc2=$?
if [ "$rc2" -eq 124 ]; then
  echo "gpu_groups.py hit the 80 s timeout" >&2
fi
# The dedicated step under plain nnx.jit (the reduced-gather route): does
# XLA:GPU keep the reduce-scatter? Every local GPU; else 8 CPU devices.
rc3=0
timeout 120 "${PYTHON:-python}" "$here/gpu_route.py" ${smoke[@]+"${smoke[@]}"} \
  --out-dir "$out_dir" || rc3=$?
if [ "$rc3" -eq 124 ]; then
  echo "gpu_route.py hit the 120 s timeout" >&2
fi
[ "$rc" -ne 0 ] && exit "$rc"
[ "$rc2" -ne 0 ] && exit "$rc2"
exit "$rc3"
