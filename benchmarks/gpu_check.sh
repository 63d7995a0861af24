#!/usr/bin/env bash
# The GPU check: what a first run on a GPU machine shows, in at most GPU_CHECK_TOTAL_S seconds
# (default 420: 7 minutes), every part under its own `timeout`, printing as it goes.
# Usage: benchmarks/gpu_check.sh    (from anywhere; PYTHON picks the interpreter, default python3)
# Results: $OUT/gpu_check.json (every figure, the versions, the device kind, each part's status:
# ok | timeout | oom | failed | skipped) and $OUT/gpu_check.log; nothing else in $OUT (default:
# gpu_check_out/ in the repository, git-ignored).
# It installs nothing but the wheels of the repository's git-ignored wheels/ folder (cp312, for
# a machine without network), only when the imports fail, with pip --no-index --no-deps into a
# fresh target directory put first on PYTHONPATH; never jax, jaxlib, a CUDA plugin or nvidia-*:
# the image's accelerator stack is what it measures.
# Parts and their limits (seconds; GPU_CHECK_LIMIT_<PART> overrides; 0 skips a part): imports 30,
# quickstart 45, notebook 60 (colab/mecefo_quickstart.ipynb executed on the machine, short
# settings: on one device its llama_60m step cost and training run; needs nbclient and ipykernel),
# first_step_cold and first_step_warm 60 each (llama_350m, train.py stopped after its first step:
# a fresh HOME and an empty program store, then the same again), step_cost 55 (llama_350m),
# compile_degraded_empty/warm/off 40 each (llama_350m's degraded step compiled with XLA's autotune
# cache empty, warm, autotuning off),
# mfu_mb4 and mfu_mb8 50 each (llama_1b, model.vocab_size=32000 model.seq_len=2048), snapshot 50
# (every-step snapshot overhead, llama_350m). A part that would run past the total is cut short.
# A CPU smoke test swaps the models (tests/test_gpu_check.py): GPU_CHECK_MODEL (the 350M parts),
# GPU_CHECK_MODEL_1B, GPU_CHECK_MFU_OVERRIDES, GPU_CHECK_OVERRIDES (every part but the
# quickstart), GPU_CHECK_QUICKSTART_ARGS, GPU_CHECK_REPEATS.
set -uo pipefail
out=${OUT:-$(dirname "$0")/../gpu_check_out}  # a relative $OUT: from where it was started
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
json=$out/gpu_check.json log=$out/gpu_check.log
: >"$log"
work=$(mktemp -d "${TMPDIR:-/tmp}/mecefo-gpu-check.XXXXXX")  # part outputs; removed at the end
# ... with the tmpfs snapshots of the runs in it (a run killed at its limit keeps its own).
remove_work() {
  "$py" -c 'import shutil, sys
from mecefo_jax.records.run_dir import run_name
from mecefo_jax.snapshot.manager import default_snapshot_dir
for run in sys.argv[1:]:
  shutil.rmtree(default_snapshot_dir(run_name(run)), ignore_errors=True)' "$work"/*
  rm -rf "$work"
}
trap remove_work EXIT
export PYTHONUNBUFFERED=1
t0=$SECONDS total=${GPU_CHECK_TOTAL_S:-420}
m350=${GPU_CHECK_MODEL:-configs/llama_350m.yaml} m1b=${GPU_CHECK_MODEL_1B:-configs/llama_1b.yaml}
mfu_overrides=${GPU_CHECK_MFU_OVERRIDES-model.vocab_size=32000 model.seq_len=2048}
overrides=${GPU_CHECK_OVERRIDES-} repeats=${GPU_CHECK_REPEATS:-5}
declare -A limit=([imports]=${GPU_CHECK_LIMIT_IMPORTS:-30} [quickstart]=${GPU_CHECK_LIMIT_QUICKSTART:-45}
  [notebook]=${GPU_CHECK_LIMIT_NOTEBOOK:-60}
  [first_step]=${GPU_CHECK_LIMIT_FIRST_STEP:-60} [step_cost]=${GPU_CHECK_LIMIT_STEP_COST:-55}
  [compile]=${GPU_CHECK_LIMIT_COMPILE:-40} [mfu]=${GPU_CHECK_LIMIT_MFU:-50}
  [snapshot]=${GPU_CHECK_LIMIT_SNAPSHOT:-50})

say() { echo "$*" | tee -a "$log"; }
book() { "$py" -m benchmarks.gpu_check "$@" 2>&1 | tee -a "$log"; }

