"""The files a run writes, against those the code before the typed records wrote
(tests/fixtures/run_records, README there): the same keys in the same order and the same
values, times and paths apart, computed numbers to float32's last bits (a run's numbers differ
there between CPUs: the fixture was written on an Intel Xeon with AVX-512, this machine may be
another); a run written then resumes now and is plotted."""
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from mecefo_jax import files
from mecefo_jax.config import Config, to_dict
from mecefo_jax.records.run_dir import run_name
from mecefo_jax.run import cli, plot
from mecefo_jax.ops.schedule import abstract_schedule

FIXTURE = Path(__file__).parent / 'fixtures' / 'run_records'
GOLDEN = json.loads((FIXTURE / 'golden.json').read_text())
JSON_FILES = ('run_state.json', 'report.json')
LINE_FILES = ('history.jsonl', 'metrics.jsonl')
TEXT_FILES = ('failures.txt', 'failure_trace.txt')
# Values that differ between two runs of one program: times and rates (numbers), and what the
# program store held (any value: the suite's store, warm or cold).
TIMED_SECTIONS = {'goodput', 'throughput'}
TIMED_KEYS = {'t', 'time', 'tokens_per_s', 'steps_per_s'}
STORE_SECTIONS = {'startup', 'programs'}
# Losses, norms and their digest computed on another CPU: equal to a few float32 roundings (seen:
# 1 ulp of a grad norm, 2 of a loss after 14 steps on an AMD EPYC); a wrong value, a step
# trained twice or a resume from another state is off by far more.
REL_TOL = 1e-5
DIGESTS = {'params_sha256'}


def _placeholders(work: Path, run_id: str) -> list[tuple[str, str]]:
  shm = files.default_snapshot_dir(run_name(work / 'run'))
  return [(str(work), '@WORK@'), (str(shm), '@SHM@'), (str(Path.home()), '@HOME@'),
          (run_id, '@ID@')]


def _normal(value, pairs, timed=False, store=False, digest=False):
  """`value` with paths and the run id as placeholders, timestamps as @TIME@, each timed
  number and each value of the program store's sections as its type alone, a params digest as
  its kind."""
  if isinstance(value, dict):
    return {k: _normal(v, pairs, timed or k in TIMED_SECTIONS or k in TIMED_KEYS or
                       k.endswith('_s'), store or k in STORE_SECTIONS, k in DIGESTS)
            for k, v in value.items()}
  if isinstance(value, list):
    return [_normal(v, pairs, timed, store) for v in value]
  if store:
    return type(value).__name__
  if digest and isinstance(value, str) and re.fullmatch(r'[0-9a-f]{64}', value):
    return 'sha256'  # of params equal to float32's last bits only (REL_TOL)
  if isinstance(value, str):
    for path, mark in pairs:
      value = value.replace(path, mark)
    return re.sub(r'\d{8}T\d{6}Z', '@TIME@', value)
  if timed and isinstance(value, (int, float)) and not isinstance(value, bool):
    return 'number'
  return value


def _first_difference(golden, new, path='') -> str:
  """Where `new` first differs from `golden`, and how ('' where nowhere: floats to REL_TOL)."""
  if isinstance(golden, dict) and isinstance(new, dict):
    if list(golden) != list(new):
      return f'{path or "top"}: keys {list(golden)} != {list(new)}'
    return next(filter(None, (_first_difference(golden[k], new[k], f'{path}.{k}')
                              for k in golden)), '')
  if isinstance(golden, list) and isinstance(new, list) and len(golden) == len(new):
    return next(filter(None, (_first_difference(g, n, f'{path}[{i}]')
                              for i, (g, n) in enumerate(zip(golden, new)))), '')
  if type(golden) is float and type(new) is float and math.isclose(golden, new, rel_tol=REL_TOL):
    return ''
  return '' if golden == new else f'{path}: {golden!r:.200} != {new!r:.200}'


def _ordered_keys(value, prefix=''):
  """Every object's keys in order, by dotted path: report.json and run_state.json keep theirs."""
  if isinstance(value, dict):
    yield prefix, list(value)
    for k, v in value.items():
      yield from _ordered_keys(v, f'{prefix}.{k}')
  elif isinstance(value, list):
    for i, v in enumerate(value):
      yield from _ordered_keys(v, f'{prefix}[{i}]')


def _read(run: Path, pairs) -> dict:
  """The run's files as the comparison sees them."""
  out = {}
  for name in JSON_FILES:
    out[name] = _normal(json.loads((run / name).read_text()), pairs)
  for name in LINE_FILES:
    out[name] = [_normal(json.loads(line), pairs) for line in (run / name).read_text().splitlines()]
  for name in TEXT_FILES:
    out[name] = _normal((run / name).read_text(), pairs)
  return out


