"""Real-data corpora (token files, text, Hugging Face datasets) chosen by a spec string."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from mecefo_jax.config import check_text
from mecefo_jax.data.order import EVAL_BASE, check_int, check_sample_ids
from mecefo_jax.data.synthetic import SyntheticCorpus

BYTE_VOCAB = 256
DOC_SEP_BYTE = 0  # joins documents: NUL never occurs in text, so it marks a boundary unambiguously
TEXT_SUFFIXES = ('.txt', '.md')
# A text file may be many GB (it is memory-mapped): its first MiB tells a binary file.
TEXT_PROBE_BYTES = 1 << 20
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
_EOS_NAMES = ('<|endoftext|>', '</s>', '<eos>', '[SEP]')  # tokenizer's document separator, if any


class DataError(ValueError):
  """A data source cannot be used; the message is one line naming the spec/path and the problem."""


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
    starts_N = self.window_starts(sample_ids)
    # A strided view gathers whole rows (one contiguous copy each) without touching the rest.
    windows = np.lib.stride_tricks.sliding_window_view(self.tokens_1d, self.seq_len + 1)
    return np.asarray(windows[starts_N], dtype=np.int32)

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

  'synthetic' | 'text:PATH[?tokenizer=DIR]' | 'pydoc[?tokenizer=DIR]' |
  'tokens:PATH[?dtype=uint16]' | 'hf:NAME[?column=text&split=train&config=C&tokenizer=DIR]';
  every non-synthetic scheme also takes eval_fraction=F (overrides the argument).
  """
  scheme, path, opts = parse_spec(spec)
  if scheme == 'synthetic':
    return SyntheticCorpus(vocab_size=vocab_size, seq_len=seq_len, seed=seed)
  if 'eval_fraction' in opts:
    eval_fraction = _float_opt(spec, opts, 'eval_fraction')
  if scheme == 'tokens':
    tokens_1d = _read_tokens(spec, path, opts.get('dtype', 'uint16'))
    data_vocab = token_range(tokens_1d, spec)[1] + 1
    if data_vocab > vocab_size:
      raise DataError(f'{spec}: max token id {data_vocab - 1} >= model vocab_size {vocab_size}')
  else:
    docs = (_text_docs(spec, path) if scheme == 'text' else _pydoc_docs() if scheme == 'pydoc'
            else _hf_docs(spec, path, opts))
    tokens_1d, data_vocab = _tokenize(spec, docs, opts.get('tokenizer'), vocab_size)
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


