#!/usr/bin/env bash
# Same numerics across a change of the model's code: train.py at commit BASE trains one step
# (--stop-after 1, durable checkpoint), then BASE and this tree each resume that same state
# (this tree converts a per-block checkpoint; docs/benchmarks.md "The scanned model") and the
# largest |Δ loss| over every logged step is printed.
#   benchmarks/same_numerics.sh BASE_WORKTREE OUT_DIR [train.py flags...]
# e.g. git worktree add /tmp/base d33af66 && benchmarks/same_numerics.sh /tmp/base /tmp/num
set -euo pipefail
base=$(cd "$1" && pwd); out=$2; shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
flags=("$@" snapshot.durable_every=1 train.log_every=1 train.compile_cache= train.plot=false -q)
rm -rf "$out"; mkdir -p "$out"
(cd "$base" && python train.py --out "$out/base" "${flags[@]}" --stop-after 1 > "$out/base0.log" 2>&1) || [ $? = 143 ]
cp -r "$out/base" "$out/new"
(cd "$base" && python train.py --out "$out/base" --resume "${flags[@]}" > "$out/base.log" 2>&1)
(cd "$here" && python train.py --out "$out/new" --resume "${flags[@]}" > "$out/new.log" 2>&1)
python - "$out" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def rows(run):
  lines = (out / run / 'metrics.jsonl').read_text().splitlines()
  return {(r['kind'], r['step']): r for r in map(json.loads, lines)}
base, new = rows('base'), rows('new')
keys = sorted(k for k in base if k in new and k[1] >= 1)
key = lambda r: 'loss' if r['kind'] == 'train' else 'eval_loss' if 'eval_loss' in r else 'loss'
diffs = [abs(base[k][key(base[k])] - new[k][key(new[k])]) for k in keys]
train = [d for k, d in zip(keys, diffs) if k[0] == 'train']
print(json.dumps({'rows_compared': len(keys), 'train_steps': len(train),
                  'max_abs_dloss_train': max(train), 'max_abs_dloss_all': max(diffs),
                  'final_eval': {r: json.loads((out / r / 'report.json').read_text()).get('eval_loss')
                                 for r in ('base', 'new')}}))
EOF
