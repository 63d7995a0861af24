"""`python -m mecefo_jax.data.prepare SOURCE... --out DIR`: a corpus tokenized once, resumably.

The token stream goes to DIR/tokens.bin in chunks; after each chunk is on disk (fsync),
DIR/progress.json records how far the sources were read. An interrupted run (Ctrl-C, a kill, a
power loss) is continued by the same command: it cuts tokens.bin back to the last record and
reads on from there, so the result is byte for byte the uninterrupted one. DIR/meta.json, written
last, marks a finished directory: train.py reads it (`--data tokens:DIR`) and the command does
not rewrite it unless given --force.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import os
import sys
import time
from pathlib import Path

import numpy as np

from mecefo_jax import files
from mecefo_jax.data import tokendir
from mecefo_jax.data.documents import (PIECE_BYTES, DataError, Documents, open_documents,
                                       text_documents)
from mecefo_jax.data.sources import parse_spec
from mecefo_jax.data.tokenizer import Cursor, open_tokenizer, token_chunks
from mecefo_jax.records.job import BAD_INPUT, INTERRUPTED

CHUNK_MB = 64  # text per committed chunk: what an interruption loses at most
_OURS = {tokendir.TOKENS, tokendir.META, tokendir.PROGRESS, tokendir.META + '.tmp',
         tokendir.PROGRESS + '.tmp'}


def open_sources(sources: list[str]) -> Documents:
  """Text files and folders (bare or as text:PATH), in the order given; or one pydoc or one
  hf:NAME[?column=&split=&config=] source, a Hub dataset read as a stream."""
  parsed = [parse_spec(s) if s.startswith(('text:', 'hf:')) or s.partition('?')[0] == 'pydoc'
            else ('text', s, {}) for s in sources]
  for source, (_, _, opts) in zip(sources, parsed):
    if unknown := sorted(set(opts) - {'column', 'split', 'config'}):
      raise DataError(f'{source}: prepare takes no {unknown} here (--tokenizer gives the '
                      f'tokenizer; eval_fraction= is for train.py)')
  if all(scheme == 'text' for scheme, _, _ in parsed):
    return text_documents(' '.join(sources), [Path(p).expanduser() for _, p, _ in parsed])
  if len(parsed) > 1:
    raise DataError(f'{" ".join(sources)}: a pydoc or hf: source comes alone (several text '
                    f'files and folders may come together)')
  return open_documents(sources[0], *parsed[0], streaming=True)


def prepare(sources: list[str], out: str | Path, tokenizer: str | None = None, *,
            force: bool = False, chunk_bytes: int = CHUNK_MB << 20,
            quiet: bool = True) -> tuple[tokendir.Meta, bool]:
  """Prepares `sources` into `out` (or finishes an interrupted preparation of them): meta.json's
  record, and whether this call wrote (False: `out` held this corpus prepared already)."""
  out = Path(out).expanduser()
  where = f'--out {out}'
  documents, tok = open_sources(sources), open_tokenizer(where, tokenizer)
  identity = {'sources': documents.identity, 'tokenizer': tok.fingerprint,
              'dtype': tok.dtype.name, 'piece_bytes': PIECE_BYTES}
  command = tokendir.prepare_command(sources, out, tokenizer)
  _check_foreign(out)
  before = set(os.listdir(out)) if out.exists() else set()
  made = [d for d in (out, *out.absolute().parents) if not d.exists()]  # deepest first
  out.mkdir(parents=True, exist_ok=True)
  lock = _lock(out)
  try:
    progress = _begin(out, identity, command, force)
    if progress is None:
      return tokendir.read_record(out / tokendir.META, where), False
    progress = _write(out, documents, tok, progress, chunk_bytes, quiet)
    return _finish(out, progress, tok, tokenizer), True
  except DataError:  # refused (a binary file, no text): what this call made goes
    _remove_new(out, before, made)
    raise
  finally:
    os.close(lock)


def _remove_new(out: Path, before: set[str], made: list[Path]) -> None:
  """Removes our files that were not in `out` before, and the directories this call `made`."""
  for name in _OURS - before:
    (out / name).unlink(missing_ok=True)
  for directory in made:
    with contextlib.suppress(OSError):  # not empty any more: someone else's now
      directory.rmdir()


def _check_foreign(out: Path) -> None:
  """Refuses a directory holding files of anything else: --force removes only its own."""
  if out.exists() and not out.is_dir():
    raise DataError(f'--out {out}: exists and is not a directory')
  foreign = sorted(p.name for p in out.iterdir() if p.name not in _OURS) if out.exists() else []
  if foreign:
    raise DataError(f'--out {out}: holds other files ({", ".join(foreign[:3])}); give a new or '
                    f'empty directory, or one this command prepared')


def _lock(out: Path) -> int:
  """An exclusive lock on the directory while this process writes it."""
  fd = os.open(out, os.O_RDONLY)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    os.close(fd)
    raise DataError(f'--out {out}: another prepare is writing it') from None
  return fd


def _begin(out: Path, identity: dict, command: str, force: bool) -> tokendir.Progress | None:
  """The committed progress to continue from (a fresh one to start); None where `out` holds
  this corpus prepared already."""
  where = f'--out {out}'
  if force:
    for name in _OURS:
      (out / name).unlink(missing_ok=True)
  held = {tokendir.META: 'a token stream', tokendir.PROGRESS: 'an unfinished token stream'}
  for name, what in held.items():  # a finished stream first: its progress record may be left
    record = tokendir.read_record(out / name, where)
    if record is None:
      continue
    if record.identity != identity:
      raise DataError(f'{where}: holds {what} of other sources or another tokenizer (changed: '
                      f'{", ".join(_changed(record.identity, identity))}; made by '
                      f'`{record.command}`); replace it with --force, or give another --out')
    return None if name == tokendir.META else record
  (out / tokendir.TOKENS).write_bytes(b'')
  return tokendir.Progress(format=tokendir.FORMAT, identity=identity, command=command,
                           cursor=Cursor(), tokens=0, token_min=None, token_max=None)


def _changed(old: dict, new: dict, prefix: str = '') -> list[str]:
  """What differs between two identities, e.g. `sources.bytes 1200 -> 1300`."""
  diffs = []
  for key in sorted(old.keys() | new.keys()):
    a, b = old.get(key), new.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      diffs += _changed(a, b, f'{prefix}{key}.')
    elif key == 'listing_sha256' and a != b:
      diffs.append(f"{prefix}{key} (the files' names or sizes)")
    elif a != b:
      diffs.append(f'{prefix}{key} {a!r:.80} -> {b!r:.80}')
  return diffs


def _write(out: Path, documents: Documents, tok, progress: tokendir.Progress, chunk_bytes: int,
           quiet: bool) -> tokendir.Progress:
  """Appends the rest of the stream chunk by chunk, each durable before its progress record."""
  from tqdm import tqdm
  start = progress.cursor
  bar = tqdm(total=documents.total_bytes, initial=start.bytes_in, unit='B', unit_scale=True,
             unit_divisor=1024, desc='prepare', disable=True if quiet else None,
             file=sys.stderr, mininterval=0.5)
  with open(out / tokendir.TOKENS, 'r+b') as f, bar:
    f.truncate(progress.tokens * tok.dtype.itemsize)  # drops what no record committed
    f.seek(0, os.SEEK_END)
    for ids, cursor in token_chunks(documents, tok, start, chunk_bytes):
      f.write(memoryview(ids))
      f.flush()
      os.fsync(f.fileno())
      progress = _advanced(progress, ids, cursor)
      files.write_json(out / tokendir.PROGRESS, progress, indent=1)
      bar.update(cursor.bytes_in - bar.n)
      bar.set_postfix_str(f'{progress.tokens:,} tokens', refresh=False)
  return progress


def _advanced(progress: tokendir.Progress, ids: np.ndarray,
              cursor: Cursor) -> tokendir.Progress:
  lo, hi = int(ids.min()), int(ids.max())
  old_lo, old_hi = progress.token_min, progress.token_max
  return dataclasses.replace(progress, cursor=cursor, tokens=progress.tokens + len(ids),
                             token_min=lo if old_lo is None else min(lo, old_lo),
                             token_max=hi if old_hi is None else max(hi, old_hi))


def _finish(out: Path, progress: tokendir.Progress, tok,
            tokenizer: str | None) -> tokendir.Meta:
  """meta.json (it marks the directory finished), then the progress record goes."""
  if not progress.tokens:
    raise DataError(f'--out {out}: the sources hold no text')
  meta = tokendir.Meta(
      format=tokendir.FORMAT, identity=progress.identity, command=progress.command,
      vocab_size=tok.vocab_size, dtype=tok.dtype.name, token_count=progress.tokens,
      token_min=progress.token_min, token_max=progress.token_max,
      doc_count=progress.cursor.docs, text_bytes=progress.cursor.bytes_in,
      tokenizer=tok.fingerprint, tokenizer_path=tokenizer, separator_ids=tok.sep_ids.tolist())
  files.write_json(out / tokendir.META, meta, indent=1)
  (out / tokendir.PROGRESS).unlink()
  return meta


class _Parser(argparse.ArgumentParser):
  """Usage errors in one `error: ...` line, as train.py's (run/cli.OneLineParser, a layer up)."""

  def error(self, message):
    print(f'error: {message} (see {self.prog} --help)', file=sys.stderr)
    sys.exit(BAD_INPUT)


