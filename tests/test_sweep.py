"""The corruption sweep: every file the project reads back, damaged seven ways, through the real
start paths (train.py --out D, --resume, --fresh, the plot, the prepare rerun), in-process, on
one run directory made once; each outcome is the file's contract in docs/errors.md."""
import json
import logging
import re
import shutil
import time
from pathlib import Path

import pytest

from mecefo_jax.data import prepare as prep
from mecefo_jax.data import tokendir
from mecefo_jax.data.tokenizer import token_chunks
from mecefo_jax.run import cli, plot, rundir
from mecefo_jax.records import history
from mecefo_jax.records.history import HISTORY, Kind
from mecefo_jax.records.job import BAD_INPUT, STOP_FILE, STOPPED
from mecefo_jax.records.run_dir import MANIFEST_NAME
from mecefo_jax.records.run_state import RUN_STATE, read_run_state
from procs import TINY, error_lines, report, tree

KINDS = ('empty', 'cut at 1 byte', 'cut at the middle', 'cut at the last byte',
         'a torn line appended', 'valid JSON of the wrong type', 'a required key missing')
TEXT_KINDS = KINDS[:5]  # files that are no JSON: .reached, stop_request, failures.txt
# A stopped run (3 of 4 steps) on a prepared token directory without eval rows (no eval
# program to build): in-memory snapshots 2 and 3, durable checkpoint 2 (3 removed: the
# in-memory 3 is the newest snapshot, and an older one is there when it is skipped).
RUN = [*TINY, 'mesh.slice=2', 'train.steps=4', 'train.log_every=1',
       'snapshot.every=1', 'snapshot.keep=2', 'snapshot.durable_every=2']
# The key each JSON file's 'a required key missing' drops ('' for a list: its first item).
KEYS = {RUN_STATE: 'run_id', 'report.json': 'failure_events', tokendir.META: 'vocab_size',
        tokendir.PROGRESS: 'tokens', MANIFEST_NAME: 'files', 'meta': 'controller', 'layout': ''}
LINES = {HISTORY: b'{"t": 1.0}\n', rundir.METRICS_FILE: b'{"kind": "train"}\n'}


