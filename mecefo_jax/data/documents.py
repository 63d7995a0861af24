"""A corpus's documents as a resumable stream of text pieces: text files, pydoc, Hugging Face."""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple

from mecefo_jax.files import check_text

TEXT_SUFFIXES = ('.txt', '.md')
# A document is read in pieces of at most this many bytes, cut after a line end: memory stays
# bounded on a 100 GB file, and a tokenizer sees whole lines. Part of a prepared stream's
# identity (the cuts place a tokenizer's boundaries): a resume must cut where the start did.
# Small, since a tokenizer's memory grows faster than its input's length: 4 MiB of text in
# 1 MiB pieces took 364 MB in `tokenizers` 0.23, in 64 KiB pieces 144 MB.
PIECE_BYTES = 1 << 16


class DataError(ValueError):
  """A data source cannot be used; the message is one line naming the spec/path and the problem."""


class Piece(NamedTuple):
  doc: int      # index of the document in the stream (empty documents count too)
  start: int    # byte offset of `data` in the document; 0 starts a document
  data: bytes   # UTF-8 text, cut at a character boundary


class Documents:
  """Documents in a fixed order, read from any (document, byte offset) on: a preparation
  interrupted there continues with exactly the pieces an uninterrupted one would have read."""

  def __init__(self, identity: dict, total_bytes: int | None,
               docs_from: Callable[[int], Iterable[tuple[Check | None, Read]]]):
    self.identity = identity        # what a resumed preparation must find unchanged
    self.total_bytes = total_bytes  # None where unknown before reading (a stream)
    # doc index -> (check, read) of each document from that one on; check is None for text
    # that was a str already (pydoc, hf), else it refuses a piece that is not text (files)
    self._docs_from = docs_from

  def pieces(self, doc: int = 0, offset: int = 0) -> Iterator[Piece]:
    for i, (check, read) in enumerate(self._docs_from(doc), doc):
      yield from _doc_pieces(i, check, read, offset if i == doc else 0)


Read = Callable[[int, int], bytes]        # (offset, n) -> at most n bytes of the document
Check = Callable[[bytes, int], None]      # (piece, offset) -> None, or DataError


def _doc_pieces(doc: int, check: Check | None, read: Read, offset: int) -> Iterator[Piece]:
  while block := read(offset, PIECE_BYTES):
    end = _cut(block) if len(block) == PIECE_BYTES else len(block)
    if check is not None:
      check(block[:end], offset)
    yield Piece(doc, offset, block[:end])
    offset += end


def _cut(block: bytes) -> int:
  """Where a full block's piece ends: after its last line end, else before its last character
  (which may be incomplete)."""
  end = block.rfind(b'\n') + 1
  if end:
    return end
  end = len(block) - 1
  while end > 0 and block[end] & 0xC0 == 0x80:  # a UTF-8 continuation byte
    end -= 1
  return end or len(block)


def open_documents(spec: str, scheme: str, path: str, opts: dict[str, str],
                   streaming: bool = False) -> Documents:
  """The documents of a parsed data spec (text, pydoc or hf). `streaming`: read a Hub dataset
  as a stream (prepare), else from its local cache (train.py)."""
  if scheme == 'text':
    return text_documents(spec, [Path(path).expanduser()])
  if scheme == 'pydoc':
    return pydoc_documents()
  return hf_documents(spec, path, opts, streaming)


def text_files(spec: str, paths: list[Path]) -> list[Path]:
  """Each file as given, each folder's .txt/.md files recursively in sorted order."""
  files = []
  for p in paths:
    if not p.exists():
      raise DataError(f'{spec}: path not found: {p}')
    if p.is_file():
      if p.stat().st_size == 0:
        raise DataError(f'{spec}: file is empty: {p}')
      files.append(p)
      continue
    found = sorted((f for f in p.rglob('*') if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES),
                   key=lambda f: f.relative_to(p).as_posix())  # platform-independent order
    if not found:
      raise DataError(f'{spec}: folder has no {"/".join(TEXT_SUFFIXES)} files: {p}')
    if not any(f.stat().st_size for f in found):
      raise DataError(f'{spec}: all {len(found)} {"/".join(TEXT_SUFFIXES)} files are empty in {p}')
    files += found
  return files


