"""A prepared token directory: tokens.bin (the stream), meta.json (what it holds), progress.json."""
from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Any

import numpy as np

from mecefo_jax import files
from mecefo_jax.data.documents import DataError
from mecefo_jax.data.tokenizer import Cursor
from mecefo_jax.sections import entry

TOKENS, META, PROGRESS = 'tokens.bin', 'meta.json', 'progress.json'
FORMAT = 'mecefo-tokens/1'
DTYPES = ('uint8', 'uint16', 'uint32')


def prepare_command(sources: list[str], out: Path, tokenizer: str | None) -> str:
  """The command that prepares (or finishes preparing) `sources` into `out`."""
  return shlex.join(['python', '-m', 'mecefo_jax.data.prepare', *sources, '--out', str(out),
                     *(['--tokenizer', tokenizer] if tokenizer else [])])


@dataclasses.dataclass
class Made:
  """How a token directory is made: what both of its records begin with."""
  format: str = entry('', f'the records\' format ({FORMAT})')
  identity: dict[str, Any] = entry('', 'what a resumed preparation must find unchanged: the '
                                   "sources, the tokenizer's fingerprint, the dtype and the "
                                   'piece size')
  command: str = entry('', 'the command that prepares (or finishes preparing) the directory')


@dataclasses.dataclass
class Progress(Made):
  """progress.json: how far an unfinished preparation got, written after each chunk is on disk."""
  cursor: Cursor = entry('', 'where the sources were read up to')
  tokens: int = entry('tokens', 'tokens of tokens.bin this record commits (more are cut off)')
  token_min: int | None = entry('', 'smallest id written; null before the first chunk')
  token_max: int | None = entry('', 'largest id written; null before the first chunk')


@dataclasses.dataclass
class Meta(Made):
  """meta.json: what a finished directory holds (written last: it marks the directory done)."""
  vocab_size: int = entry('ids', "the tokenizer's vocabulary")
  dtype: str = entry('', f"the ids' dtype in tokens.bin, one of {DTYPES}")
  token_count: int = entry('tokens', 'tokens in tokens.bin')
  token_min: int = entry('', 'smallest id in the stream')
  token_max: int = entry('', 'largest id in the stream')
  doc_count: int = entry('', 'non-empty documents')
  text_bytes: int = entry('bytes', 'text read')
  tokenizer: str = entry('', "the tokenizer's fingerprint ('bytes' for UTF-8 bytes)")
  tokenizer_path: str | None = entry('', '--tokenizer as given; null for UTF-8 bytes')
  separator_ids: list[int] = entry('', 'the ids that join two documents')


def read_record(path: Path, spec: str) -> Meta | Progress | None:
  """The meta.json or progress.json at `path`, None if there is none; an unreadable one, one
  of another format, or one lacking a key (or of another type) is one DataError line naming
  the file and the key, and what to do."""
  remedy = (f'prepare it again with `python -m mecefo_jax.data.prepare SOURCE... --out '
            f'{path.parent} --force`')
  record = files.read_json(path, Meta if path.name == META else Progress, remedy=remedy,
                           error=lambda message: DataError(f'{spec}: {message}'))
  if record is not None and record.format != FORMAT:
    raise DataError(f'{spec}: {path} is a {record.format!r} record, not {FORMAT!r}; {remedy}')
  return record


def open_tokens(spec: str, path: Path) -> tuple[np.memmap, Meta]:
  """The memory-mapped stream of a finished directory and its meta.json; nothing of the stream
  is read (its size is checked against meta.json)."""
  meta = read_record(path / META, spec)
  if meta is None:
    progress = read_record(path / PROGRESS, spec)
    if progress is not None:
      raise DataError(f'{spec}: {path} is not finished ({progress.tokens:,} tokens so far); '
                      f'finish it with `{progress.command}`')
    raise DataError(f'{spec}: {path} holds no {META}: not a prepared token directory (make one '
                    f'with `python -m mecefo_jax.data.prepare SOURCE --out {path}`)')
  dtype, count = meta.dtype, meta.token_count
  if dtype not in DTYPES or count < 1:
    raise DataError(f'{spec}: {path / META} has dtype {dtype!r} and token_count {count!r}')
  size = (path / TOKENS).stat().st_size if (path / TOKENS).is_file() else None
  if size != count * np.dtype(dtype).itemsize:
    raise DataError(f'{spec}: {path / TOKENS} holds {size} bytes where {META} says {count:,} '
                    f'{dtype} tokens; prepare it again with `{meta.command} --force`')
  return np.memmap(path / TOKENS, dtype=dtype, mode='r', shape=(count,)), meta


def check_vocab(spec: str, meta: Meta, vocab_size: int) -> None:
  """The prepared ids fit the model's embedding (one line otherwise); read from meta.json."""
  if meta.vocab_size > vocab_size or meta.token_max >= vocab_size:
    raise DataError(f'{spec}: prepared with a vocabulary of {meta.vocab_size} ids (tokenizer '
                    f'{meta.tokenizer}), more than model.vocab_size={vocab_size}; set '
                    f'model.vocab_size={meta.vocab_size}')
