"""Data sources: windows by (seed, id), disjoint splits, every spec scheme and its errors."""
import sys

import numpy as np
import pytest

from mecefo_jax.data.order import global_batch
from mecefo_jax.data.sources import DataError, TokenArrayCorpus, load_corpus, parse_spec
from mecefo_jax.data.tokenizer import DOC_SEP_BYTE
from mecefo_jax.data.synthetic import SyntheticCorpus

L = 16  # seq_len for most tests


def _corpus(n=20_000, seed=0, **kw):
  return TokenArrayCorpus(np.arange(n, dtype=np.int64), seq_len=L, seed=seed, **kw)


def _load(spec, vocab_size=256, **kw):
  return load_corpus(spec, seq_len=L, seed=0, vocab_size=vocab_size, **kw)


# --- TokenArrayCorpus -----------------------------------------------------------------------

def test_rows_are_contiguous_windows_of_the_stream():
  c = _corpus()
  rows_NxL1 = c.sequences(np.arange(64))
  assert rows_NxL1.shape == (64, L + 1) and rows_NxL1.dtype == np.int32
  starts_N = c.window_starts(np.arange(64))
  np.testing.assert_array_equal(rows_NxL1, starts_N[:, None] + np.arange(L + 1))


def test_same_seed_and_ids_give_identical_rows_across_instances_and_order():
  ids = np.array([5, 3, 1 << 40, 7])
  a = _corpus().sequences(ids)
  b = _corpus().sequences(ids[::-1])[::-1]  # order and batch make no difference
  np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(a[1], _corpus().sequences(np.array([3], np.uint64))[0])
  assert not np.array_equal(a, _corpus(seed=1).sequences(ids))


def test_resume_continues_exactly():
  # Ids are global: step 7's batch is the same whether or not steps 0..6 ran in this process.
  warm = _corpus()
  for step in range(7):
    global_batch(warm, step, 2, 4)
  np.testing.assert_array_equal(global_batch(warm, 7, 2, 4), global_batch(_corpus(), 7, 2, 4))


def test_train_and_eval_windows_are_disjoint():
  c = _corpus(eval_fraction=0.05)
  assert c.train_end == 19_000
  train_NxL1 = np.concatenate([global_batch(c, s, 4, 64).reshape(-1, L + 1) for s in range(8)])
  eval_NxL1 = np.concatenate([global_batch(c, s, 4, 64, 'eval').reshape(-1, L + 1)
                              for s in range(8)])
  assert train_NxL1.max() < c.train_end <= eval_NxL1.min()
  assert eval_NxL1.max() == pytest.approx(19_999, abs=50)  # the eval region is used to its end


def test_forced_split_and_missing_eval_region():
  ids = np.arange(32)
  assert _corpus(split='eval').sequences(ids).min() >= 19_800
  assert _corpus(split='train').sequences(ids + (1 << 62)).max() < 19_800
  with pytest.raises(DataError, match='eval_fraction=0'):
    global_batch(_corpus(eval_fraction=0.0), 0, 1, 2, 'eval')
  assert global_batch(_corpus(eval_fraction=0.0), 0, 1, 2).shape == (1, 2, L + 1)


def test_window_starts_spread_over_the_region():
  c = TokenArrayCorpus(np.zeros(1_017, np.uint16), seq_len=L, seed=3, eval_fraction=0.0,
                       vocab_size=2)
  starts_N = c.window_starts(np.arange(50_000))
  counts = np.bincount(starts_N, minlength=1_001)
  assert starts_N.min() >= 0 and starts_N.max() == 1_000  # every start in [0, n - L - 1]
  assert counts.min() > 20 and counts.max() < 80  # ~50 each: no visible bias


def test_vocab_defaults_to_max_plus_one_and_short_stream_errors():
  assert _corpus(n=100, eval_fraction=0.0).vocab_size == 100
  assert _corpus(vocab_size=40_000).vocab_size == 40_000
  with pytest.raises(DataError, match=r'16 tokens.*need >= 17'):
    _corpus(n=16, eval_fraction=0.0)
  with pytest.raises(DataError, match=r'30 tokens.*need >= 34'):
    _corpus(n=30)
  with pytest.raises(DataError, match='1-D integer'):
    TokenArrayCorpus(np.zeros((10, 10), np.int32), seq_len=L)
  with pytest.raises(ValueError, match='sample_ids'):
    _corpus().sequences(np.array([-1]))


# --- load_corpus: synthetic, tokens ---------------------------------------------------------

def test_synthetic_spec():
  c = load_corpus('synthetic', seq_len=L, seed=2, vocab_size=64)
  assert isinstance(c, SyntheticCorpus) and (c.vocab_size, c.seq_len, c.seed) == (64, L, 2)


