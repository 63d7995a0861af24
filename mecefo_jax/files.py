"""The one checked reader (and durable writer) of the files the project reads back (errors.md)."""
from __future__ import annotations

import codecs
import dataclasses
import json
import logging
import os
import tempfile
from pathlib import Path
import typing
from typing import Any, Callable

import yaml

from mecefo_jax import sections

log = logging.getLogger('mecefo')


def default_snapshot_dir(run_name: str) -> Path:
  """/dev/shm/mecefo/<run_name>: tmpfs, so snapshots outlive a crash of the trainer process."""
  base = Path('/dev/shm') if Path('/dev/shm').is_dir() else Path(tempfile.gettempdir())
  return base / 'mecefo' / run_name


class FileError(ValueError):
  """A file that cannot be read as its reader expects; raised as the caller's error class."""


def _type_name(value) -> str:
  return {dict: 'an object', list: 'a list', str: 'a string', bool: 'a boolean',
          type(None): 'null'}.get(type(value), 'a number')


def _json_name(tp) -> str:
  """How a one-line error names a field's JSON type: 'a string', 'a number or null'..."""
  inner = sections.nullable(tp)
  if inner is not None:
    return f'{_json_name(inner)} or null'
  origin = typing.get_origin(tp) or tp
  if sections.is_section(tp) or origin is dict:
    return 'an object'
  if origin in (list, tuple):
    return 'a list'
  if origin is bool:
    return 'a boolean'
  return 'a number' if origin in (int, float) else 'a string'  # str, a Literal or an Enum


def problem(record: type, value: Any, where: str) -> str | None:
  """What is wrong with `value`, parsed JSON, as the record type `record` (a dataclass of
  sections.entry fields): one line naming `where`, or None. Keys it does not declare are
  passed over (a file a later version wrote)."""
  if not isinstance(value, dict):
    return f'{where} holds {_type_name(value)}, not a JSON object'
  for f, (key, tp, _, _) in zip(dataclasses.fields(record), sections.fields(record)):
    if key not in value:
      if sections.is_optional(f):
        continue
      return f'{where} lacks the key {key!r}'
    found: list[str] = []
    sections.check(tp, value[key], key, found, strict=False)
    if found and found[0].startswith(f'{key}: expected'):
      return f'{where}: key {key!r} is {_type_name(value[key])}, not {_json_name(tp)}'
    if found:
      return f'{where}: {found[0]}'
  return None


def read_bytes(path) -> bytes | None:
  """The bytes of `path` (a Path or an etils path), None if there is no such file."""
  try:
    return path.read_bytes() if hasattr(path, 'read_bytes') else Path(path).read_bytes()
  except (FileNotFoundError, NotADirectoryError):
    return None


def read_json(path, record=None, *, remedy: str,
              error: Callable[[str], Exception] = FileError):
  """The record of type `record` (a dataclass of sections.entry fields; None: any JSON object)
  that `path` holds, None if there is no file. Anything else (unreadable, cut, not an object, a
  key missing or of another type) raises `error` in one line naming the file, what is wrong and
  `remedy`."""
  tail = f'; {remedy}' if remedy else ''
  try:
    data = read_bytes(path)
  except OSError as err:
    raise error(f'{path} cannot be read ({err.strerror or err}){tail}') from None
  if data is None:
    return None
  try:
    value = json.loads(data.decode('utf-8'))
  except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
    what = 'is empty' if not data.strip() else f'is not valid JSON ({err})'
    raise error(f'{path} {what}{tail}') from None
  wrong = (problem(record, value, str(path)) if record is not None else
           None if isinstance(value, dict) else
           f'{path} holds {_type_name(value)}, not a JSON object')
  if wrong:
    raise error(wrong + tail)
  return sections.from_json(record, value) if record is not None else value


