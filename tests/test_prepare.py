"""Corpus preparation: a text folder -> a token directory -> training; resume; vocab; rows read."""
import dataclasses
import json
import os
import resource
import shlex
import signal
import sys

import numpy as np
import pytest

from mecefo_jax import files
from mecefo_jax.data import prepare as prep
from mecefo_jax.data import tokendir
from mecefo_jax.data.documents import PIECE_BYTES, DataError, text_documents
from mecefo_jax.data.sources import load_corpus, read_rows, token_range
from mecefo_jax.data.tokenizer import ByteTokenizer, Cursor, token_chunks, token_dtype
from mecefo_jax.records import job
from mecefo_jax.run import cli
from procs import ROOT, TINY, error_lines, kill, report, wait_for

CHUNK = 256 << 10  # small chunks: many commits, cursors inside the big file


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """A folder of help() texts: small files, an empty one, one over two pieces long, a non-text
  suffix that is skipped."""
  from pydoc_data.topics import topics
  root = tmp_path_factory.mktemp('corpus')
  texts = [topics[k] for k in sorted(topics) if topics[k]]
  (root / 'sub').mkdir()
  for i, text in enumerate(texts[:40]):
    (root / ('sub' if i % 2 else '.') / f'{i:03d}.txt').write_text(text)
  (root / 'empty.md').write_text('')
  big = '\n'.join(texts)
  (root / 'zbig.md').write_text(big * (2 * PIECE_BYTES // len(big.encode()) + 1))
  (root / 'skip.json').write_text('{}')
  return root


def _prepare(corpus, out, **kw):
  return prep.prepare([str(corpus)], out, chunk_bytes=CHUNK, **kw)


def test_a_prepared_folder_is_the_stream_text_reads_and_meta_describes_it(corpus, tmp_path):
  meta, wrote = _prepare(corpus, tmp_path / 'tok')
  tokens = np.fromfile(tmp_path / 'tok' / tokendir.TOKENS, np.uint8)
  same = load_corpus(f'text:{corpus}', seq_len=16, seed=0, vocab_size=256).tokens_1d
  np.testing.assert_array_equal(tokens, same)  # one tokenization for train.py and prepare
  assert wrote and (meta.vocab_size, meta.dtype, meta.tokenizer) == (256, 'uint8', 'bytes')
  assert meta.doc_count == 41 and meta.token_count == len(tokens)
  assert (meta.token_min, meta.token_max) == token_range(tokens, 'x') == (0, tokens.max())
  assert meta.text_bytes == sum(f.stat().st_size for f in corpus.rglob('*.*') if f.suffix
                                   in ('.txt', '.md'))
  assert not (tmp_path / 'tok' / tokendir.PROGRESS).exists()
  # A finished directory is not rewritten; another corpus there is refused.
  stamp = (tmp_path / 'tok' / tokendir.TOKENS).stat().st_mtime_ns
  assert _prepare(corpus, tmp_path / 'tok') == (meta, False)
  with pytest.raises(DataError, match=r'holds a token stream of other sources .*--force'):
    prep.prepare(['pydoc'], tmp_path / 'tok')
  assert (tmp_path / 'tok' / tokendir.TOKENS).stat().st_mtime_ns == stamp
  assert prep.prepare(['pydoc'], tmp_path / 'tok', force=True)[0].doc_count > 50


def _interrupt_after(monkeypatch, chunks: int) -> None:
  """Ctrl-C once `chunks` chunks are committed (the next one is being tokenized)."""
  def stopping(*args, **kwargs):
    for k, chunk in enumerate(token_chunks(*args, **kwargs)):
      if k == chunks:
        raise KeyboardInterrupt
      yield chunk
  monkeypatch.setattr(prep, 'token_chunks', stopping)


def test_an_interrupted_prepare_resumes_to_the_same_bytes(corpus, tmp_path, monkeypatch,
                                                           capsys):
  whole, _ = _prepare(corpus, tmp_path / 'whole')
  out = tmp_path / 'resumed'
  cursors = [c for _, c in token_chunks(text_documents('t', [corpus]), ByteTokenizer(),
                                        chunk_bytes=CHUNK)]
  inside = next(k for k, c in enumerate(cursors) if c.offset > 0)  # in the middle of zbig.md
  for chunks in (1, inside + 1):  # the second stop: committed up to the middle of a document
    with monkeypatch.context() as m:
      _interrupt_after(m, chunks)
      with pytest.raises(KeyboardInterrupt):
        _prepare(corpus, out)
  progress = json.loads((out / tokendir.PROGRESS).read_text())
  assert progress['cursor']['offset'] > 0 and not (out / tokendir.META).exists()
  with monkeypatch.context() as m:  # the command's Ctrl-C: exit 130, how to go on
    _interrupt_after(m, 0)
    assert prep.main([str(corpus), '--out', str(out), '--chunk-mb', '1']) == job.INTERRUPTED
  assert f'interrupted; what was committed in {out} stays: run the same command again' in \
      capsys.readouterr().err
  with open(out / tokendir.TOKENS, 'ab') as f:  # a chunk written but never committed
    f.write(b'\xffuncommitted')
  meta, wrote = _prepare(corpus, out)
  assert wrote and (out / tokendir.TOKENS).read_bytes() == (
      tmp_path / 'whole' / tokendir.TOKENS).read_bytes()
  assert dataclasses.replace(meta, command='') == dataclasses.replace(whole, command='')


def test_a_resume_refuses_a_changed_source_and_train_py_an_unfinished_directory(corpus, tmp_path,
                                                                                monkeypatch):
  _interrupt_after(monkeypatch, 1)
  with pytest.raises(KeyboardInterrupt):
    _prepare(corpus, tmp_path / 'tok')
  with pytest.raises(DataError, match=r'holds an unfinished token stream of other .*--force'):
    prep.prepare(['pydoc'], tmp_path / 'tok')
  with pytest.raises(DataError, match=rf'is not finished \([\d,]+ tokens so far\); finish it with '
                                      rf'`python -m mecefo_jax.data.prepare {corpus} --out'):
    load_corpus(f'tokens:{tmp_path / "tok"}', seq_len=16, seed=0, vocab_size=256)
  lock = prep._lock(tmp_path / 'tok')  # as another prepare holds it while it writes
  with pytest.raises(DataError, match='another prepare is writing it'):
    _prepare(corpus, tmp_path / 'tok')
  os.close(lock)
  (tmp_path / 'other').mkdir()
  (tmp_path / 'other' / 'notes.txt').write_text('mine')
  with pytest.raises(DataError, match=r'holds other files \(notes.txt\)'):
    prep.prepare(['pydoc'], tmp_path / 'other', force=True)


def test_prepare_sources_and_their_errors(corpus, tmp_path, capsys):
  one = sorted(corpus.glob('*.txt'))[0]
  meta, _ = prep.prepare([str(one), f'text:{corpus / "sub"}'], tmp_path / 'two')
  assert meta.doc_count == 1 + len(list((corpus / 'sub').glob('*.txt')))
  for sources, match in [(['pydoc', str(one)], 'a pydoc or hf: source comes alone'),
                         (['hf:x?split=a&tokenizer=t'], r"takes no \['tokenizer'\] here"),
                         ([str(tmp_path / 'nope')], 'path not found')]:
    with pytest.raises(DataError, match=match):
      prep.prepare(sources, tmp_path / 'bad')
  assert prep.main([str(tmp_path / 'nope'), '--out', str(tmp_path / 'bad')]) == job.BAD_INPUT
  assert error_lines(capsys.readouterr().err) == [
      f'error: {tmp_path / "nope"}: path not found: {tmp_path / "nope"}']


def test_prepare_refusals_name_the_change_leave_nothing_and_usage_is_one_line(tmp_path,
                                                                             capsys):
  text = tmp_path / 'a.txt'
  text.write_text('hello world\n')
  prep.prepare([str(text)], tmp_path / 'tok')
  text.write_text('hello world, and more\n')
  with pytest.raises(DataError) as err:
    prep.prepare([str(text)], tmp_path / 'tok')
  assert "(changed: sources.bytes 12 -> 22, sources.listing_sha256 (the files' names or sizes); " \
         f'made by `python -m mecefo_jax.data.prepare {text} --out {tmp_path / "tok"}`)' in \
         str(err.value)
  blob = tmp_path / 'blob.txt'
  blob.write_bytes(bytes(range(256)))
  with pytest.raises(DataError, match='is not UTF-8 text'):
    prep.prepare([str(blob)], tmp_path / 'new' / 'tok')
  assert not (tmp_path / 'new').exists()  # neither the directory nor its parent stays
  (tmp_path / 'empty').mkdir()
  with pytest.raises(DataError, match='is not UTF-8 text'):
    prep.prepare([str(blob)], tmp_path / 'empty')
  assert list((tmp_path / 'empty').iterdir()) == []  # a directory given stays, empty
  for argv, needle in (([], 'the following arguments are required: SOURCE, --out'),
                       (['x', '--out', 'y', '--chunk-mb', 'z'], "argument --chunk-mb: invalid")):
    with pytest.raises(SystemExit) as stop:
      prep.main(argv)
    assert stop.value.code == job.BAD_INPUT
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f'error: {needle}') and line.endswith(
        '(see python -m mecefo_jax.data.prepare --help)'), line


def test_the_docs_state_the_limits_the_code_has():
  from mecefo_jax.data import sources
  page = ' '.join((ROOT / 'docs' / 'data.md').read_text().split())  # the manual's data page
  errors = (ROOT / 'docs' / 'errors.md').read_text()
  limit = f'{sources.IN_MEMORY_TEXT_BYTES >> 20} MiB of text'
  assert f'above {limit} they are refused' in page and f'more than {limit}' in errors
  assert f'chunk ({prep.CHUNK_MB} MiB of text, `--chunk-mb`)' in page


def test_token_dtype_follows_the_vocabulary():
  assert [token_dtype(v).name for v in (2, 256, 257, 65_536, 65_537, 150_000)] == [
      'uint8', 'uint8', 'uint16', 'uint16', 'uint32', 'uint32']


def test_token_chunks_from_any_cursor_continue_the_stream(corpus):
  documents, tok = text_documents('t', [corpus]), ByteTokenizer()
  chunks = list(token_chunks(documents, tok, chunk_bytes=CHUNK))
  whole = np.concatenate([ids for ids, _ in chunks])
  for k in (1, len(chunks) // 2, len(chunks) - 2):
    rest = [ids for ids, _ in token_chunks(documents, tok, chunks[k][1], chunk_bytes=CHUNK)]
    head = np.concatenate([ids for ids, _ in chunks[:k + 1]])
    np.testing.assert_array_equal(np.concatenate([head, *rest]), whole)
  assert chunks[-1][1].bytes_in == documents.total_bytes and chunks[-1][1].docs == 41
  assert Cursor() == Cursor(0, 0, 0, 0)


def test_train_py_reads_a_prepared_directory_on_fake_devices(corpus, tmp_path, capsys):
  _prepare(corpus, tmp_path / 'tok')
  args = ['--data', f'tokens:{tmp_path / "tok"}', '--out', str(tmp_path / 'run'), *TINY,
          'mesh.slice=2', 'train.steps=3', 'train.eval_every=0',
          '--no-snapshots', 'train.compile_cache=']
  assert cli.main(args) == 0
  result = report(tmp_path / 'run')
  assert result['steps'] == 3 and np.isfinite(result['final_loss'])
  # The vocabulary is checked against the model from meta.json: one line, exit 2.
  assert cli.main([*args, '--fresh', 'model.vocab_size=128']) == job.BAD_INPUT
  assert error_lines(capsys.readouterr().err) == [
      f'error: tokens:{tmp_path / "tok"}: prepared with a vocabulary of 256 ids (tokenizer '
      f'bytes), more than model.vocab_size=128; set model.vocab_size=256']


def _faults() -> int:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_minflt + usage.ru_majflt


def test_opening_a_token_directory_reads_none_of_the_stream(corpus, tmp_path):
  """A 512 MiB stream (sparse: no disk) behind a real meta.json: opening it and reading a batch
  touches a few pages, where a scan of its ids would touch them all."""
  meta, _ = prep.prepare(['pydoc'], tmp_path / 'tok')
  n = 512 << 20
  with open(tmp_path / 'tok' / tokendir.TOKENS, 'r+b') as f:
    f.truncate(n)
  files.write_json(tmp_path / 'tok' / tokendir.META, dataclasses.replace(meta, token_count=n),
                   indent=1)
  before = _faults()
  corpus = load_corpus(f'tokens:{tmp_path / "tok"}', seq_len=256, seed=0, vocab_size=256)
  rows = corpus.sequences(np.arange(64))
  opened = _faults() - before
  token_range(corpus.tokens_1d, 'scan')
  scanned = _faults() - before - opened
  assert rows.shape == (64, 257) and len(corpus.tokens_1d) == n
  assert opened * 10 < scanned, (opened, scanned)


class Recorder:
  """A token stream that records which [start, stop) ranges are read from it."""

  def __init__(self, tokens_1d):
    self.tokens_1d, self.read = tokens_1d, []
    self.ndim, self.dtype = tokens_1d.ndim, tokens_1d.dtype

  def __len__(self):
    return len(self.tokens_1d)

  def __getitem__(self, key):
    assert isinstance(key, slice), key  # only slices: no fancy gather over the stream
    self.read.append((key.start, key.stop))
    return self.tokens_1d[key]


def test_each_process_reads_only_the_windows_of_its_rows():
  stream = Recorder(np.arange(100_000, dtype=np.uint32))
  starts = np.array([5, 99_000, 70, 5])
  rows = read_rows(stream, starts, 17)
  np.testing.assert_array_equal(rows, starts[:, None] + np.arange(17))
  assert stream.read == [(s, s + 17) for s in starts] and rows.dtype == np.int32
  # Through a corpus: the rows of one process's ids, and nothing else.
  from mecefo_jax.data.order import sample_ids
  from mecefo_jax.data.sources import TokenArrayCorpus
  stream.read.clear()
  corpus = TokenArrayCorpus(stream, seq_len=16, seed=0, vocab_size=100_000)
  mine = sample_ids(step=3, n_slices=8, micro_batch=4)[2:4].reshape(-1)  # slices 2 and 3
  corpus.sequences(mine)
  assert stream.read == [(s, s + 17) for s in corpus.window_starts(mine)]


def _readme_commands() -> list[list[str]]:
  """The commands of the README's "Your own data" block, as argv lists."""
  text = (ROOT / 'README.md').read_text()
  block = text[text.index('## Your own data'):]
  block = block[block.index('```bash\n') + 8:block.index('```\n', block.index('```bash'))]
  return [shlex.split(line) for line in block.splitlines() if line and not line.startswith('#')]


def test_the_readme_commands_with_a_kill_and_a_rerun_of_prepare(launcher, corpus, tmp_path):
  """The README's commands as written, from a folder `corpus/` in the current directory:
  prepare (SIGKILLed after a committed chunk, then run again: the uninterrupted bytes), then
  train.py on 8 fake devices (shortened)."""
  prepare_cmd, train_cmd = _readme_commands()
  assert prepare_cmd[:3] == ['python', '-m', 'mecefo_jax.data.prepare'] and train_cmd[:2] == [
      'python', 'train.py']
  (tmp_path / 'corpus').mkdir()
  text = (corpus / 'zbig.md').read_bytes()
  for i in range(100):  # ~60 MB: many 1 MiB chunks, a kill lands between two
    (tmp_path / 'corpus' / f'{i:03d}.txt').write_bytes(text)
  env = launcher.env(PYTHONPATH=str(ROOT))
  run = dict(cwd=tmp_path, env=env)
  proc = launcher.start([sys.executable, *prepare_cmd[1:], '--chunk-mb', '1'], **run)
  progress = tmp_path / 'data' / 'corpus' / tokendir.PROGRESS
  wait_for(lambda: progress.exists() and json.loads(progress.read_text())['tokens'], 60,
           'a committed chunk', proc)
  kill(proc)
  assert proc.returncode == -signal.SIGKILL
  assert not (tmp_path / 'data' / 'corpus' / tokendir.META).exists()
  finished = launcher.python(*prepare_cmd[1:], **run)
  assert finished.returncode == 0 and 'train on it: mecefo-train --data tokens:' in \
      finished.stdout, finished.stderr
  prep.prepare([str(tmp_path / 'corpus')], tmp_path / 'whole')
  assert (tmp_path / 'data' / 'corpus' / tokendir.TOKENS).read_bytes() == (
      tmp_path / 'whole' / tokendir.TOKENS).read_bytes()
  trained = launcher.python(ROOT / 'train.py', *train_cmd[2:], *TINY, 'train.steps=5',
                            '--no-snapshots', **run)
  out = tmp_path / train_cmd[train_cmd.index('--out') + 1]
  assert trained.returncode == 0 and report(out)['steps'] == 5, trained.stderr[-2000:]
  assert 'token stream tokens:data/corpus: ' in trained.stderr


def test_a_tokenizer_stream_is_uint16_and_resumes_exactly(corpus, tmp_path, monkeypatch):
  import tokenizers  # a test requirement (requirements.txt): a tokenizer trained here, offline
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token='<unk>'))
  byte_level = tokenizers.pre_tokenizers.ByteLevel
  tok.pre_tokenizer = byte_level()
  trainer = tokenizers.trainers.BpeTrainer(vocab_size=600, initial_alphabet=byte_level.alphabet(),
                                           special_tokens=['<unk>', '<|endoftext|>'])
  tok.train_from_iterator((f.read_text() for f in sorted(corpus.rglob('*.txt'))), trainer)
  tok.save(str(tmp_path / 'tokenizer.json'))
  whole, _ = _prepare(corpus, tmp_path / 'whole', tokenizer=str(tmp_path))
  assert whole.dtype == 'uint16' and whole.vocab_size == tok.get_vocab_size() == 600
  assert whole.tokenizer.startswith('sha256:') and whole.separator_ids == [1]
  with monkeypatch.context() as m:
    _interrupt_after(m, 2)
    with pytest.raises(KeyboardInterrupt):
      _prepare(corpus, tmp_path / 'tok', tokenizer=str(tmp_path))
  assert json.loads((tmp_path / 'tok' / tokendir.PROGRESS).read_text())['cursor']['offset'] > 0
  assert _prepare(corpus, tmp_path / 'tok', tokenizer=str(tmp_path / 'tokenizer.json'))[1]
  assert (tmp_path / 'tok' / tokendir.TOKENS).read_bytes() == (
      tmp_path / 'whole' / tokendir.TOKENS).read_bytes()