def _read_tokens(spec: str, path: str, dtype_name: str) -> np.ndarray:
  """Memory-mapped 1-D token ids from a .npy file or a raw binary file of `dtype_name`."""
  p = Path(path).expanduser()
  if not p.is_file():
    raise DataError(f'{spec}: {"not a file" if p.exists() else "file not found"}: {p}')
  if p.stat().st_size == 0:
    raise DataError(f'{spec}: file is empty: {p}')
  if p.suffix == '.npy':
    try:
      tokens = np.load(p, mmap_mode='r', allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
      raise DataError(f'{spec}: cannot read .npy file {p}: {_first_line(e)}') from None
  else:
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


def _text_docs(spec: str, path: str) -> list[bytes] | np.ndarray:
  """A file's bytes (memory-mapped) or a folder's .txt/.md files, recursively in sorted order."""
  p = Path(path).expanduser()
  if not p.exists():
    raise DataError(f'{spec}: path not found: {p}')
  if p.is_file():
    if p.stat().st_size == 0:
      raise DataError(f'{spec}: file is empty: {p}')
    text = np.memmap(p, dtype=np.uint8, mode='r')  # one document: no copy, any size
    head = text[:TEXT_PROBE_BYTES].tobytes()
    check_text(head, p, f'{spec}: file', final=len(head) == len(text), error=DataError)
    return text
  files = sorted((f for f in p.rglob('*') if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES),
                 key=lambda f: f.relative_to(p).as_posix())  # platform-independent order
  if not files:
    raise DataError(f'{spec}: folder has no {"/".join(TEXT_SUFFIXES)} files: {p}')
  docs = [f.read_bytes() for f in files]
  for f, doc in zip(files, docs):
    check_text(doc, f, f'{spec}: file', error=DataError)
  if not any(docs):
    raise DataError(f'{spec}: all {len(files)} {"/".join(TEXT_SUFFIXES)} files are empty in {p}')
  return [d for d in docs if d]


def _pydoc_docs() -> list[bytes]:
  """The reference topics `help()` shows (pydoc_data.topics, ~0.5 MB of English and code): real
  text on every machine with CPython, no download. Sorted by topic name so the stream does not
  depend on dict order; its content follows the Python version."""
  from pydoc_data.topics import topics
  return [topics[k].encode('utf-8') for k in sorted(topics) if topics[k]]


def _hf_docs(spec: str, name: str, opts: dict[str, str]) -> list[bytes]:
  """UTF-8 texts of one column of a Hugging Face dataset (saved to disk, or cached/reachable)."""
  try:
    import datasets
  except ImportError:
    raise DataError(f'{spec}: hf: sources need the Hugging Face datasets package; run '
                    f'`pip install datasets`') from None
  split, column = opts.get('split', 'train'), opts.get('column', 'text')
  try:
    if Path(name).expanduser().exists():
      ds = datasets.load_from_disk(str(Path(name).expanduser()))
    else:
      ds = datasets.load_dataset(name, opts.get('config'), split=split)
  except Exception as e:  # noqa: BLE001 -- datasets raises many types; all mean "cannot load"
    raise DataError(f'{spec}: cannot load dataset {name!r}: {type(e).__name__}: '
                    f'{_first_line(e)}') from None
  if isinstance(ds, datasets.DatasetDict):
    if split not in ds:
      raise DataError(f'{spec}: dataset has no split {split!r}; splits: {sorted(ds)}')
    ds = ds[split]
  if column not in ds.column_names:
    raise DataError(f'{spec}: dataset has no column {column!r}; columns: {ds.column_names}')
  if getattr(ds.features[column], 'dtype', None) not in ('string', 'large_string'):
    raise DataError(f'{spec}: column {column!r} is {ds.features[column]}, not text')
  docs = [t.encode('utf-8') for t in ds[column] if t]
  if not docs:
    raise DataError(f'{spec}: column {column!r} has no non-empty text ({len(ds)} rows)')
  return docs


def _tokenize(spec: str, docs, tokenizer: str | None, vocab_size: int) -> tuple[np.ndarray, int]:
  """(1-D token ids, data vocab): UTF-8 bytes by default, else a local tokenizer.json."""
  if tokenizer is not None:
    return _tokenize_hf(spec, docs, tokenizer, vocab_size)
  if vocab_size < BYTE_VOCAB:
    raise DataError(f'{spec}: byte-level tokens need model vocab_size >= {BYTE_VOCAB}, got '
                    f'{vocab_size}')
  if isinstance(docs, np.ndarray):
    return docs, BYTE_VOCAB
  return np.frombuffer(bytes([DOC_SEP_BYTE]).join(docs), dtype=np.uint8), BYTE_VOCAB


def _tokenize_hf(spec: str, docs, tokenizer: str, vocab_size: int) -> tuple[np.ndarray, int]:
  try:
    from tokenizers import Tokenizer
  except ImportError:
    raise DataError(f'{spec}: tokenizer= needs the tokenizers package; run `pip install '
                    f'tokenizers` (or drop tokenizer= for byte-level tokens)') from None
  p = Path(tokenizer).expanduser()
  file = p / 'tokenizer.json' if p.is_dir() else p
  if not file.is_file():
    raise DataError(f'{spec}: tokenizer file not found: {file}')
  try:
    tok = Tokenizer.from_file(str(file))
  except Exception as e:  # noqa: BLE001 -- the Rust side raises a bare Exception
    raise DataError(f'{spec}: cannot read tokenizer {file}: {_first_line(e)}') from None
  tok_vocab = tok.get_vocab_size(with_added_tokens=True)
  if tok_vocab > vocab_size:
    raise DataError(f'{spec}: tokenizer {file} has {tok_vocab} ids, more than model vocab_size '
                    f'{vocab_size}')
  if isinstance(docs, np.ndarray):
    docs = [docs.tobytes()]
  sep = next((i for i in map(tok.token_to_id, _EOS_NAMES) if i is not None), None)
  sep_ids = [sep] if sep is not None else tok.encode('\n\n', add_special_tokens=False).ids
  ids: list[int] = []
  for k, enc in enumerate(tok.encode_batch([d.decode('utf-8', 'replace') for d in docs],
                                           add_special_tokens=False)):
    ids.extend(sep_ids if k else [])
    ids.extend(enc.ids)
  if not ids:
    raise DataError(f'{spec}: tokenizer produced no tokens')
  return np.asarray(ids, dtype=np.int32), tok_vocab


def _first_line(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return lines[0] if lines else type(e).__name__