def read_jsonl(path, records=None, warn: bool = True) -> list:
  """The records of `path`, one a line, each of the first type of `records` (a record type, or
  a tuple of them; None: any JSON object) it reads as ([] without the file); or, `records` a
  function, what it returns for the line's JSON (None: no record; history lines, whose kind
  says what they hold). Lines that are no such record (cut by a crash, or damaged) are
  skipped, with one warning for the file (`warn`: a second reader of a file that another read
  warns about says nothing)."""
  data = read_bytes(path)
  kinds = records if isinstance(records, tuple) else (records,)
  rows, bad = [], []
  for number, line in enumerate((data or b'').decode('utf-8', 'replace').splitlines(), 1):
    if not line.strip():
      continue
    try:
      value = json.loads(line)
    except ValueError:
      value = None
    if records is None:
      row = value if isinstance(value, dict) else None
    elif callable(records) and not isinstance(records, type):  # the caller's reader of a line
      row = records(value)
    else:
      kind = next((k for k in kinds if problem(k, value, '') is None), None)
      row = None if kind is None else sections.from_json(kind, value)
    if row is None:
      bad.append(number)
      continue
    rows.append(row)
  if bad and warn:
    log.warning('%s: skipped %d unreadable line(s) (line %s; a write cut by a crash?)', path,
                len(bad), ', '.join(map(str, bad[:5])) + (', ...' if len(bad) > 5 else ''))
  return rows


def json_text(record, indent: int | None = None) -> str:
  """`record`'s JSON text, its keys in field order."""
  return json.dumps(sections.to_json(record), indent=indent)


def write_json(path: Path, record, indent: int | None = None) -> None:
  """`record` as `path`'s JSON, replaced atomically and durably (replace_text)."""
  replace_text(path, json_text(record, indent))


def read_text(path) -> str | None:
  """The text of `path` (undecodable bytes replaced), None if there is no such file."""
  data = read_bytes(path)
  return None if data is None else data.decode('utf-8', 'replace')


def append_line(path: Path, line: str) -> None:
  """Appends `line` to `path`, flushed and fsynced, whole or not at all (append_whole); on a new
  line even if the file ends in a line cut by a crash (which then stays one unreadable line of
  its own, until cut_torn_lines)."""
  fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
  try:
    size = os.fstat(fd).st_size
    torn = size > 0 and os.pread(fd, 1, size - 1) != b'\n'
    append_whole(fd, (('\n' if torn else '') + line + '\n').encode())
    os.fsync(fd)
  finally:
    os.close(fd)


def append_whole(fd: int, data: bytes) -> None:
  """Appends `data` to the file open at `fd` (O_APPEND) whole or not at all: a write that fails
  part-way (a full disk, EIO) is cut off again (a truncate needs no free block), so that no
  torn line stays in the file for a later write to follow."""
  size = os.fstat(fd).st_size
  view = memoryview(data)
  try:
    while view:
      view = view[os.write(fd, view):]
  except OSError:
    try:
      os.ftruncate(fd, size)
    except OSError:  # not a regular file (a test's /dev/full), or the device is gone
      pass
    raise


def overwrite_in_place(path: Path, text: str) -> bool:
  """Writes `text` over `path`'s own bytes when it is no longer than the file (a full disk
  refuses the new file of an atomic replace, not the blocks a file holds already): the
  fallback for run_state.json, whose status must say the truth. False where it cannot."""
  data = text.encode()
  try:
    fd = os.open(path, os.O_WRONLY)
  except OSError:
    return False
  try:
    if os.fstat(fd).st_size < len(data):
      return False
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))
    os.fsync(fd)
    return True
  except OSError:
    return False
  finally:
    os.close(fd)


def _parses(line: bytes) -> bool:
  try:
    json.loads(line)
    return True
  except ValueError:
    return False


