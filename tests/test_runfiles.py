"""Run files that survive being torn: the checked reader (mecefo_jax/files.py), and the defects
it fixed (a torn history.jsonl, a truncated run_state.json, a meta.json without a key); the
sweep of every file is tests/test_sweep.py."""
import dataclasses
import errno
import json
import logging
import resource
import signal

import pytest

from mecefo_jax import files
from mecefo_jax.config import ConfigError, load_config, to_dict
from mecefo_jax.data import prepare as prep
from mecefo_jax.data import tokendir
from mecefo_jax.run import cli
from mecefo_jax.run.records import RunRecords
from mecefo_jax.records.history import HISTORY, Kind
from mecefo_jax.records.job import BAD_INPUT
from mecefo_jax.records.run_state import RUN_STATE, RunState, write_run_state
from mecefo_jax.sections import entry
from procs import TINY, error_lines, tree

MISSING = object()


# ---- the checked reader ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Counted:
  """A record as the reader takes it: its JSON types from its fields' annotations."""
  n: int = entry('', 'a count')
  note: str | None = entry('', 'may be absent', optional=True)


@dataclasses.dataclass(frozen=True)
class _Kinded:
  kind: str = entry('', 'what the line says')


def test_read_json_names_the_file_what_is_wrong_and_the_remedy(tmp_path):
  path = tmp_path / 'r.json'
  read = lambda: files.read_json(path, _Counted, remedy='do X', error=ConfigError)
  assert read() is None
  for text, wrong in [('', 'is empty'), ('{"n": 1', 'is not valid JSON'),
                      ('[1]', 'holds a list, not a JSON object'), ('{}', "lacks the key 'n'"),
                      ('{"n": true}', "key 'n' is a boolean, not a number"),
                      ('{"n": "1"}', "key 'n' is a string")]:
    path.write_text(text)
    with pytest.raises(ConfigError, match=f'^{path}.*{wrong}.*; do X$'):
      read()
  path.write_bytes(b'\xff{"n": 1}')
  with pytest.raises(ConfigError, match='is not valid JSON'):
    read()
  path.write_text('{"n": 3}')
  assert read() == _Counted(3)
  path.write_text('{"n": 3, "note": "x", "later": 1}')  # a key of a later version: passed over
  assert read() == _Counted(3, 'x')


def test_read_jsonl_skips_torn_lines_with_one_warning_and_appends_on_a_new_line(tmp_path,
                                                                                   caplog):
  path = tmp_path / 'h.jsonl'
  path.write_bytes(b'{"kind": "a"}\n[1]\n{"t": 1}\n\xff\n{"kind": "b"}\n{"kind": "sta')
  with caplog.at_level(logging.WARNING, 'mecefo'):
    assert files.read_jsonl(path, _Kinded) == [_Kinded('a'), _Kinded('b')]
  assert caplog.messages == [f'{path}: skipped 4 unreadable line(s) (line 2, 3, 4, 6; a write '
                             'cut by a crash?)']
  files.append_line(path, '{"kind": "c"}')
  caplog.clear()
  assert files.read_jsonl(path, _Kinded)[-1] == _Kinded('c')
  assert path.read_bytes().endswith(b'"sta\n{"kind": "c"}\n')


def test_a_torn_history_line_is_skipped_and_the_records_count_on(tmp_path, caplog):
  """Defect 4: a torn last line in history.jsonl (a crash mid-append) made every resumed run
  die in report.build -> steps_lost_total with a JSONDecodeError."""
  records = RunRecords(tmp_path, True)
  records.history(Kind.THROWN_AWAY, from_step=3, to_step=5)
  with open(tmp_path / HISTORY, 'a') as f:
    f.write('{"t": 1.0, "kind": "thrown_aw')  # what a crash mid-write leaves
  with caplog.at_level(logging.WARNING, 'mecefo'):
    assert records.steps_lost_total() == 2
  records.history(Kind.THROWN_AWAY, from_step=7, to_step=8)  # on a line of its own
  assert records.steps_lost_total() == 3
  assert [m for m in caplog.messages if 'unreadable line' in m] == 2 * [  # one a read
      f'{tmp_path / HISTORY}: skipped 1 unreadable line(s) (line 2; a write cut by a '
      'crash?)']


