"""Takeover `requeue`: every sample of the stream trained once, in order, read back from what the
executor handed the data source, across told failures, a stop and a `--resume`, to the end
of a sample budget; the stopped and resumed run ends bit-exact with an uninterrupted one."""
import numpy as np

from mecefo_jax.fault.executor import Executor
from mecefo_jax.records.job import STOPPED
from mecefo_jax.run import cli
from procs import TINY, report, requeued_ids


def _record_ids(monkeypatch) -> dict[int, list[int]]:
  """step -> the sample ids the executor made tokens of (a step run again: its last run's)."""
  seen, run, tokens = {}, Executor.run, Executor._tokens

  def run_recorded(self, plan):
    self.recorded_step = plan.step
    seen[plan.step] = []
    return run(self, plan)

  def tokens_recorded(self, ids_SxB, works):
    seen[self.recorded_step] += [int(i) for w in works for r in (*w.exact, *w.degraded)
                                 for i in ids_SxB[r.owner, r.start:r.stop]]
    return tokens(self, ids_SxB, works)

  monkeypatch.setattr(Executor, 'run', run_recorded)
  monkeypatch.setattr(Executor, '_tokens', tokens_recorded)
  return seen


def test_requeue_trains_each_sample_once_across_failures_a_stop_and_a_resume(tmp_path,
                                                                                monkeypatch):
  monkeypatch.setenv('XLA_FLAGS', '')  # a resume re-simulates the run's devices there
  monkeypatch.chdir(tmp_path)
  seen = _record_ids(monkeypatch)
  (tmp_path / 'trace.txt').write_text('2 1 fail\n4 3 fail\n6 1 repair\n9 3 repair\n')
  common = [f'snapshot.dir={tmp_path}/shm', 'train.compile_cache=']
  first = ['--out', 'run', *TINY, 'mesh.slice=4', '--host-devices', '4', '--takeover', 'requeue',
           '--failures', 'trace:trace.txt', 'train.steps=12', 'train.samples=192',
           'train.eval_every=0',
           'train.log_every=1', '--stop-after', '5', *common]
  assert cli.main(first) == STOPPED
  assert cli.main(['--out', 'run', '--resume', *common]) == 0
  resumed_ids = dict(seen)
  whole = [a for a in first if a not in ('--stop-after', '5')]
  assert cli.main([*whole[:1], 'whole', *whole[2:]]) == 0  # --out whole, never stopped
  assert seen == resumed_ids  # the same ids in every step
  seen = resumed_ids
  # train.samples=192 (12 fault-free steps of 4 slices x B = 4): the 36 rows the failures kept
  # out are trained in 3 steps after train.steps, the last one past the budget (204 samples).
  live = [4, 4, 3, 3, 2, 2, 3, 3, 3, 4, 4, 4, 4, 4, 4]
  assert sorted(seen) == list(range(15))
  assert [len(seen[step]) for step in range(15)] == [4 * n for n in live]  # B = 4 rows a slice
  trained = np.concatenate([seen[step] for step in range(15)])
  assert trained.tolist() == list(range(204))  # each id once, in order, none skipped
  result = report(tmp_path / 'run')
  assert result['samples'] == {'exact': 204, 'degraded': 0, 'dropped': 0}
  assert result['steps'] == 15 and result['evals'][-1]['step'] == 14  # the final eval: after 14
  # metrics.jsonl's record of it: each step's first_sample and tokens give the same ids
  assert requeued_ids(tmp_path / 'run', seq_len=16) == trained.tolist()
  uninterrupted = report(tmp_path / 'whole')
  assert uninterrupted['params_sha256'] == result['params_sha256']
  assert uninterrupted['samples'] == result['samples'] and uninterrupted['steps'] == 15