def cut_torn_lines(path: Path) -> None:
  """Cuts the lines of `path` that are no JSON (a write cut by a crash, or torn by a full disk
  before appends were whole) with one warning, and ends its last line, so that every line of
  the file parses before more are appended. A torn last line alone is truncated in place (no
  new block needed on a full disk); else the file is replaced (replace_text)."""
  data = read_bytes(path) or b''
  lines = data.splitlines(keepends=True)
  torn = [n for n, line in enumerate(lines, 1) if not _parses(line)]
  if torn == [len(lines)]:
    os.truncate(path, len(data) - len(lines[-1]))
  elif torn:
    kept = b''.join(line for n, line in enumerate(lines, 1) if n not in torn)
    replace_text(path, kept.decode() + ('\n' if kept and not kept.endswith(b'\n') else ''))
  elif data and not data.endswith(b'\n'):
    with open(path, 'ab') as f:
      f.write(b'\n')
  if torn:
    first = lines[torn[0] - 1].rstrip(b'\n').decode('utf-8', 'replace')
    log.warning('%s: cut %d torn line(s) (line %s: %r; a write cut by a crash or a full disk), '
                'so that every line of it parses', path, len(torn),
                ', '.join(map(str, torn[:5])) + (', ...' if len(torn) > 5 else ''),
                first[:40] + ('...' if len(first) > 40 else ''))


def replace_text(path: Path, text: str) -> None:
  """Replaces `path` atomically and durably: a crash leaves the old text or the new one."""
  path = Path(path)
  tmp = path.with_name(path.name + '.tmp')
  try:
    with open(tmp, 'w') as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:  # a full disk, an I/O error: no half-written copy is left beside it
    tmp.unlink(missing_ok=True)
    raise
  fd = os.open(path.parent, os.O_RDONLY)
  try:
    os.fsync(fd)  # the rename itself survives a power loss
  finally:
    os.close(fd)


def check_text(data: bytes, path: Path, what: str, error: type[ValueError], *,
               final: bool = True, offset: int = 0) -> None:
  """Raises `error` (one line) where `data`, the bytes of `path`, are not text: a NUL byte or
  bytes that are not UTF-8. `final=False`: `data` is only the file's start (it may end inside a
  character). `offset`: where `data` starts in the file (the message counts from the file's
  start)."""
  nul = data.find(b'\0')
  try:
    codecs.getincrementaldecoder('utf-8')().decode(data[:nul] if nul >= 0 else data,
                                                   final or nul >= 0)
  except UnicodeDecodeError as err:
    nul = err.start
  if nul >= 0:
    raise error(f'{what} {str(path)!r} is not UTF-8 text (byte {offset + nul}); is it a '
                f'binary file?')


def read_user_text(path: Path, what: str, error: type[ValueError]) -> str:
  """The UTF-8 text of a file the user named (a config, a failure trace): missing, a directory,
  unreadable or binary is one `error` line naming it as `what`."""
  if path.is_dir():
    raise error(f'{what} {str(path)!r} is a directory; give the file itself')
  if not path.is_file():
    raise error(f'{what} {str(path)!r} not found')
  try:
    data = path.read_bytes()
  except OSError as err:
    raise error(f'cannot read {what} {str(path)!r}: {err.strerror or err}') from None
  check_text(data, path, what, error)
  return data.decode('utf-8')


class _UniqueKeyLoader(yaml.SafeLoader):
  """Refuses a key given twice in a mapping (PyYAML keeps the last: a 2nd `train:` drops
  the 1st), raised as `error`."""
  error: type[ValueError] = FileError

  def construct_mapping(self, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
      key = self.construct_object(key_node, deep=deep)
      if key in seen:
        raise self.error(f'{self.name} gives {key!r} twice (line {key_node.start_mark.line + 1}); '
                         f'merge the two into one')
      seen.add(key)
    return super().construct_mapping(node, deep)


def read_yaml(text: str, where: str, error: type[ValueError]):
  """Safe YAML; a syntax error or a key given twice is one line naming `where`, raised as
  `error`."""
  loader = _UniqueKeyLoader(text)
  loader.name, loader.error = where, error
  try:
    return loader.get_single_data()
  except yaml.YAMLError as err:
    mark = getattr(err, 'problem_mark', None)
    at = f' (line {mark.line + 1}, column {mark.column + 1})' if mark else ''
    problem = getattr(err, 'problem', None) or str(err).splitlines()[0]
    raise error(f'{where} is not valid YAML{at}: {problem}') from None
  finally:
    loader.dispose()
