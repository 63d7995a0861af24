"""Corpus preparation: text MB/s, tokens/s and peak memory of mecefo_jax.data.prepare, and what a
100 GB corpus costs at the measured rate.

Run: python -m benchmarks.prepare_rate [--mb 64,512] [--tokenizer PATH | --bpe VOCAB] [--json OUT]

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
# Runs argv[1:] and prints its peak resident KiB and CPU seconds (its children's rusage, in a
# process that has no other child).
_PEAK = ('import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, '
         'stdout=subprocess.DEVNULL); u = resource.getrusage(resource.RUSAGE_CHILDREN); '
         'print(u.ru_maxrss, u.ru_utime + u.ru_stime)')


def _args(argv):
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument('--mb', default='64,512', help='corpus sizes in MiB, comma-separated')
  how = p.add_mutually_exclusive_group()
  how.add_argument('--tokenizer', default=None, help='a tokenizer.json (default: bytes)')
  how.add_argument('--bpe', type=int, default=None, metavar='VOCAB',
                   help='a byte-level BPE of VOCAB ids trained here on the same help() topics '
                        '(needs the tokenizers package)')
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


def train_bpe(path: Path, vocab_size: int) -> str:
  """A byte-level BPE (GPT-2's pre-tokenizer) of `vocab_size` ids trained on the help() topics,
  saved as tokenizer.json at `path`; `<|endoftext|>` separates documents."""
  from pydoc_data.topics import topics
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.train_from_iterator([topics[k] for k in sorted(topics)], trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=['<|endoftext|>'], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(path))
  return str(path)


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
  peak_kib, cpu_s = proc.stdout.split()[-2:]
  return {'text_mib': round(meta['text_bytes'] / 2**20, 1), 'tokens': meta['token_count'],
          'dtype': meta['dtype'], 'seconds': round(seconds, 2),
          'text_mib_per_s': round(meta['text_bytes'] / 2**20 / seconds, 1),
          'tokens_per_s': round(meta['token_count'] / seconds), 'cpu_s': round(float(cpu_s), 2),
          'text_mib_per_cpu_s': round(meta['text_bytes'] / 2**20 / float(cpu_s), 1),
          'peak_rss_mb': round(int(peak_kib) / 1024, 1),  # Linux: KiB
          'open_and_batch_s': _open_and_read(out, meta['vocab_size'])}


def _open_and_read(out: Path, vocab_size: int) -> float:
  """Seconds to open the directory as train.py does and read a 64 x 257 batch of windows."""
  from mecefo_jax.data.sources import load_corpus
  t0 = time.perf_counter()
  corpus = load_corpus(f'tokens:{out}', seq_len=256, seed=0, vocab_size=vocab_size)
  corpus.sequences(np.arange(64))
  return round(time.perf_counter() - t0, 4)


def estimate(row: dict) -> dict:
  """What CORPUS_GB of the same text costs at `row`'s rate (time linear, memory flat): hours of
  wall time at this machine's load, and CPU hours (what one free core would take)."""
  text = CORPUS_GB * 10**9
  return {'corpus_gb': CORPUS_GB,
          'hours': round(text / (row['text_mib_per_s'] * 2**20) / 3600, 2),
          'cpu_hours': round(text / (row['text_mib_per_cpu_s'] * 2**20) / 3600, 2),
          'peak_rss_mb': row['peak_rss_mb'],
          'tokens_bin_gb': round(text * row['tokens'] / (row['text_mib'] * 2**20) *
                                 np.dtype(row['dtype']).itemsize / 10**9, 1)}


def _version(package: str) -> str | None:
  from importlib import metadata
  try:
    return metadata.version(package)
  except metadata.PackageNotFoundError:
    return None


def _uptime() -> str:
  return subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()


def main(argv=None) -> dict:
  args = _args(argv)
  rows, uptime = [], {'start': _uptime()}
  bpe_dir = tempfile.TemporaryDirectory(prefix='mecefo-bpe-')
  if args.bpe:
    args.tokenizer = train_bpe(Path(bpe_dir.name) / 'tokenizer.json', args.bpe)
  for mb in (int(s) for s in args.mb.split(',')):
    with tempfile.TemporaryDirectory(prefix='mecefo-prepare-') as tmp:
      write_corpus(Path(tmp) / 'corpus', mb << 20)
      rows.append(measure(Path(tmp) / 'corpus', Path(tmp) / 'tokens', args))
  uptime['end'] = _uptime()
  bpe_dir.cleanup()
  result = {**common.run_info('benchmarks.prepare_rate', argv),
            'tokenizer': f'bpe:{args.bpe}' if args.bpe else args.tokenizer,
            'tokenizers_version': _version('tokenizers') if args.tokenizer else None,
            'rows': rows, 'uptime': uptime, 'estimate': estimate(rows[-1])}
  common.emit(result, common.markdown_table(rows, list(rows[0])) + '\n\n' +
              common.markdown_table([result['estimate']], list(result['estimate'])),
              args.json)
  return result


if __name__ == '__main__':
  main()