def _without_settings_added_since(new: dict, golden: dict) -> None:
  """Drops from `new`'s config the keys the fixture's config lacks where they hold their
  declared default: a setting added since the fixture was made, left at its default (a changed
  value, a key gone or moved still differs)."""
  defaults = to_dict(Config())
  for section, keys in (new.get('config') or {}).items():
    old = golden.get('config', {}).get(section, {})
    for key in [k for k in keys if k not in old and keys[k] == defaults[section].get(k, object())]:
      del keys[key]


def _without_losses_the_old_meta_left_out(new: dict, golden: dict) -> None:
  """Drops from `new`'s report the losses the old code's snapshot meta lacked: a snapshot's own
  last step, whose row was made after it then (a run resumed from it left that loss out of
  report.json's `losses`); each one dropped must be a train row's of metrics.jsonl."""
  old_steps = {step for step, _ in golden['report.json']['losses']}
  rows = {(r['step'], r['loss']) for r in new['metrics.jsonl'] if r['kind'] == 'train'}
  added = [pair for pair in new['report.json']['losses'] if pair[0] not in old_steps]
  assert all(tuple(pair) in rows for pair in added), (added, sorted(rows))
  new['report.json']['losses'] = [p for p in new['report.json']['losses'] if p not in added]


def _with_the_schedules_argument_bytes(golden: dict) -> None:
  """Adds to the fixture's step program argument bytes the learning rate's schedule, an
  argument of the step programs since (ops/schedule.py; a constant of them before)."""
  memory = golden['report.json'].get('step_memory') or {}
  if 'argument_bytes' in memory:
    memory['argument_bytes'] += sum(np.dtype(x.dtype).itemsize
                                    for x in abstract_schedule())


def _assert_same(stage: str, run: Path, run_id: str, work: Path) -> None:
  golden = _read(FIXTURE / stage, [(GOLDEN['run_id'], '@ID@')])
  new = _read(run, _placeholders(work, run_id))
  for name in JSON_FILES:
    _without_settings_added_since(new[name], golden[name])
  _without_losses_the_old_meta_left_out(new, golden)
  _with_the_schedules_argument_bytes(golden)
  for name in (*JSON_FILES, *LINE_FILES, *TEXT_FILES):
    difference = _first_difference(golden[name], new[name])
    assert not difference, f'{stage}/{name}: {difference}'
  for name in JSON_FILES:
    assert list(_ordered_keys(new[name])) == list(_ordered_keys(golden[name])), name


def _args(work: Path) -> list[str]:
  # faults.takeover=spread: the default when the fixtures were made (requeue since)
  return ['--out', str(work / 'run'), *GOLDEN['args'], 'faults.takeover=spread',
          f'faults.failures=trace:{work / "trace.txt"}']


@pytest.fixture
def work(tmp_path):
  """A run's folder as the fixture's was (run/ and its trace), its tmpfs snapshots removed
  after."""
  (tmp_path / 'trace.txt').write_text(GOLDEN['trace'])
  yield tmp_path
  shutil.rmtree(files.default_snapshot_dir(run_name(tmp_path / 'run')),
                ignore_errors=True)


def test_a_run_writes_the_files_the_code_before_the_records_wrote(work, monkeypatch):
  """Through a divergence (the test hook poisons one step), its rollback and a stop."""
  (work / 'poison').write_text(str(GOLDEN['poisoned_step']))
  monkeypatch.setenv('MECEFO_TEST_POISON', str(work / 'poison'))
  assert cli.main(_args(work)) == GOLDEN['exits']['diverged']
  monkeypatch.delenv('MECEFO_TEST_POISON')
  run_id = json.loads((work / 'run' / 'run_state.json').read_text())['run_id']
  _assert_same('diverged', work / 'run', run_id, work)
  code = cli.main([*_args(work), '--resume', '--stop-after', str(GOLDEN['stop_after'])])
  assert code == GOLDEN['exits']['stopped']
  _assert_same('stopped', work / 'run', run_id, work)


def test_a_run_written_before_the_records_resumes_and_is_plotted(work, tmp_path):
  """The fixture's stopped run (its durable tier) resumes to the end the old code reached."""
  shutil.copytree(FIXTURE / 'stopped', work / 'run')
  pairs = [(mark, path) for path, mark in _placeholders(work, GOLDEN['run_id'])[:3]]
  for path in (work / 'run').glob('*.*'):
    text = path.read_text()
    for mark, value in pairs:
      text = text.replace(mark, value)
    path.write_text(text)
  assert cli.main([*_args(work), '--resume']) == GOLDEN['exits']['finished']
  _assert_same('finished', work / 'run', GOLDEN['run_id'], work)
  plot.main([str(work / 'run'), '--out', str(tmp_path / 'drawn.png')])
  assert (tmp_path / 'drawn.png').stat().st_size > 0