def test_hf_is_read_as_a_stream_and_resumed_by_skipping_rows(tmp_path, monkeypatch,
                                                             hf_datasets):
  rows = [{'text': f'row {i} ' * 50, 'n': i} for i in range(400)] + [{'text': None, 'n': -1}]
  hf_datasets.HUB.update({'org/corpus': {'train': rows[:400]}, 'org/other': {'train': rows[399:]}})
  whole, _ = prep.prepare(['hf:org/corpus?split=train'], tmp_path / 'whole', chunk_bytes=1 << 12)
  assert hf_datasets.LOADS[0] == (('org/corpus', None), {'split': 'train', 'streaming': True})
  _interrupt_after(monkeypatch, 2)
  with pytest.raises(KeyboardInterrupt):
    prep.prepare(['hf:org/corpus?split=train'], tmp_path / 'tok', chunk_bytes=1 << 12)
  monkeypatch.setattr(prep, 'token_chunks', token_chunks)
  prep.prepare(['hf:org/corpus?split=train'], tmp_path / 'tok', chunk_bytes=1 << 12)
  expected = b'\0'.join(r['text'].encode() for r in rows[:400])
  assert (tmp_path / 'tok' / tokendir.TOKENS).read_bytes() == expected
  assert whole.doc_count == 400
  with pytest.raises(DataError, match=r"row 1 of column 'text' is NoneType, not text"):
    prep.prepare(['hf:org/other'], tmp_path / 'bad')


