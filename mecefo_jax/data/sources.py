"""Real-data corpora (token directories and files, text, Hugging Face datasets) by a spec string."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from mecefo_jax.files import check_text
from mecefo_jax.data import tokendir
from mecefo_jax.data.documents import DataError, first_line, open_documents
from mecefo_jax.data.order import EVAL_BASE, check_int, check_sample_ids
from mecefo_jax.data.synthetic import SyntheticCorpus
from mecefo_jax.data.tokenizer import ByteTokenizer, open_tokenizer, token_chunks

# A text file may be many GB (it is memory-mapped): its first MiB tells a binary file.
TEXT_PROBE_BYTES = 1 << 20
# Text tokenized at start-up (every process of a job does it): more is refused, with the
# command that prepares it once into a token directory.
IN_MEMORY_TEXT_BYTES = 256 << 20
_SPLITS = ('auto', 'train', 'eval')
# Query keys each scheme accepts; anything else is a typo and is refused.
_OPTIONS = {
    'synthetic': set(),
    'text': {'tokenizer', 'eval_fraction'},
    'pydoc': {'tokenizer', 'eval_fraction'},
    'tokens': {'dtype', 'eval_fraction'},
    'hf': {'column', 'split', 'config', 'tokenizer', 'eval_fraction'},
}
_PATHLESS = ('synthetic', 'pydoc')  # schemes whose spec is the bare name (pydoc: options too)


def _mix64(x_N: np.ndarray) -> np.ndarray:
  """splitmix64 finaliser on uint64 (wrapping arithmetic): a bijection with good avalanche."""
  x_N = (x_N ^ (x_N >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x_N = (x_N ^ (x_N >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x_N ^ (x_N >> np.uint64(31))


class TokenArrayCorpus:
  """Windows of seq_len + 1 tokens from one long 1-D token stream (an ndarray or a memmap).

  Sample id -> window start is a hash of (seed, id) over the id's split region, so row i of
  `sequences(ids)` is a pure function of (seed, ids[i]): a takeover or a resume reads exactly the
  same windows, with no permutation state. The last `eval_fraction` of the stream (at least one
  window) is the eval region; train windows end before it starts, so the two never overlap.
  split='auto' routes ids >= 2**62 (data.sample_ids(..., 'eval')) to the eval region and smaller
  ids to train; 'train' / 'eval' send every id to that region.
  """

  def __init__(self, tokens_1d: np.ndarray, seq_len: int, seed: int = 0, split: str = 'auto',
               eval_fraction: float = 0.01, vocab_size: int | None = None,
               source: str = 'token array'):
    check_int('seq_len', seq_len, 1)
    check_int('seed', seed, 0)
    if seed >= 1 << 64:
      raise ValueError(f'seed must be < 2**64, got {seed}')
    if split not in _SPLITS:
      raise ValueError(f'split must be one of {_SPLITS}, got {split!r}')
    if not 0.0 <= eval_fraction < 1.0:
      raise DataError(f'{source}: eval_fraction must be in [0, 1), got {eval_fraction}')
    if getattr(tokens_1d, 'ndim', None) != 1 or not np.issubdtype(tokens_1d.dtype, np.integer):
      raise DataError(f'{source}: expected a 1-D integer token array, got '
                      f'{getattr(tokens_1d, "dtype", type(tokens_1d).__name__)} '
                      f'{getattr(tokens_1d, "shape", "")}')
    self.tokens_1d, self.seq_len, self.seed, self.split = tokens_1d, seq_len, seed, split
    self.eval_fraction, self.source = eval_fraction, source
    n, width = len(tokens_1d), seq_len + 1
    n_eval = max(math.ceil(n * eval_fraction), width) if eval_fraction > 0 else 0
    if n < width + (width if n_eval else 0):
      raise DataError(f'{source}: {n} tokens, but seq_len + 1 = {width} are needed per window'
                      f'{" and one window each for train and eval" if n_eval else ""}: need >= '
                      f'{width + (width if n_eval else 0)}')
    self.train_end = n - n_eval
    if self.train_end < width:
      raise DataError(f'{source}: eval_fraction={eval_fraction} leaves {self.train_end} train '
                      f'tokens, fewer than seq_len + 1 = {width}')
    # (first start, number of starts) per split; a window [s, s + width) stays inside its region.
    self.regions = {'train': (0, self.train_end - width + 1),
                    'eval': (self.train_end, n - self.train_end - width + 1) if n_eval else None}
    self.vocab_size = int(vocab_size) if vocab_size is not None else token_range(
        tokens_1d, source)[1] + 1
    if not 0 < self.vocab_size < 1 << 31:
      raise DataError(f'{source}: vocab_size must be in [1, 2**31), got {self.vocab_size}')
    self._key1, self._key2 = _mix64(np.array([seed, seed ^ 0x5EED5EED5EED5EED], np.uint64))

  @property
  def has_eval(self) -> bool:
    """Whether the stream holds an eval region (eval_fraction > 0): else the run has no evals."""
    return self.regions['eval'] is not None

  def window_starts(self, sample_ids: np.ndarray) -> np.ndarray:
    """int64 [N]: start offset of each id's window in tokens_1d."""
    ids = check_sample_ids(sample_ids)
    ids_N = ids.astype(np.uint64)
    if self.split == 'auto':
      is_eval_N = ids_N >= np.uint64(EVAL_BASE)
    else:
      is_eval_N = np.full(len(ids_N), self.split == 'eval')
    if is_eval_N.any() and self.regions['eval'] is None:
      raise DataError(f'{self.source}: eval samples requested but eval_fraction=0 (no eval region)')
    ev_lo, ev_n = self.regions['eval'] or (0, 1)
    lo_N = np.where(is_eval_N, ev_lo, self.regions['train'][0]).astype(np.uint64)
    count_N = np.where(is_eval_N, ev_n, self.regions['train'][1]).astype(np.uint64)
    hash_N = _mix64(_mix64(ids_N + self._key1) ^ self._key2)  # bijective in id for a fixed seed
    # Modulo bias is <= count / 2**64: negligible for any real stream.
    return (lo_N + hash_N % count_N).astype(np.int64)

  def sequences(self, sample_ids: np.ndarray) -> np.ndarray:
    """int32 [len(ids), seq_len + 1]; row i is a pure function of (seed, sample_ids[i])."""
    return read_rows(self.tokens_1d, self.window_starts(sample_ids), self.seq_len + 1)

  def entropy_floor(self) -> float | None:
    return None  # unknown for real data

  def describe(self) -> str:
    n = len(self.tokens_1d)
    ev = self.regions['eval']
    held = (f'eval region [{self.train_end:,}, {n:,}) ({ev[1]:,} window starts)' if ev
            else 'no eval region')
    return (f'token stream {self.source}: {n:,} tokens ({self.tokens_1d.dtype}), vocab '
            f'{self.vocab_size}, seq_len={self.seq_len}, seed={self.seed}; train windows in '
            f'[0, {self.train_end:,}) ({self.regions["train"][1]:,} starts), {held}; windows '
            f'hashed from (seed, id); entropy floor unknown')


