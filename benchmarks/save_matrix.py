"""Durable saves under load: one supervised job per (processes, snapshot.durable_every), each
beside busy cores for a while, every stall and death it had counted (issue 60's save hang).

Run: python -m benchmarks.save_matrix [--processes 2,3] [--durable-every 1,2,3,4]
    [--minutes 15] [--busy 2] [--keep DIR] [--json OUT] [overrides...]
     python -m benchmarks.save_matrix --rescore JSON

Each cell, in turn: `python -m mecefo_jax.launch -n P --devices-per-process 1 --events E --
--config tiny --out RUN snapshot.dir=SHM mesh.slice=P train.steps=100000000 train.log_every=1
train.eval_every=0 train.plot=false snapshot.durable_every=D` (overrides appended: issue 60's
scenario is the tests' tiny model, model.d_model=32 model.n_heads=2 model.ffn_dim=48
model.seq_len=16 model.n_layers=1 train.micro_batch=4) in a fresh HOME (an empty program
store) and XLA's default flags, beside --busy `yes` processes, for --minutes; then a Ctrl-C to
the job's group, which stops it at an agreed step (exit 143). From its --events file and the
run: the stalls, deaths and other failures the supervisor saw, the steps trained, the durable
checkpoints left and the exit. A cell is clean with no failure and the stop's exit; one that
is not keeps its directory (named in the JSON), which --rescore can score again.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common
from mecefo_jax.records.job import STOPPED

# The supervisor's events that are no failure (`signal`: the Ctrl-C that ends each cell).
QUIET = ('place', 'start', 'signal', 'end')
COLUMNS = ['processes', 'durable_every', 'steps', 'stalls', 'deaths', 'exit_code', 'clean']


def _args(argv):
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument('--processes', default='2,3', help='job sizes, in turn')
  p.add_argument('--durable-every', default='1,2,3,4', help='snapshot.durable_every values')
  p.add_argument('--minutes', type=float, default=15.0, help='each cell trains this long')
  p.add_argument('--busy', type=int, default=2, help='cores kept busy (`yes` processes)')
  p.add_argument('--keep', default=None, help='keep every cell directory under DIR')
  p.add_argument('--rescore', default=None, metavar='JSON', help="score an earlier run's cells "
                 "again from their kept directories by this module's rules (rewrites JSON)")
  return p.parse_intermixed_args(argv)


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(',') if x]


def cell(args, root: Path, processes: int, every: int) -> dict:
  """One job of `processes` with snapshot.durable_every=`every`, trained --minutes, stopped."""
  run, events, home = root / 'run', root / 'events.jsonl', root / 'home'
  home.mkdir(parents=True)
  env = common.job_env(HOME=str(home), PYTHONUNBUFFERED='1')
  job = common.JobOutput()
  job.events_path = events
  job.start([sys.executable, '-m', 'mecefo_jax.launch', '-n', str(processes),
             '--devices-per-process', '1', '--events', str(events), '--', '--config',
             args.config, '--out', str(run), f'snapshot.dir={root / "shm"}',
             f'mesh.slice={processes}', 'train.steps=100000000', 'train.log_every=1',
             'train.eval_every=0', 'train.plot=false', f'snapshot.durable_every={every}',
             *args.overrides], env)
  load_before = os.getloadavg()
  try:
    job.wait_for(lambda: job.last_step() >= 0, 600, 'a first step')
    time.sleep(args.minutes * 60.0)
    steps_before_stop = job.last_step()
    os.killpg(job.proc.pid, signal.SIGINT)
    code = job.wait(300)
  finally:
    job.kill()
  (root / 'supervisor.log').write_text(job.tail(10 ** 9) + '\n')
  return {'processes': processes, 'durable_every': every, 'minutes': args.minutes,
          'steps': steps_before_stop + 1, 'exit_code': code, 'load_before': load_before,
          'load_after': os.getloadavg(), **score(root, code)}


def score(root: Path, code: int) -> dict:
  """What a cell's directory says: the supervisor's failures, the durable checkpoints left
  (`<out>/checkpoints/<run id>/<step>`), and whether the cell is clean."""
  events = [json.loads(x) for x in (root / 'events.jsonl').read_text().splitlines()]
  kinds = collections.Counter(e['kind'] for e in events if e['kind'] not in QUIET)
  written = sorted(int(p.name) for p in (root / 'run' / 'checkpoints').glob('*/*')
                   if p.name.isdigit())
  return {'failures': dict(kinds), 'stalls': kinds.get('stall', 0),
          'deaths': kinds.get('death', 0), 'durable_checkpoints_kept': written,
          'clean': not kinds and code == STOPPED}


def _totals(out: dict) -> dict:
  out.update(clean=all(c['clean'] for c in out['cells']),
             stalls=sum(c['stalls'] for c in out['cells']))
  return out


def rescore(path: str) -> dict:
  """The JSON at `path` with each kept cell scored again, and the commit that did it."""
  out = json.loads(Path(path).read_text())
  for c in out['cells']:
    if c['kept']:
      c.update(score(Path(c['kept']), c['exit_code']))
  out['rescored_by'] = common.git_commit()
  return _totals(out)


def main(argv=None) -> dict:
  args = _args(argv)
  if args.rescore:
    out = rescore(args.rescore)
    common.emit(out, common.markdown_table(out['cells'], COLUMNS), args.rescore)
    return out
  info = common.run_info(__spec__.name, argv)
  if args.keep:
    Path(args.keep).mkdir(parents=True, exist_ok=True)
  hogs = [subprocess.Popen(['yes'], stdout=subprocess.DEVNULL, start_new_session=True)
          for _ in range(args.busy)]
  cells = []
  try:
    for processes in _ints(args.processes):
      for every in _ints(args.durable_every):
        root = Path(tempfile.mkdtemp(prefix=f'mecefo-save-{processes}p{every}-',
                                     dir=args.keep))
        result = cell(args, root, processes, every)
        result['kept'] = None if result['clean'] and not args.keep else str(root)
        if result['kept'] is None:
          shutil.rmtree(root, ignore_errors=True)
        cells.append(result)
        print(json.dumps(result), file=sys.stderr, flush=True)
  finally:
    for hog in hogs:
      hog.kill()
  out = _totals({**info, 'busy': args.busy, 'minutes': args.minutes, 'config': args.config,
                 'overrides': args.overrides, 'cells': cells})
  common.emit(out, common.markdown_table(cells, COLUMNS), args.json)
  return out


if __name__ == '__main__':
  main()
