"""A prepared token directory: tokens.bin (the stream), meta.json (what it holds), progress.json."""
from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import numpy as np

from mecefo_jax.data.documents import DataError, first_line

TOKENS, META, PROGRESS = 'tokens.bin', 'meta.json', 'progress.json'
FORMAT = 'mecefo-tokens/1'
DTYPES = ('uint8', 'uint16', 'uint32')


def prepare_command(sources: list[str], out: Path, tokenizer: str | None) -> str:
  """The command that prepares (or finishes preparing) `sources` into `out`."""
  return shlex.join(['python', '-m', 'mecefo_jax.data.prepare', *sources, '--out', str(out),
                     *(['--tokenizer', tokenizer] if tokenizer else [])])


def write_json(path: Path, record: dict) -> None:
  """Replaces `path` atomically and durably: a crash leaves the old record or the new one."""
  tmp = path.with_name(path.name + '.tmp')
  with open(tmp, 'w') as f:
    json.dump(record, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  fd = os.open(path.parent, os.O_RDONLY)
  try:
    os.fsync(fd)  # the rename itself survives a power loss
  finally:
    os.close(fd)


def read_json(path: Path, spec: str) -> dict | None:
  """The record at `path`, None if there is none; an unreadable one is one DataError line."""
  try:
    record = json.loads(path.read_text())
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:
    raise DataError(f'{spec}: cannot read {path}: {first_line(e)}') from None
  if not isinstance(record, dict) or record.get('format') != FORMAT:
    raise DataError(f'{spec}: {path} is not a {FORMAT} record')
  return record


def open_tokens(spec: str, path: Path) -> tuple[np.memmap, dict]:
  """The memory-mapped stream of a finished directory and its meta.json; nothing of the stream
  is read (its size is checked against meta.json)."""
  meta = read_json(path / META, spec)
  if meta is None:
    progress = read_json(path / PROGRESS, spec)
    if progress is not None:
      raise DataError(f'{spec}: {path} is not finished ({progress["tokens"]:,} tokens so far); '
                      f'finish it with `{progress["command"]}`')
    raise DataError(f'{spec}: {path} holds no {META}: not a prepared token directory (make one '
                    f'with `python -m mecefo_jax.data.prepare SOURCE --out {path}`)')
  dtype, count = meta.get('dtype'), meta.get('token_count')
  if dtype not in DTYPES or not isinstance(count, int) or count < 1:
    raise DataError(f'{spec}: {path / META} has dtype {dtype!r} and token_count {count!r}')
  size = (path / TOKENS).stat().st_size if (path / TOKENS).is_file() else None
  if size != count * np.dtype(dtype).itemsize:
    raise DataError(f'{spec}: {path / TOKENS} holds {size} bytes where {META} says {count:,} '
                    f'{dtype} tokens; prepare it again with `{meta["command"]} --force`')
  return np.memmap(path / TOKENS, dtype=dtype, mode='r', shape=(count,)), meta


def check_vocab(spec: str, meta: dict, vocab_size: int) -> None:
  """The prepared ids fit the model's embedding (one line otherwise); read from meta.json."""
  if meta['vocab_size'] > vocab_size or meta['token_max'] >= vocab_size:
    raise DataError(f'{spec}: prepared with a vocabulary of {meta["vocab_size"]} ids (tokenizer '
                    f'{meta["tokenizer"]}), more than model.vocab_size={vocab_size}; set '
                    f'model.vocab_size={meta["vocab_size"]}')