def test_text_over_the_in_memory_limit_is_refused_with_the_prepare_command(
    corpus, tmp_path, monkeypatch, hf_datasets):
  from mecefo_jax.data import sources
  monkeypatch.setattr(sources, 'IN_MEMORY_TEXT_BYTES', 1 << 18)
  with pytest.raises(DataError, match=rf'^text:{corpus}: more than 0.25 MiB of text, tokenized in '
                                      rf'every process at every start; prepare it once with '
                                      rf'`python -m mecefo_jax.data.prepare {corpus} --out DIR` '
                                      rf'and train with --data tokens:DIR$'):
    load_corpus(f'text:{corpus}', seq_len=16, seed=0, vocab_size=256)
  # A byte-level file is mapped, not read: no limit.
  assert len(load_corpus(f'text:{corpus / "zbig.md"}', seq_len=16, seed=0,
                         vocab_size=256).tokens_1d) > 1 << 18
  # A dataset's size is found out while reading it (its rows are never loaded all at once).
  hf_datasets.HUB['org/x'] = {'train': [{'body': 'x' * 1000}] * 500}
  with pytest.raises(DataError, match=r"prepare it once with `python -m mecefo_jax.data.prepare "
                                      r"'hf:org/x\?column=body' --out DIR`"):
    load_corpus('hf:org/x?column=body&eval_fraction=0.1', seq_len=16, seed=0, vocab_size=256)


def test_the_prepare_rate_benchmark(launcher, tmp_path):
  result = launcher.benchmark('prepare_rate', '--mb', '1,3', json_path=tmp_path / 'rate.json')
  small, large = result['rows']
  assert (small['text_mib'], large['text_mib'], large['dtype']) == (1, 3, 'uint8')
  assert large['tokens'] > 3 << 20 and large['peak_rss_mb'] > 10 and large['seconds'] > 0
  assert large['text_mib_per_s'] == pytest.approx(3 / large['seconds'], rel=0.05)
  estimate = result['estimate']
  assert estimate['hours'] == pytest.approx(100e9 / 2**20 / large['text_mib_per_s'] / 3600,
                                            rel=0.01)
  assert result['uptime']['start'] and 'load average' in result['uptime']['end']