def test_a_start_cuts_torn_lines_so_that_every_line_parses(tmp_path, caplog):
  """Issue 49 item 3: a torn line stayed in metrics.jsonl for good (a resume appended after
  it). cut_torn_lines: a torn last line alone is truncated in place (no new block: a full
  disk); torn lines before it, the file replaced without them; one warning; an unended but
  whole last line is ended; a file without torn lines stays byte for byte."""
  path = tmp_path / 'm.jsonl'
  path.write_bytes(b'{"step": 1}\n{"step": 2}\n{"kind"')
  inode = path.stat().st_ino
  with caplog.at_level(logging.WARNING, 'mecefo'):
    files.cut_torn_lines(path)
  assert path.read_bytes() == b'{"step": 1}\n{"step": 2}\n' and path.stat().st_ino == inode
  assert caplog.messages == [f"{path}: cut 1 torn line(s) (line 3: '{{\"kind\"'; a write cut by "
                             'a crash or a full disk), so that every line of it parses']
  path.write_bytes(b'{"step": 1}\n{"ste\n\xff\n{"step": 2}\n{"step": 3')
  caplog.clear()
  with caplog.at_level(logging.WARNING, 'mecefo'):
    files.cut_torn_lines(path)
  assert path.read_bytes() == b'{"step": 1}\n{"step": 2}\n'
  assert len(caplog.messages) == 1 and 'cut 3 torn line(s) (line 2, 3, 5:' in caplog.messages[0]
  path.write_bytes(b'{"step": 1}')
  files.cut_torn_lines(path)
  assert path.read_bytes() == b'{"step": 1}\n'
  files.cut_torn_lines(path)
  files.cut_torn_lines(tmp_path / 'none.jsonl')
  assert path.read_bytes() == b'{"step": 1}\n' and not (tmp_path / 'none.jsonl').exists()


def test_an_append_that_fails_part_way_is_cut_off_again(tmp_path):
  """A write the kernel takes only in part (here past RLIMIT_FSIZE: EFBIG after the bytes
  below the limit, as a full disk gives ENOSPC after the bytes that fit) leaves the file as it
  was, not a torn line for the next append to follow."""
  path = tmp_path / 'h.jsonl'
  files.append_line(path, '{"kind": "a"}')
  before = path.read_bytes()
  limits = resource.getrlimit(resource.RLIMIT_FSIZE)
  previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
  resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) + 5, limits[1]))
  try:
    with pytest.raises(OSError) as failed:
      files.append_line(path, '{"kind": "b", "text": "longer than the 5 bytes left"}')
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    signal.signal(signal.SIGXFSZ, previous)
  assert failed.value.errno == errno.EFBIG
  assert path.read_bytes() == before
  files.append_line(path, '{"kind": "c"}')
  assert [r['kind'] for r in files.read_jsonl(path)] == ['a', 'c']


def test_a_truncated_run_state_is_one_line_naming_it_and_stays_as_it_was(tmp_path, capsys):
  """Defect 5: a truncated run_state.json was a JSONDecodeError traceback on every start."""
  out = tmp_path / 'run'
  out.mkdir()
  write_run_state(out, RunState('stopped', run_id='abc', n_slices=1, n_hosts=1,
                         config=to_dict(load_config(None, TINY))))
  path = out / RUN_STATE
  path.write_bytes(path.read_bytes()[:40])
  before = tree(out)
  for flags in ([], ['--resume']):
    assert cli.main(['--out', str(out), *flags, 'train.compile_cache=']) == BAD_INPUT
    [line] = error_lines(capsys.readouterr().err)
    assert line.startswith(f'error: {path} is not valid JSON') and '--fresh' in line, line
    assert "snapshots and checkpoints are still there" in line
    assert tree(out) == before


def test_a_meta_json_without_a_key_is_one_line_naming_the_file_and_the_key(tmp_path, capsys):
  """Defect 6: a meta.json that parses but lacks vocab_size was a KeyError traceback."""
  (tmp_path / 'a.txt').write_text('some text to tokenize, ' * 40)
  tok = tmp_path / 'tok'
  prep.prepare([str(tmp_path / 'a.txt')], tok)
  meta = json.loads((tok / tokendir.META).read_text())
  for key, value in [('vocab_size', MISSING), ('token_max', MISSING), ('tokenizer', MISSING),
                     ('command', MISSING), ('token_count', 'many')]:
    record = {**meta, key: value}
    (tok / tokendir.META).write_text(json.dumps({k: v for k, v in record.items()
                                                 if v is not MISSING}))
    code = cli.main(['--out', str(tmp_path / 'run'), '--data', f'tokens:{tok}', *TINY,
                     'train.compile_cache=', '--no-snapshots'])
    [line] = error_lines(capsys.readouterr().err)
    assert code == BAD_INPUT and f'{tok / tokendir.META}' in line and repr(key) in line, line
    assert prep.main([str(tmp_path / 'a.txt'), '--out', str(tok)]) == BAD_INPUT
    [line] = error_lines(capsys.readouterr().err)
    assert f'{tok / tokendir.META}' in line and repr(key) in line and '--force' in line, line
