#!/usr/bin/env bash
# The accelerator benchmarks of docs/benchmarks.md in parts that each fit a 10-minute call.
# Usage: benchmarks/gpu_suite.sh PART OUT_DIR   (PART: mfu | step_cost | ablation | snapshot | failure)
# Each part writes at most 8 files (one JSON and one log per run) into OUT_DIR, bf16 compute
# (model.compute_dtype=auto, the default, on an accelerator; float32 in a CPU smoke test).
# MODELS overrides the part's model list (e.g. MODELS=tiny for a CPU smoke test).
set -uo pipefail
part=${1:?part: mfu | step_cost | ablation | snapshot | failure}
out=${2:?output directory}
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

# run NAME SECONDS -m benchmarks.MODULE ARGS...: one benchmark (python -m, from the repository
# root), its JSON in $out/NAME.json, its output in $out/NAME.log.
run() {
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" "$py" "$@" --json "$out/$name.json" >"$out/$name.log" 2>&1
  echo "rc=$? $(tail -n 12 "$out/$name.log")"
}

case $part in
  mfu)
    for m in ${MODELS:-llama_350m llama_1b}; do
      run "mfu_$m" 280 -m benchmarks.mfu --config "configs/$m.yaml" --micro-batches 8,16,32 \
        --repeats 20
    done ;;
  step_cost)
    for m in ${MODELS:-llama_60m llama_130m llama_350m}; do
      run "step_cost_$m" 180 -m benchmarks.step_cost --config "configs/$m.yaml" --repeats 20
    done ;;
  ablation)
    for m in ${MODELS:-llama_60m llama_130m llama_350m}; do
      run "ablation_$m" 180 -m benchmarks.ablation --config "configs/$m.yaml" --repeats 20
    done ;;
  snapshot)
    # The in-memory tier wants tmpfs; containers often give /dev/shm only 64 MB (350m: ~4 GB).
    snap=/dev/shm/mecefo_bench
    if [ "$(df -k --output=avail /dev/shm 2>/dev/null | tail -n 1)" -lt 16000000 ] 2>/dev/null; then
      snap=/tmp/mecefo_bench; echo "/dev/shm has under 16 GB free: snapshots go to $snap (disk)"
    fi
    mkdir -p "$snap"
    for m in ${MODELS:-llama_60m llama_350m}; do
      run "snapshot_$m" 270 -m benchmarks.snapshot_overhead --config "configs/$m.yaml" \
        --dir "$snap"
    done ;;
  failure)
    for m in ${MODELS:-llama_60m}; do
      run "failure_$m" 540 -m benchmarks.failure_throughput --config "configs/$m.yaml" --slices 8 \
        --measure anchors --rate per_device --repeats 10
    done ;;
  *) echo "unknown part: $part" >&2; exit 2 ;;
esac
