#!/usr/bin/env bash
# Newton-Schulz throughput and an 8B-shaped dmuon optimizer step on one GPU.
#
#   bash examples/benchmarks/gpu.sh [out_dir] [extra gpu_ns.py flags...]
#
# Runs unattended in under 8 minutes (gpu_ns.py budgets itself to ~440 s; a
# `timeout 480` backs that up) and writes gpu_ns.json (one JSON object per
# line, appended as the run goes) and gpu_ns.md to out_dir (default:
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
timeout 480 "${PYTHON:-python}" "$here/gpu_ns.py" --out-dir "$out_dir" "$@" \
  || rc=$?
if [ "$rc" -eq 124 ]; then
  echo "gpu_ns.py hit the 480 s timeout; partial rows are in $out_dir" >&2
fi
exit "$rc"
