"""A prepared token directory: tokens.bin (the stream), meta.json (what it holds), progress.json."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np

from mecefo_jax import files
from mecefo_jax.data.documents import DataError

TOKENS, META, PROGRESS = 'tokens.bin', 'meta.json', 'progress.json'
FORMAT = 'mecefo-tokens/1'
DTYPES = ('uint8', 'uint16', 'uint32')


def prepare_command(sources: list[str], out: Path, tokenizer: str | None) -> str:
  """The command that prepares (or finishes preparing) `sources` into `out`."""
  return shlex.join(['python', '-m', 'mecefo_jax.data.prepare', *sources, '--out', str(out),
                     *(['--tokenizer', tokenizer] if tokenizer else [])])


# The keys of each record and their types, checked when it is read (files.read_json).
NULLABLE_INT = (int, type(None))
PROGRESS_KEYS = {'format': str, 'identity': dict, 'command': str, 'cursor': dict, 'tokens': int,
                 'token_min': NULLABLE_INT, 'token_max': NULLABLE_INT}
CURSOR_KEYS = {'doc': int, 'offset': int, 'docs': int, 'bytes_in': int}
META_KEYS = {'format': str, 'identity': dict, 'command': str, 'vocab_size': int, 'dtype': str,
             'token_count': int, 'token_min': int, 'token_max': int, 'doc_count': int,
             'text_bytes': int, 'tokenizer': str}


def write_json(path: Path, record: dict) -> None:
  """Replaces `path` atomically and durably: a crash leaves the old record or the new one."""
  files.replace_text(path, json.dumps(record, indent=1))


def read_record(path: Path, spec: str) -> dict | None:
  """The meta.json or progress.json at `path`, None if there is none; an unreadable one, one
  of another format, or one lacking a key (or of another type) is one DataError line naming
  the file and the key, and what to do."""
  remedy = (f'prepare it again with `python -m mecefo_jax.data.prepare SOURCE... --out '
            f'{path.parent} --force`')
  keys = META_KEYS if path.name == META else PROGRESS_KEYS
  record = files.read_json(path, keys, remedy=remedy,
                           error=lambda message: DataError(f'{spec}: {message}'))
  if record is None:
    return None
  problem = (f'{path} is a {record["format"]!r} record, not {FORMAT!r}'
             if record['format'] != FORMAT else
             files.check_keys(record['cursor'], CURSOR_KEYS, f'{path}: cursor')
             if path.name == PROGRESS else None)
  if problem:
    raise DataError(f'{spec}: {problem}; {remedy}')
  return record


def open_tokens(spec: str, path: Path) -> tuple[np.memmap, dict]:
  """The memory-mapped stream of a finished directory and its meta.json; nothing of the stream
  is read (its size is checked against meta.json)."""
  meta = read_record(path / META, spec)
  if meta is None:
    progress = read_record(path / PROGRESS, spec)
    if progress is not None:
      raise DataError(f'{spec}: {path} is not finished ({progress["tokens"]:,} tokens so far); '
                      f'finish it with `{progress["command"]}`')
    raise DataError(f'{spec}: {path} holds no {META}: not a prepared token directory (make one '
                    f'with `python -m mecefo_jax.data.prepare SOURCE --out {path}`)')
  dtype, count = meta['dtype'], meta['token_count']
  if dtype not in DTYPES or count < 1:
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
