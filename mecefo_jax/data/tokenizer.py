"""Tokenizers (UTF-8 bytes, or a local tokenizer.json) and the token stream of a corpus's pieces."""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Iterator

import numpy as np

from mecefo_jax.data.documents import DataError, Documents, Piece, first_line
from mecefo_jax.sections import entry

BYTE_VOCAB = 256
DOC_SEP_BYTE = 0  # joins documents: NUL never occurs in text, so it marks a boundary unambiguously
_EOS_NAMES = ('<|endoftext|>', '</s>', '<eos>', '[SEP]')  # tokenizer's document separator, if any
# Pieces handed to the Rust tokenizer at once: its parallel batch, while its per-token
# encodings (tens of bytes per token) stay far below a chunk's size in memory.
_ENCODE_BATCH_BYTES = 4 << 20


def token_dtype(vocab_size: int) -> np.dtype:
  """The narrowest unsigned dtype holding ids 0..vocab_size-1."""
  return np.dtype(next(t for t in (np.uint8, np.uint16, np.uint32)
                       if vocab_size - 1 <= np.iinfo(t).max))


class ByteTokenizer:
  """UTF-8 bytes as token ids; documents joined by a NUL byte."""
  vocab_size = BYTE_VOCAB
  fingerprint = 'bytes'
  dtype = np.dtype(np.uint8)
  sep_ids = np.array([DOC_SEP_BYTE], np.uint8)

  def encode(self, texts: list[bytes]) -> list[np.ndarray]:
    return [np.frombuffer(t, np.uint8) for t in texts]


class FileTokenizer:
  """A Hugging Face `tokenizers` file; documents joined by its end-of-text token if it has one,
  else by the tokens of a blank line. Its fingerprint is the file's sha256."""

  def __init__(self, tok, file: Path):
    self._tok, self.file = tok, file
    self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
    self.fingerprint = 'sha256:' + hashlib.sha256(file.read_bytes()).hexdigest()
    self.dtype = token_dtype(self.vocab_size)
    sep = next((i for i in map(tok.token_to_id, _EOS_NAMES) if i is not None), None)
    ids = [sep] if sep is not None else tok.encode('\n\n', add_special_tokens=False).ids
    self.sep_ids = np.asarray(ids, self.dtype)
    # Without the character offsets (tokenizers >= 0.21): the same ids, ~1.5x faster, less memory
    self._encode_batch = getattr(tok, 'encode_batch_fast', tok.encode_batch)

  def encode(self, texts: list[bytes]) -> list[np.ndarray]:
    out, batch, size = [], [], 0
    for k, text in enumerate(texts):
      batch.append(text.decode('utf-8'))
      size += len(text)
      if size >= _ENCODE_BATCH_BYTES or k == len(texts) - 1:
        out += [np.asarray(e.ids, self.dtype)
                for e in self._encode_batch(batch, add_special_tokens=False)]
        batch, size = [], 0
    return out


def open_tokenizer(spec: str, path: str | None) -> ByteTokenizer | FileTokenizer:
  """Bytes without `path`, else the tokenizer.json at `path` (the file, or a folder holding it)."""
  if path is None:
    return ByteTokenizer()
  try:
    from tokenizers import Tokenizer
  except ImportError:
    raise DataError(f'{spec}: a tokenizer needs the tokenizers package; run `pip install '
                    f'tokenizers` (or leave the tokenizer out for byte-level tokens)') from None
  p = Path(path).expanduser()
  file = p / 'tokenizer.json' if p.is_dir() else p
  if not file.is_file():
    raise DataError(f'{spec}: tokenizer file not found: {file}')
  try:
    tok = Tokenizer.from_file(str(file))
  except Exception as e:  # noqa: BLE001 -- the Rust side raises a bare Exception
    raise DataError(f'{spec}: cannot read tokenizer {file}: {first_line(e)}') from None
  return FileTokenizer(tok, file)


@dataclasses.dataclass(frozen=True)
class Cursor:
  """How far a corpus has been tokenized: where the next piece starts, and what came before
  (progress.json's `cursor`)."""
  doc: int = entry('', 'document of the next piece', default=0)
  offset: int = entry('bytes', 'its byte offset there', default=0)
  docs: int = entry('', 'non-empty documents begun (a separator precedes every one but the '
                    'first)', default=0)
  bytes_in: int = entry('bytes', 'text bytes read', default=0)


def token_chunks(documents: Documents, tok, start: Cursor = Cursor(),
                 chunk_bytes: int = 64 << 20) -> Iterator[tuple[np.ndarray, Cursor]]:
  """(ids, cursor after them) for about `chunk_bytes` of text at a time, from `start` on: the
  chunks from any cursor they returned continue the stream exactly as from the start."""
  batch, size, cursor = [], 0, start
  for piece in documents.pieces(start.doc, start.offset):
    batch.append(piece)
    size += len(piece.data)
    if size >= chunk_bytes:
      ids, cursor = _encode(batch, tok, cursor)
      yield ids, cursor
      batch, size = [], 0
  if batch:
    yield _encode(batch, tok, cursor)


def _encode(pieces: list[Piece], tok, cursor: Cursor) -> tuple[np.ndarray, Cursor]:
  parts, docs = [], cursor.docs
  for piece, ids in zip(pieces, tok.encode([p.data for p in pieces])):
    if piece.start == 0:
      parts += [tok.sep_ids] if docs else []
      docs += 1
    parts.append(ids)
  last = pieces[-1]
  read = sum(len(p.data) for p in pieces)
  return (np.concatenate(parts).astype(tok.dtype, copy=False),
          Cursor(last.doc, last.start + len(last.data), docs, cursor.bytes_in + read))