def damage(path: Path, kind: str) -> None:
  """`path` damaged as `kind` says (a JSON Lines file gets its wrong line appended)."""
  data, jsonl = path.read_bytes(), path.name in LINES
  if kind == 'valid JSON of the wrong type':
    new = data + b'[1, 2]\n' if jsonl else b'{"a": 1}' if path.parent.name == 'layout' else b'[1]'
  elif kind == 'a required key missing' and jsonl:
    new = data + LINES[path.name]
  elif kind == 'a required key missing':
    record, key = json.loads(data), KEYS[path.name if path.name != 'metadata' else
                                         path.parent.name]
    new = json.dumps(record[1:] if key == '' else
                     {k: v for k, v in record.items() if k != key}).encode()
  else:
    new = {'empty': b'', 'cut at 1 byte': data[:1], 'cut at the middle': data[:len(data) // 2],
           'cut at the last byte': data[:-1],
           'a torn line appended': data + b'{"t": 1.0, "kind": "sta'}[kind]
  path.write_bytes(new)


def torn_lines(data: bytes, key: str | None) -> int:
  """How many lines of a damaged JSON Lines file are no object with `key` (the warning's);
  `key` None: how many are no JSON (those a start cuts)."""
  def bad(line):
    try:
      row = json.loads(line)
    except ValueError:
      return True
    return key is not None and (not isinstance(row, dict) or key not in row)
  return sum(bad(line) for line in data.decode('utf-8', 'replace').splitlines() if line.strip())


@pytest.fixture(scope='module')
def made(tmp_path_factory):
  """The run directory, its snapshots, a prepared and an interrupted token directory, made once
  (pristine copies beside them); `reset()` puts the pristine ones back."""
  base = tmp_path_factory.mktemp('sweep')
  corpus = base / 'corpus'  # three documents: an interrupted prepare has committed one
  corpus.mkdir()
  for name in 'abc':
    (corpus / f'{name}.txt').write_text(f'{name}: a few words of text to tokenize. ' * 150)
  pristine = base / 'pristine'
  prep.prepare([str(corpus)], pristine / 'tok')
  def one_chunk(*args, **kwargs):  # then a Ctrl-C: an interrupted prepare
    for n, chunk in enumerate(token_chunks(*args, **kwargs)):
      if n == 1:
        raise KeyboardInterrupt
      yield chunk
  with pytest.MonkeyPatch.context() as m:
    m.setattr(prep, 'token_chunks', one_chunk)
    with pytest.raises(KeyboardInterrupt):
      prep.prepare([str(corpus)], pristine / 'unf', chunk_bytes=4096)
  data = f'tokens:{pristine / "tok"}?eval_fraction=0'
  args = ['--out', str(base / 'run'), *RUN, '--data', data, f'snapshot.dir={base / "shm"}',
          f'train.compile_cache={base / "cc"}', '-q']
  assert cli.main([*args, '--stop-after', '3']) == STOPPED
  run_id = read_run_state(base / 'run').run_id
  shutil.rmtree(base / 'run' / 'checkpoints' / run_id / '3')
  (base / 'run' / STOP_FILE).write_text('a stop request of the supervisor')
  for name in ('run', 'shm'):
    shutil.copytree(base / name, pristine / name)

  class Made:
    def __init__(self):
      self.base, self.run, self.shm, self.corpus, self.args = (base, base / 'run', base / 'shm',
                                                               corpus, args)
      self.snapshot = base / 'shm' / run_id / '3'

    def reset(self, stop_request: bool = False) -> None:
      for name in ('run', 'shm', 'tok', 'unf'):
        shutil.rmtree(base / name, ignore_errors=True)
        shutil.copytree(pristine / name, base / name)
      if not stop_request:
        (self.run / STOP_FILE).unlink()
  return Made()


@pytest.mark.slow
@pytest.mark.parametrize('kind', KINDS)
def test_every_file_read_back_damaged_through_the_real_start_paths(made, kind, caplog, capsys):
  t0 = time.perf_counter()
  caplog.set_level(logging.WARNING, 'mecefo')
  for i, target in enumerate(('manifest', 'layout', 'meta')):
    flags = [[], ['--resume']][(i + KINDS.index(kind)) % 2]  # each file through both, by turns
    _resume(made, kind, target, flags, caplog, capsys)
    _run_state(made, kind, flags, capsys)
  _run_state(made, kind, ['--fresh'], capsys, caplog)
  _plot(made, kind, caplog, capsys)
  _token_dirs(made, kind, capsys)
  print(f'{kind}: {time.perf_counter() - t0:.1f} s')


def _start(made, flags) -> int:
  return cli.main(['--out', str(made.run), *flags, '-q'])


def _resume(made, kind, target, flags, caplog, capsys) -> None:
  """A resume with its newest snapshot's `target` file (manifest, layout or meta) damaged, and
  history.jsonl, metrics.jsonl, .reached, failures.txt and stop_request too (each read by
  another part of the start): the snapshot is skipped (set aside, with a line) and the older
  one restores; each torn line is skipped with one warning per file; the stop request,
  whatever it holds, is honoured; appends go on lines of their own; no traceback."""
  text = kind in TEXT_KINDS
  made.reset(stop_request=text)
  damage(made.snapshot / (MANIFEST_NAME if target == 'manifest' else f'{target}/metadata'), kind)
  damaged = {}
  for name in [*LINES] + [rundir.REACHED, rundir.FAILURES, STOP_FILE] * text:
    damage(made.run / name, kind)
    damaged[name] = (made.run / name).read_bytes()
  caplog.clear()
  code = _start(made, flags)
  aside = [m for m in caplog.messages if m.startswith(f'skipping memory snapshot {made.snapshot}: ')]
  assert len(aside) == 1 and '; set aside as ' in aside[0], (kind, target, caplog.messages)
  # Moved aside (step 3 is trained again); in RAM, freed with the in-memory tier once finished.
  assert len(list(made.shm.glob('set_aside/*/3-*/3'))) == text, (kind, target)
  err = capsys.readouterr().err
  assert code == (STOPPED if text else 0) and 'Traceback' not in err, (kind, flags, err)
  for name, key in ((HISTORY, 'kind'), (rundir.METRICS_FILE, 'step')):
    # Lines that are no JSON are cut once the start is checked (a line; a read before may have
    # skipped them, a line too); valid JSON of another shape stays, skipped where it is read.
    torn, unparsed = torn_lines(damaged[name], key), torn_lines(damaged[name], None)
    said = [m for m in caplog.messages if m.startswith(f'{made.run / name}: ')]
    cut = [m for m in said if m.startswith(f'{made.run / name}: cut ')]
    assert len(cut) == (unparsed > 0) and len(said) - len(cut) <= (torn > 0), (name, kind, said)
    assert (torn > unparsed) <= (len(said) > len(cut)), (name, kind, said)
    assert torn_lines((made.run / name).read_bytes(), None) == 0  # every line of it parses
  caplog.clear()
  kinds = [line.kind for line in history.read(made.run)]
  assert (kinds[-3:] == [Kind.START, Kind.STOP, Kind.END] if text else
          kinds[-2:] == [Kind.START, Kind.END])
  result = report(made.run)
  assert (result['resumed_from_step'], result['steps']) == (2, 3 if text else 4), result
  assert not (made.run / STOP_FILE).exists()
  assert (made.run / rundir.FAILURES).read_text().startswith('# replay: ')


def _run_state(made, kind, flags, capsys, caplog=None) -> None:
  """run_state.json damaged: a start (or --resume) is one line naming it and its remedy, and
  leaves every file as it was; --fresh replaces the run."""
  made.reset()
  path = made.run / RUN_STATE
  damage(path, kind)
  before = tree(made.run, made.shm)
  if flags != ['--fresh']:
    assert _start(made, flags) == BAD_INPUT
    [line] = error_lines(capsys.readouterr().err)
    assert line.startswith(f'error: {path} ') and 'start anew with --fresh' in line, line
    assert tree(made.run, made.shm) == before
    return
  caplog.clear()
  assert cli.main([*made.args, '--fresh', '--stop-after', '1']) == STOPPED
  assert f'whose {RUN_STATE} could not be read' in caplog.text
  assert read_run_state(made.run).status == 'stopped'
  assert report(made.run)['steps'] == 1 and report(made.run)['resumed_from_step'] is None


def _plot(made, kind, caplog, capsys) -> None:
  """report.json and metrics.jsonl damaged (the plot reads both): plotted without the report
  (a warning), the torn metrics lines skipped, or one error line when no training row is left."""
  made.reset()
  damage(made.run / 'report.json', kind)
  damage(made.run / rundir.METRICS_FILE, kind)
  lines = (made.run / rundir.METRICS_FILE).read_bytes().splitlines()
  rows = len([line for line in lines if line.strip()]) - torn_lines(b'\n'.join(lines), 'step')
  caplog.clear()
  capsys.readouterr()
  code = plot.main([str(made.run)])
  err = capsys.readouterr().err
  warned = [m for m in caplog.messages if m.startswith(f'{made.run / "report.json"}')]
  assert len(warned) == (kind != 'a required key missing'), caplog.messages  # an optional key
  if rows:
    assert code == 0, err
  else:
    assert code == BAD_INPUT and error_lines(err) == [
        f'error: {made.run / rundir.METRICS_FILE} has no training rows to plot'], err


def _token_dirs(made, kind, capsys) -> None:
  """meta.json (a finished token directory) and progress.json (an interrupted one) damaged:
  train.py on it and the prepare rerun are one line naming the file, with the remedy."""
  for name, folder in ((tokendir.META, 'tok'), (tokendir.PROGRESS, 'unf')):
    made.reset()
    path = made.base / folder / name
    damage(path, kind)
    code = cli.main(['--out', str(made.base / 'tokrun'), '--data',
                     f'tokens:{made.base / folder}', *TINY, '--no-snapshots', '-q',
                     'train.compile_cache='])
    [line] = error_lines(capsys.readouterr().err)
    assert code == BAD_INPUT and str(path) in line and '--force' in line, line
    if kind == 'a required key missing':
      assert repr(KEYS[name]) in line, line
    assert prep.main([str(made.corpus), '--out', str(made.base / folder), '-q']) == BAD_INPUT
    [line] = error_lines(capsys.readouterr().err)
    assert str(path) in line and '--force' in line, line