def test_tokens_npy_and_bin_are_memory_mapped(tmp_path):
  ids_1d = (np.arange(5_000) * 7 % 1000).astype(np.uint16)
  np.save(tmp_path / 't.npy', ids_1d)
  ids_1d.astype(np.uint32).tofile(tmp_path / 't.bin')
  a = _load(f'tokens:{tmp_path / "t.npy"}', vocab_size=1000)
  b = _load(f'tokens:{tmp_path / "t.bin"}?dtype=uint32', vocab_size=1000)
  assert isinstance(a.tokens_1d, np.memmap) and isinstance(b.tokens_1d, np.memmap)
  assert a.vocab_size == b.vocab_size == 1000 and a.entropy_floor() is None
  np.testing.assert_array_equal(a.sequences(np.arange(32)), b.sequences(np.arange(32)))
  assert 'tokens:' in a.describe() and '5,000 tokens' in a.describe()
  # No default width: uint16 would read this uint32 file as twice as many ids.
  with pytest.raises(DataError, match=r'raw token file needs \?dtype=.*mecefo_jax.data.prepare'):
    _load(f'tokens:{tmp_path / "t.bin"}', vocab_size=1000)


@pytest.mark.parametrize('make, spec_suffix, match', [
    (lambda p: np.arange(5_000, dtype=np.uint16).tofile(p), '?dtype=uint16', r'max token id '
     r'4999 >= model vocab_size 256'),
    (lambda p: np.full(100, -1, np.int32).tofile(p), '?dtype=int32', r'must be >= 0, found -1'),
    (lambda p: np.arange(10, dtype=np.uint16).tofile(p), '?dtype=uint16', r'10 tokens.*need >= 34'),
    (lambda p: p.write_bytes(b'abc'), '?dtype=uint16', r'3 bytes is not a multiple of uint16'),
    (lambda p: p.write_bytes(b'abcd'), '?dtype=float32', r'unreadable dtype'),
    (lambda p: p.write_bytes(b'abcd'), '?dtype=nonsense', r'unreadable dtype'),
    (lambda p: p.write_bytes(b''), '', r'file is empty'),
    (lambda p: None, '', r'file not found'),
])
def test_tokens_errors(tmp_path, make, spec_suffix, match):
  make(tmp_path / 'x.bin')
  with pytest.raises(DataError, match=match) as e:
    _load(f'tokens:{tmp_path / "x.bin"}{spec_suffix}')
  assert '\n' not in str(e.value) and str(tmp_path) in str(e.value)


def test_tokens_npy_errors(tmp_path):
  np.save(tmp_path / 'f.npy', np.zeros(100, np.float32))
  np.save(tmp_path / 'm.npy', np.zeros((10, 10), np.int32))
  (tmp_path / 'bad.npy').write_bytes(b'not numpy')
  for name, match in [('f', 'unreadable dtype float32'), ('m', r'1-D.*\(10, 10\)'),
                      ('bad', 'cannot read .npy')]:
    with pytest.raises(DataError, match=match):
      _load(f'tokens:{tmp_path / name}.npy')


# --- load_corpus: text ----------------------------------------------------------------------

def test_text_file_is_utf8_bytes(tmp_path):
  text = 'héllo wörld, ' * 40
  (tmp_path / 'a.txt').write_text(text, encoding='utf-8')
  c = _load(f'text:{tmp_path / "a.txt"}', eval_fraction=0.0)
  assert c.vocab_size == 256
  np.testing.assert_array_equal(c.tokens_1d, np.frombuffer(text.encode(), np.uint8))
  row = c.sequences(np.array([0]))[0]
  assert bytes(row.astype(np.uint8)) in text.encode()


def test_text_folder_sorted_recursive_joined(tmp_path):
  (tmp_path / 'sub').mkdir()
  (tmp_path / 'b.md').write_text('B' * 30)
  (tmp_path / 'a.txt').write_text('A' * 30)
  (tmp_path / 'sub' / 'c.txt').write_text('C' * 30)
  (tmp_path / 'empty.txt').write_text('')
  (tmp_path / 'skip.json').write_text('{"x": 1}')
  c = _load(f'text:{tmp_path}?eval_fraction=0')
  sep = bytes([DOC_SEP_BYTE])
  assert c.tokens_1d.tobytes() == sep.join([b'A' * 30, b'B' * 30, b'C' * 30])
  assert c.regions['eval'] is None