def parse_args(argv=None) -> argparse.Namespace:
  p = _Parser(
      prog='python -m mecefo_jax.data.prepare', description=__doc__.splitlines()[0].split(': ')[1],
      epilog='then: mecefo-train --data tokens:DIR model.vocab_size=V (V: meta.json\'s '
             'vocab_size; 256 for bytes; in a checkout: python train.py, the same)')
  p.add_argument('sources', nargs='+', metavar='SOURCE',
                 help='text files and folders (their .txt/.md files, recursively), in this '
                      'order; or pydoc (Python\'s help() texts); or hf:NAME[?column=text&split='
                      'train&config=C], a Hugging Face dataset read as a stream (needs the '
                      'datasets package)')
  p.add_argument('--out', required=True, metavar='DIR', help='the token directory to write')
  p.add_argument('--tokenizer', metavar='PATH', default=None,
                 help='a tokenizer.json (or a folder holding one; needs the tokenizers package); '
                      'default: UTF-8 bytes, vocabulary 256')
  p.add_argument('--force', action='store_true',
                 help='prepare again into a DIR that holds a finished or unfinished preparation')
  p.add_argument('--chunk-mb', type=int, default=CHUNK_MB,
                 help=f'text per committed chunk, what an interruption loses (default {CHUNK_MB})')
  p.add_argument('--quiet', '-q', action='store_true', help='no progress bar')
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  t0 = time.perf_counter()
  try:
    meta, wrote = prepare(args.sources, args.out, args.tokenizer, force=args.force,
                          chunk_bytes=max(args.chunk_mb, 1) << 20, quiet=args.quiet)
  except DataError as e:
    print(f'error: {e}', file=sys.stderr)
    return BAD_INPUT
  except KeyboardInterrupt:
    print(f'\ninterrupted; what was committed in {args.out} stays: run the same command again '
          f'to continue', file=sys.stderr)
    return INTERRUPTED
  done = (f'prepared in {time.perf_counter() - t0:.1f} s' if wrote else
          'prepared already, nothing to do (--force prepares it again)')
  print(f'{args.out}: {meta.token_count:,} tokens ({meta.dtype}) of {meta.doc_count:,} '
        f'documents, ids {meta.token_min}..{meta.token_max} of a vocabulary of '
        f'{meta.vocab_size} (tokenizer {meta.tokenizer}), from {meta.text_bytes:,} '
        f'bytes of text; {done}\ntrain on it: mecefo-train --data tokens:{args.out} '
        f'model.vocab_size={meta.vocab_size} (in a checkout: python train.py, the same)')
  return 0


if __name__ == '__main__':
  sys.exit(main())