def text_documents(spec: str, paths: list[Path]) -> Documents:
  files = text_files(spec, paths)
  sizes = [f.stat().st_size for f in files]
  listing = hashlib.sha256(''.join(f'{f}\0{n}\n' for f, n in zip(files, sizes)).encode())
  identity = {'text': [str(p.resolve()) for p in paths], 'files': len(files),
              'bytes': sum(sizes), 'listing_sha256': listing.hexdigest()}

  def docs_from(first: int):
    for f in files[first:]:
      with open(f, 'rb') as handle:
        yield (lambda data, offset: check_text(data, f, f'{spec}: file', error=DataError,
                                               offset=offset),
               lambda offset, n: (handle.seek(offset), handle.read(n))[1])
  return Documents(identity, sum(sizes), docs_from)


def _utf8(text: str) -> bytes:
  """A str's UTF-8 bytes without NUL, the byte-level document separator (tokenize.py)."""
  return text.replace('\0', '').encode('utf-8', 'replace')


def _in_memory(identity: dict, texts: list[bytes]) -> Documents:
  return Documents(identity, sum(map(len, texts)), lambda first: (
      (None, lambda offset, n, t=t: t[offset:offset + n]) for t in texts[first:]))


def pydoc_documents() -> Documents:
  """The reference topics `help()` shows (pydoc_data.topics, ~0.5 MB of English and code): real
  text on every machine with CPython, no download. Sorted by topic name so the stream does not
  depend on dict order; its content follows the Python version."""
  from pydoc_data.topics import topics
  return _in_memory({'pydoc': sys.version.split()[0]},
                    [_utf8(topics[k]) for k in sorted(topics) if topics[k]])


def hf_documents(spec: str, name: str, opts: dict[str, str], streaming: bool) -> Documents:
  """One text column of a Hugging Face dataset (saved to disk, cached, or streamed from the Hub
  with `streaming`), row by row: the column is never loaded whole."""
  datasets = _import_datasets(spec)
  split, column = opts.get('split', 'train'), opts.get('column', 'text')
  ds = _load_hf(spec, datasets, name, opts.get('config'), split, streaming)
  columns = getattr(ds, 'column_names', None)  # None for some streams: checked row by row
  if columns is not None and column not in columns:
    raise DataError(f'{spec}: dataset has no column {column!r}; columns: {columns}')
  features = getattr(ds, 'features', None)
  if features and getattr(features[column], 'dtype', None) not in ('string', 'large_string'):
    raise DataError(f'{spec}: column {column!r} is {features[column]}, not text')

  def docs_from(first: int):
    rest = ds.skip(first) if isinstance(ds, datasets.IterableDataset) else ds.select(
        range(first, len(ds)))
    for i, row in enumerate(rest.select_columns([column]), first):
      text = row[column]
      if not isinstance(text, str):
        raise DataError(f'{spec}: row {i} of column {column!r} is {type(text).__name__}, not text')
      data = _utf8(text)
      yield None, lambda offset, n, t=data: t[offset:offset + n]
  identity = {'hf': name, 'config': opts.get('config'), 'split': split, 'column': column}
  return Documents(identity, None, docs_from)


def _import_datasets(spec: str):
  try:
    import datasets
  except ImportError:
    raise DataError(f'{spec}: hf: sources need the Hugging Face datasets package; run '
                    f'`pip install datasets`') from None
  return datasets


def _load_hf(spec: str, datasets, name: str, config: str | None, split: str, streaming: bool):
  try:
    if Path(name).expanduser().exists():
      ds = datasets.load_from_disk(str(Path(name).expanduser()))
    else:
      ds = datasets.load_dataset(name, config, split=split, streaming=streaming)
  except Exception as e:  # noqa: BLE001 -- datasets raises many types; all mean "cannot load"
    raise DataError(f'{spec}: cannot load dataset {name!r}: {type(e).__name__}: '
                    f'{first_line(e)}') from None
  if isinstance(ds, datasets.DatasetDict):
    if split not in ds:
      raise DataError(f'{spec}: dataset has no split {split!r}; splits: {sorted(ds)}')
    ds = ds[split]
  return ds


def first_line(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return lines[0] if lines else type(e).__name__