# part NAME KIND LIMIT CMD...: CMD under `timeout` (LIMIT cut to what the total leaves), its
# output shown and logged, then its record in the JSON ($pjson: its result JSON, $prun: its run
# directory, $expect: the exit code that means done).
pjson='' prun='' expect=0
part() {
  local name=$1 kind=$2 secs=$3; shift 3
  local left=$((total - (SECONDS - t0) - 10)) start=$SECONDS rc  # 10 s kept for the bookkeeping
  ((secs > left)) && secs=$((left > 0 ? left : 0))
  local args=(part "$json" "$name" "$kind" --cmd "$*" --limit "$secs" --expect "$expect")
  [ -n "$pjson" ] && args+=(--json "$pjson")
  [ -n "$prun" ] && args+=(--run-dir "$prun")
  if ((left < 5 || secs <= 0)); then
    book "${args[@]}"  # skipped: no --rc
  else
    say "== $name (limit ${secs}s): $*"
    timeout -k 5 "$secs" "$@" 2>&1 | tee -a "$log" "$work/$name.log"
    rc=${PIPESTATUS[0]}
    book "${args[@]}" --rc "$rc" --seconds $((SECONDS - start)) --log "$work/$name.log"
  fi
  pjson='' prun='' expect=0
}

limits_json=$(for k in "${!limit[@]}"; do printf '"%s": %s,' "$k" "${limit[$k]}"; done)
book start "$json" --limits "{${limits_json%,}}"
part imports imports "${limit[imports]}" "$py" -m benchmarks.gpu_check imports "$json"
wheels_json=null
if ! grep -q '"import_errors": {$' "$json"; then :  # imported (or not checked: no time)
elif compgen -G 'wheels/*.whl' >/dev/null; then
  target=$work/site  # fresh every run: a reused machine's last one is never picked up
  mapfile -t whl < <("$py" -m benchmarks.gpu_check wheels wheels)
  say "== wheels: ${#whl[@]} from wheels/ into $target (imports failed)"
  if ((${#whl[@]})) && "$py" -m pip install -q --no-index --no-deps --target "$target" "${whl[@]}" \
      2>&1 | tee -a "$log"; then
    export PYTHONPATH=$target${PYTHONPATH:+:$PYTHONPATH}
    wheels_json=$(printf '%s\n' "${whl[@]##*/}" | "$py" -c 'import json,sys; print(json.dumps(
      {"target": sys.argv[1], "installed": sys.stdin.read().split()}))' "$target")
    part imports_with_wheels imports "${limit[imports]}" "$py" -m benchmarks.gpu_check imports "$json"
  fi
else
  say '== imports failed and wheels/ holds no wheel: the parts below will fail'
fi

prun=$work/quickstart
# shellcheck disable=SC2086  # the override lists are word lists
part quickstart train "${limit[quickstart]}" "$py" train.py --out "$prun" ${GPU_CHECK_QUICKSTART_ARGS:-}

# The Colab notebook as a user runs it on this machine (one device: llama_60m on it).
pjson=$work/notebook.json
part notebook notebook "${limit[notebook]}" "$py" -m benchmarks.notebook_run --json "$pjson"

# The first step of a new user's 350M run: a fresh HOME (no program store, no CUDA caches), then
# the same command again (its programs from the store). train.py stops after step 1 (exit 143).
home=$work/home userbase=$("$py" -c 'import site; print(site.getuserbase())')
mkdir -p "$home"
for run in cold warm; do
  prun=$work/$run expect=143
  part "first_step_$run" train "${limit[first_step]}" env -u JAX_COMPILATION_CACHE_DIR \
    HOME="$home" PYTHONUSERBASE="$userbase" "$py" train.py --config "$m350" --out "$prun" \
    --no-snapshots --stop-after 1 train.plot=false $overrides
done

pjson=$work/step_cost.json
part step_cost step_cost "${limit[step_cost]}" "$py" -m benchmarks.step_cost --config "$m350" \
  --repeats "$repeats" --json "$pjson" $overrides
# The degraded step's compile (llama_350m) with XLA's autotune cache empty, then warm (what the
# program store keeps on GPU), then with autotuning off: one process each.
for mode in empty warm off; do
  pjson=$work/compile_$mode.json
  part "compile_degraded_$mode" compile "${limit[compile]}" "$py" -m benchmarks.compile_autotune \
    --config "$m350" --cache "$work/autotune" --mode "$mode" --json "$pjson" $overrides
done
for mb in 4 8; do
  pjson=$work/mfu_$mb.json
  part "mfu_mb$mb" mfu "${limit[mfu]}" "$py" -m benchmarks.mfu --config "$m1b" --micro-batches "$mb" \
    --repeats "$repeats" --json "$pjson" $overrides $mfu_overrides
done

# The in-memory tier wants tmpfs; containers often give /dev/shm only 64 MB (350m: ~4 GB).
snap=/dev/shm
if [ "$(df -k --output=avail /dev/shm 2>/dev/null | tail -n 1)" -lt 16000000 ] 2>/dev/null; then
  snap=$work; say "/dev/shm has under 16 GB free: snapshots go to $snap (disk)"
fi
pjson=$work/snapshot.json
part snapshot snapshot "${limit[snapshot]}" "$py" -m benchmarks.snapshot_overhead --config "$m350" \
  --rounds 1 --restores 1 --auto-steps 0 --dir "$snap" --json "$pjson" $overrides

book finish "$json" --total $((SECONDS - t0)) --wheels "$wheels_json"
say "wrote $json and $log in $((SECONDS - t0))s"