@pytest.mark.parametrize('setup, vocab, match', [
    (lambda p: (p / 'a.txt').write_text('x' * 100), 255, r'byte-level.*vocab_size >= 256, got 255'),
    (lambda p: (p / 'a.txt').write_text(''), 256, r'all 1 .txt/.md files are empty'),
    (lambda p: (p / 'a.csv').write_text('x' * 100), 256, r'no .txt/.md files'),
    (lambda p: None, 256, r'no .txt/.md files'),
    (lambda p: (p / 'a.txt').write_text('x' * 20), 256, r'20 tokens.*need >= 34'),
])
def test_text_folder_errors(tmp_path, setup, vocab, match):
  setup(tmp_path)
  with pytest.raises(DataError, match=match):
    _load(f'text:{tmp_path}', vocab_size=vocab)


def test_text_missing_and_empty_file(tmp_path):
  with pytest.raises(DataError, match='path not found'):
    _load(f'text:{tmp_path / "nope.txt"}')
  (tmp_path / 'e.txt').write_bytes(b'')
  with pytest.raises(DataError, match='file is empty'):
    _load(f'text:{tmp_path / "e.txt"}')


def test_binary_text_files_are_refused_in_one_line(tmp_path):
  cases = {'blob.bin': bytes(range(256)), 'latin1.txt': 'café'.encode('latin-1'),
           'ids.bin': np.arange(1, 100, dtype=np.uint16).tobytes()}  # ASCII, but NULs
  for (name, data), at in zip(cases.items(), (0, 3, 1)):
    (tmp_path / name).write_bytes(data * 64)
    with pytest.raises(DataError, match=rf"^text:\S+: file '\S+{name}' is not UTF-8 text "
                                        rf'\(byte {at}\); is it a binary file\?$'):
      _load(f'text:{tmp_path / name}')
  (tmp_path / 'docs').mkdir()
  (tmp_path / 'docs' / 'a.txt').write_text('fine ' * 20)
  (tmp_path / 'docs' / 'b.txt').write_bytes(bytes(range(256)))
  with pytest.raises(DataError, match=r"file '\S+b\.txt' is not UTF-8 text \(byte 0\)"):
    _load(f'text:{tmp_path / "docs"}')
  # A large file is probed at its start, whose end may cut a character: still text.
  (tmp_path / 'big.txt').write_bytes(b'a' + 'é'.encode() * (1 << 19))
  assert _load(f'text:{tmp_path / "big.txt"}').tokens_1d.size == 1 + (1 << 20)


# --- load_corpus: pydoc ---------------------------------------------------------------------

def test_pydoc_is_the_sorted_help_topics_as_bytes():
  from pydoc_data.topics import topics
  c = _load('pydoc?eval_fraction=0.05')
  expected = bytes([DOC_SEP_BYTE]).join(topics[k].encode() for k in sorted(topics) if topics[k])
  assert c.vocab_size == 256 and c.tokens_1d.tobytes() == expected
  assert len(expected) > 300_000  # real text, enough for the frontier study's eval region
  assert c.regions['eval'][0] == c.train_end == len(expected) - int(np.ceil(0.05 * len(expected)))
  assert _load('pydoc').train_end > c.train_end  # eval_fraction: the argument's default


def test_pydoc_spec_forms_and_errors():
  assert parse_spec('pydoc') == ('pydoc', '', {})
  assert parse_spec('pydoc?eval_fraction=0.1') == ('pydoc', '', {'eval_fraction': '0.1'})
  assert parse_spec('pydoc:?tokenizer=/t') == ('pydoc', '', {'tokenizer': '/t'})
  for spec, match in [('pydoc:some/path', 'pydoc source takes no path'),
                      ('pydoc?dtype=uint16', r"unknown option\(s\) \['dtype'\]"),
                      ('synthetic?eval_fraction=0.1', 'takes no path or options')]:
    with pytest.raises(DataError, match=match):
      _load(spec)
  with pytest.raises(DataError, match=r"'pydoc'"):  # listed among the forms
    _load('pdoc')


# --- spec parsing ---------------------------------------------------------------------------

def test_spec_parsing_and_errors():
  assert parse_spec('tokens:/d/x.bin?dtype=uint32') == ('tokens', '/d/x.bin', {'dtype': 'uint32'})
  assert parse_spec('text:/d/what?.txt') == ('text', '/d/what?.txt', {})  # '?' without k=v
  assert parse_spec('text:a?tokenizer=/t/x+y%20') == ('text', 'a', {'tokenizer': '/t/x+y%20'})
  assert parse_spec('hf:org/name?column=body&split=test') == (
      'hf', 'org/name', {'column': 'body', 'split': 'test'})
  for spec, match in [('s3:bucket/x', "unknown data source scheme 's3'"), ('', 'empty data spec'),
                      ('tokens:', 'missing path'), ('text', 'missing path'),
                      ('tokens:x.bin?dtyp=uint16', r"unknown option\(s\) \['dtyp'\]"),
                      ('synthetic:foo', 'takes no path'), ('tokens:x?a=1&b', 'malformed options'),
                      ('tokens:x.bin?eval_fraction=lots', 'eval_fraction must be a number')]:
    with pytest.raises(DataError, match=match):
      _load(spec)


