"""Corpus preparation: text MB/s, tokens/s and peak memory of mecefo_jax.data.prepare, and what a
100 GB corpus costs at the measured rate.

Run: python -m benchmarks.prepare_rate [--mb 64,512] [--tokenizer PATH] [--json OUT]

For each size, writes a text corpus to a temporary folder (CPython's help() topics,
pydoc_data.topics, ~0.5 MB, repeated in a seeded order into 8 MB files), runs
`python -m mecefo_jax.data.prepare CORPUS --out DIR --quiet` as a child process and reads its
wall time and peak resident memory (getrusage of that child). Then opens the prepared directory
as train.py does (`tokens:DIR`) and reads one batch of rows, timed. The 100 GB estimate scales
the largest size's rate linearly; its memory is the largest size's peak (the command holds one
chunk of text at a time, so the peak does not grow with the corpus: compare the sizes).
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import common

FILE_BYTES = 8 << 20
CORPUS_GB = 100  # the estimate's corpus (10^9 bytes)
# Runs argv[1:] and prints its peak resident KiB (the children's ru_maxrss of a process that
# has no other child).
_PEAK = ('import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, '
         'stdout=subprocess.DEVNULL); '
         'print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)')


def _args(argv):
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument('--mb', default='64,512', help='corpus sizes in MiB, comma-separated')
  p.add_argument('--tokenizer', default=None, help='a tokenizer.json (default: bytes)')
  p.add_argument('--chunk-mb', type=int, default=None, help="prepare's --chunk-mb (its default)")
  return p.parse_intermixed_args(argv)


def write_corpus(folder: Path, size: int, seed: int = 0) -> int:
  """Text files of FILE_BYTES (the last shorter) holding `size` bytes: the help() topics in a
  seeded random order, again and again. Returns the bytes written."""
  from pydoc_data.topics import topics
  texts = [topics[k].encode() for k in sorted(topics) if topics[k]]
  rng, written, buf, n_files = np.random.default_rng(seed), 0, bytearray(), 0
  folder.mkdir(parents=True)
  while written < size:
    for i in rng.permutation(len(texts)):
      buf += texts[i][:size - written - len(buf)] + b'\n\n'
      if len(buf) >= FILE_BYTES or written + len(buf) >= size:
        (folder / f'part{n_files:05d}.txt').write_bytes(bytes(buf))
        written, buf, n_files = written + len(buf), bytearray(), n_files + 1
      if written >= size:
        break
  return written


def measure(corpus: Path, out: Path, args) -> dict:
  command = [sys.executable, '-m', 'mecefo_jax.data.prepare', str(corpus), '--out', str(out),
             '--quiet', *(['--tokenizer', args.tokenizer] if args.tokenizer else []),
             *(['--chunk-mb', str(args.chunk_mb)] if args.chunk_mb else [])]
  t0 = time.perf_counter()
  # Through a small parent: a child forked from this process (jax imported) would report this
  # process's resident size as its peak (Linux carries it over the fork and exec).
  proc = subprocess.run([sys.executable, '-c', _PEAK, *command], cwd=common.REPO,
                        capture_output=True, text=True)
  seconds = time.perf_counter() - t0
  if proc.returncode:
    raise SystemExit(f'error: {" ".join(command)} exited {proc.returncode}: {proc.stderr}')
  meta = json.loads((out / 'meta.json').read_text())
  return {'text_mib': round(meta['text_bytes'] / 2**20, 1), 'tokens': meta['token_count'],
          'dtype': meta['dtype'], 'seconds': round(seconds, 2),
          'text_mib_per_s': round(meta['text_bytes'] / 2**20 / seconds, 1),
          'tokens_per_s': round(meta['token_count'] / seconds),
          'peak_rss_mb': round(int(proc.stdout.split()[-1]) / 1024, 1),  # Linux: KiB
          'open_and_batch_s': _open_and_read(out, meta['vocab_size'])}


def _open_and_read(out: Path, vocab_size: int) -> float:
  """Seconds to open the directory as train.py does and read a 64 x 257 batch of windows."""
  from mecefo_jax.data.sources import load_corpus
  t0 = time.perf_counter()
  corpus = load_corpus(f'tokens:{out}', seq_len=256, seed=0, vocab_size=vocab_size)
  corpus.sequences(np.arange(64))
  return round(time.perf_counter() - t0, 4)


def estimate(row: dict) -> dict:
  """What CORPUS_GB of the same text costs at `row`'s rate (time linear, memory flat)."""
  text = CORPUS_GB * 10**9
  return {'corpus_gb': CORPUS_GB,
          'hours': round(text / (row['text_mib_per_s'] * 2**20) / 3600, 2),
          'peak_rss_mb': row['peak_rss_mb'],
          'tokens_bin_gb': round(text * row['tokens'] / (row['text_mib'] * 2**20) *
                                 np.dtype(row['dtype']).itemsize / 10**9, 1)}


def _uptime() -> str:
  return subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()


def main(argv=None) -> dict:
  args = _args(argv)
  rows, uptime = [], {'start': _uptime()}
  for mb in (int(s) for s in args.mb.split(',')):
    with tempfile.TemporaryDirectory(prefix='mecefo-prepare-') as tmp:
      write_corpus(Path(tmp) / 'corpus', mb << 20)
      rows.append(measure(Path(tmp) / 'corpus', Path(tmp) / 'tokens', args))
  uptime['end'] = _uptime()
  result = {**common.run_info('benchmarks.prepare_rate', argv), 'tokenizer': args.tokenizer,
            'rows': rows, 'uptime': uptime, 'estimate': estimate(rows[-1])}
  common.emit(result, common.markdown_table(rows, list(rows[0])) + '\n\n' +
              common.markdown_table([result['estimate']], list(result['estimate'])),
              args.json)
  return result


if __name__ == '__main__':
  main()