def read_rows(tokens_1d, starts_N: np.ndarray, width: int) -> np.ndarray:
  """int32 [len(starts), width]: the windows [s, s + width) of the stream, each read as one slice:
  of a memory-mapped stream a process reads the pages of its own rows and nothing else."""
  rows = np.empty((len(starts_N), width), np.int32)
  for i, s in enumerate(starts_N.tolist()):
    rows[i] = tokens_1d[s:s + width]
  return rows


def token_range(tokens_1d: np.ndarray, source: str) -> tuple[int, int]:
  """(min, max) token id; refuses negative ids. Streams over a memmap without a full copy."""
  if not len(tokens_1d):
    raise DataError(f'{source}: token stream is empty')
  lo = int(tokens_1d.min()) if np.issubdtype(tokens_1d.dtype, np.signedinteger) else 0
  if lo < 0:
    raise DataError(f'{source}: token ids must be >= 0, found {lo}')
  return lo, int(tokens_1d.max())


def load_corpus(spec: str, *, seq_len: int, seed: int, vocab_size: int,
                eval_fraction: float = 0.01):
  """Corpus for `spec`; its vocab_size <= the model's `vocab_size` (DataError otherwise).

  'synthetic' | 'text:PATH[?tokenizer=DIR]' | 'pydoc[?tokenizer=DIR]' | 'tokens:DIR' (prepared
  by data/prepare.py) | 'tokens:FILE.npy' | 'tokens:FILE?dtype=uint16' |
  'hf:NAME[?column=text&split=train&config=C&tokenizer=DIR]'; every non-synthetic scheme also
  takes eval_fraction=F (overrides the argument).
  """
  scheme, path, opts = parse_spec(spec)
  if scheme == 'synthetic':
    return SyntheticCorpus(vocab_size=vocab_size, seq_len=seq_len, seed=seed)
  if 'eval_fraction' in opts:
    eval_fraction = _float_opt(spec, opts, 'eval_fraction')
  if scheme == 'tokens':
    tokens_1d, data_vocab = _tokens(spec, path, opts, vocab_size)
  else:
    tokens_1d, data_vocab = _tokenize(spec, scheme, path, opts, vocab_size)
  return TokenArrayCorpus(tokens_1d, seq_len, seed, eval_fraction=eval_fraction,
                          vocab_size=data_vocab, source=spec)