# --- hf: ------------------------------------------------------------------------------------

def test_hf_without_datasets_says_how_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, 'datasets', None)  # makes `import datasets` fail
  with pytest.raises(DataError, match='pip install datasets'):
    _load('hf:some/name')


def test_hf_saved_to_disk(tmp_path, hf_datasets):
  datasets = hf_datasets
  texts = [f'document number {i} ' * 5 for i in range(20)]
  datasets.Dataset.from_dict({'body': texts, 'n': list(range(20))}).save_to_disk(tmp_path / 'ds')
  c = _load(f'hf:{tmp_path / "ds"}?column=body')
  expect = bytes([DOC_SEP_BYTE]).join(t.encode() for t in texts)
  assert c.tokens_1d.tobytes() == expect and c.vocab_size == 256
  again = _load(f'hf:{tmp_path / "ds"}?column=body')
  np.testing.assert_array_equal(c.sequences(np.arange(8)), again.sequences(np.arange(8)))
  with pytest.raises(DataError, match=r"no column 'text'; columns: \['body', 'n'\]"):
    _load(f'hf:{tmp_path / "ds"}')
  with pytest.raises(DataError, match="column 'n' is .*not text"):
    _load(f'hf:{tmp_path / "ds"}?column=n')


def test_hf_dataset_dict_split_and_load_failure(tmp_path, hf_datasets):
  datasets = hf_datasets
  dd = datasets.DatasetDict({s: datasets.Dataset.from_dict({'text': [s * 40] * 3})
                             for s in ('train', 'test')})
  dd.save_to_disk(tmp_path / 'dd')
  c = _load(f'hf:{tmp_path / "dd"}?split=test')
  assert c.tokens_1d[:4].tobytes() == b'test'
  with pytest.raises(DataError, match=r"no split 'dev'; splits: \['test', 'train'\]"):
    _load(f'hf:{tmp_path / "dd"}?split=dev')
  assert not datasets.LOADS  # a path on disk is loaded from there, never from the Hub
  # A name that is not a path goes to the Hub (train.py: from its local cache, not streamed).
  datasets.HUB['org/corpus'] = {'train': [{'text': 'hub text ' * 20}]}
  assert _load('hf:org/corpus').tokens_1d[:8].tobytes() == b'hub text'
  assert datasets.LOADS == [(('org/corpus', None), {'split': 'train', 'streaming': False})]
  with pytest.raises(DataError, match=r"^hf:org/corpus\?split=dev: cannot load dataset "
                                      r"'org/corpus': ValueError: Unknown split \"dev\""):
    _load('hf:org/corpus?split=dev')
  with pytest.raises(DataError, match=r"cannot load dataset 'org/none': ConnectionError: "
                                      r"Couldn't reach 'org/none' on the Hub \(offline\)$"):
    _load('hf:org/none')  # its first line only


# --- optional tokenizer ---------------------------------------------------------------------

def test_tokenizer_missing_package(tmp_path, monkeypatch):
  (tmp_path / 'a.txt').write_text('x' * 100)
  monkeypatch.setitem(sys.modules, 'tokenizers', None)
  with pytest.raises(DataError, match='pip install tokenizers'):
    _load(f'text:{tmp_path / "a.txt"}?tokenizer={tmp_path}')


def test_local_tokenizer_json(tmp_path):
  import tokenizers  # a test requirement (requirements.txt)
  words = ['<unk>', '</s>', 'red', 'green', 'blue']
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)},
                                                         unk_token='<unk>'))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / 'tokenizer.json'))
  (tmp_path / 'docs').mkdir()
  (tmp_path / 'docs' / 'a.txt').write_text('red green ' * 20)
  (tmp_path / 'docs' / 'b.txt').write_text('blue purple ' * 20)
  c = _load(f'text:{tmp_path / "docs"}?tokenizer={tmp_path}&eval_fraction=0', vocab_size=8)
  assert c.vocab_size == 5
  np.testing.assert_array_equal(c.tokens_1d, [2, 3] * 20 + [1] + [4, 0] * 20)  # '</s>' joins docs
  with pytest.raises(DataError, match='5 ids, more than model vocab_size 4'):
    _load(f'text:{tmp_path / "docs"}?tokenizer={tmp_path}', vocab_size=4)