def parse_spec(spec: str) -> tuple[str, str, dict[str, str]]:
  """'scheme:PATH?k=v&k=v' -> (scheme, PATH, {k: v}); a '?' starts options only before k=v pairs."""
  if not isinstance(spec, str) or not spec.strip():
    raise DataError(f'empty data spec {spec!r}; use one of {_spec_forms()}')
  scheme, colon, rest = spec.strip().partition(':')
  if '?' in scheme:  # a pathless scheme's options need no colon: 'pydoc?eval_fraction=0.05'
    scheme, q, query = spec.strip().partition('?')
    colon, rest = '', q + query
  if scheme not in _OPTIONS:
    raise DataError(f'{spec}: unknown data source scheme {scheme!r}; use one of {_spec_forms()}')
  path, query = rest, ''
  if '?' in rest and '=' in rest.rpartition('?')[2]:
    path, _, query = rest.rpartition('?')
  if scheme in _PATHLESS and (path or (scheme == 'synthetic' and query)):
    raise DataError(f'{spec}: the {scheme} source takes no path'
                    f'{" or options" if scheme == "synthetic" else ""}')
  if scheme == 'synthetic':
    return scheme, '', {}
  if scheme not in _PATHLESS and (not colon or not path):
    raise DataError(f'{spec}: missing path after {scheme}:')
  # Plain split, no URL decoding: a '+' or '%' in a tokenizer path must survive as written.
  pairs = [kv.partition('=') for kv in query.split('&')] if query else []
  if any(not k or not eq for k, eq, _ in pairs):
    raise DataError(f'{spec}: malformed options {query!r}; expected key=value&key=value')
  opts = {k: v for k, _, v in pairs}
  unknown = sorted(set(opts) - _OPTIONS[scheme])
  if unknown:
    raise DataError(f'{spec}: unknown option(s) {unknown} for {scheme}:; allowed: '
                    f'{sorted(_OPTIONS[scheme])}')
  return scheme, path, opts


def _spec_forms() -> str:
  return "'synthetic', 'text:PATH', 'pydoc', 'tokens:PATH', 'hf:NAME'"


def _float_opt(spec: str, opts: dict[str, str], key: str) -> float:
  try:
    return float(opts[key])
  except ValueError:
    raise DataError(f'{spec}: {key} must be a number, got {opts[key]!r}') from None


def _tokens(spec: str, path: str, opts: dict[str, str], vocab_size: int):
  """(stream, data vocab) of a prepared directory (its meta.json: nothing of the stream is read
  here) or of a token file (scanned once for its largest id: it records no vocabulary)."""
  p = Path(path).expanduser()
  if p.is_dir():
    if 'dtype' in opts:
      raise DataError(f'{spec}: a prepared directory records its dtype in {tokendir.META}; '
                      f'drop ?dtype=')
    tokens_1d, meta = tokendir.open_tokens(spec, p)
    tokendir.check_vocab(spec, meta, vocab_size)
    return tokens_1d, meta.vocab_size
  tokens_1d = _read_tokens(spec, p, opts.get('dtype'))
  data_vocab = token_range(tokens_1d, spec)[1] + 1
  if data_vocab > vocab_size:
    raise DataError(f'{spec}: max token id {data_vocab - 1} >= model vocab_size {vocab_size}')
  return tokens_1d, data_vocab


def _tokenize(spec: str, scheme: str, path: str, opts: dict[str, str], vocab_size: int):
  """(stream, data vocab) of text tokenized here, in memory: a byte-level text file is mapped,
  not read; other text is refused above IN_MEMORY_TEXT_BYTES with the command that prepares it."""
  tok = open_tokenizer(spec, opts.get('tokenizer'))
  if tok.vocab_size > vocab_size:
    raise DataError(f'{spec}: byte-level tokens need model vocab_size >= {tok.vocab_size}, got '
                    f'{vocab_size}' if isinstance(tok, ByteTokenizer) else
                    f'{spec}: tokenizer {tok.file} has {tok.vocab_size} ids, more than model '
                    f'vocab_size {vocab_size}')
  if isinstance(tok, ByteTokenizer) and scheme == 'text' and Path(path).expanduser().is_file():
    return _text_memmap(spec, Path(path).expanduser()), tok.vocab_size
  documents = open_documents(spec, scheme, path, opts)
  return _whole_stream(spec, documents, tok, _prepare_command(scheme, path, opts)), tok.vocab_size


def _whole_stream(spec: str, documents, tok, prepare: str) -> np.ndarray:
  """The documents' tokens, or DataError past IN_MEMORY_TEXT_BYTES of text (a stream of unknown
  size is found out while read)."""
  chunks = []
  if (documents.total_bytes or 0) <= IN_MEMORY_TEXT_BYTES:
    for ids, cursor in token_chunks(documents, tok):
      if cursor.bytes_in > IN_MEMORY_TEXT_BYTES:
        break
      chunks.append(ids)
    else:
      if not chunks:
        raise DataError(f'{spec}: its documents hold no text')
      return np.concatenate(chunks)
  raise DataError(f'{spec}: more than {IN_MEMORY_TEXT_BYTES / 2**20:g} MiB of text, tokenized in '
                  f'every process at every start; prepare it once with `{prepare}` and train '
                  f'with --data tokens:DIR')


def _prepare_command(scheme: str, path: str, opts: dict[str, str]) -> str:
  """The prepare command for the source of a spec (its options but train.py's own)."""
  query = '&'.join(f'{k}={v}' for k, v in opts.items() if k in ('column', 'split', 'config'))
  source = path if scheme == 'text' else f'{scheme}:{path}' if path else scheme
  return tokendir.prepare_command([source + (f'?{query}' if query else '')], Path('DIR'),
                                  opts.get('tokenizer'))


def _text_memmap(spec: str, p: Path) -> np.ndarray:
  """A text file as byte tokens, memory-mapped (any size, no copy); its start is checked."""
  if p.stat().st_size == 0:
    raise DataError(f'{spec}: file is empty: {p}')
  text = np.memmap(p, dtype=np.uint8, mode='r')
  head = text[:TEXT_PROBE_BYTES].tobytes()
  check_text(head, p, f'{spec}: file', DataError, final=len(head) == len(text))
  return text


def _read_tokens(spec: str, p: Path, dtype_name: str | None) -> np.ndarray:
  """Memory-mapped 1-D token ids from a .npy file or a raw binary file of `dtype_name`."""
  if not p.is_file():
    raise DataError(f'{spec}: {"not a file" if p.exists() else "file not found"}: {p}')
  if p.stat().st_size == 0:
    raise DataError(f'{spec}: file is empty: {p}')
  if p.suffix == '.npy':
    try:
      tokens = np.load(p, mmap_mode='r', allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
      raise DataError(f'{spec}: cannot read .npy file {p}: {first_line(e)}') from None
  else:
    if dtype_name is None:  # a guess would read a uint32 file as twice as many uint16 ids
      raise DataError(f'{spec}: a raw token file needs ?dtype= (uint8, uint16, uint32: the width '
                      f'its ids were written with), or prepare a token directory, which records '
                      f'it: python -m mecefo_jax.data.prepare SOURCE --out DIR')
    dtype = _int_dtype(spec, dtype_name)
    size = p.stat().st_size
    if size % dtype.itemsize:
      raise DataError(f'{spec}: file size {size} bytes is not a multiple of {dtype.name} '
                      f'({dtype.itemsize} bytes); wrong dtype?')
    tokens = np.memmap(p, dtype=dtype, mode='r')
  if not np.issubdtype(tokens.dtype, np.integer):
    raise DataError(f'{spec}: unreadable dtype {tokens.dtype}: token ids must be integers')
  if tokens.ndim != 1:
    raise DataError(f'{spec}: expected a 1-D token array, got shape {tokens.shape}')
  return tokens


def _int_dtype(spec: str, name: str) -> np.dtype:
  try:
    dtype = np.dtype(name)
  except TypeError:
    raise DataError(f'{spec}: unreadable dtype {name!r}; use e.g. uint16, uint32, int32') from None
  if not np.issubdtype(dtype, np.integer):
    raise DataError(f'{spec}: unreadable dtype {name!r}: token ids must be an integer dtype')
  return dtype
