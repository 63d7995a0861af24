"""benchmarks/suite_processes.py: what it books each process under, and the CPU its samples
missed (read back from what parents alive at the end reaped)."""
from benchmarks import suite_processes as sp

SERVE = "python -c import sys; sys.path.insert(0, 'tests'); import forkserver; forkserver.serve(5)"


def _entry(pid, ppid, cmd, cpu_s=1.0, reaped_s=0.0, alive=9, first=False):
  return {'pid': pid, 'ppid': ppid, 'cmd': cmd, 'cpu_s': cpu_s, 'reaped_s': reaped_s,
          'alive': alive, 'first': first}


def test_each_process_is_booked_by_its_command_and_for_a_fork_by_its_parents():
  entries = [_entry(1, 0, 'python -u -c import sys;exec(eval(sys.stdin.readline()))'),
             _entry(2, 1, SERVE), _entry(3, 2, SERVE), _entry(4, 3, SERVE),
             _entry(5, 1, 'python -m mecefo_jax.launch -n 2 -- x'),
             _entry(6, 5, 'python -m mecefo_jax.launch -n 2 -- x'),
             _entry(7, 1, '/venv/bin/python /venv/lib/ray/_private/workers/default_worker.py'),
             _entry(8, 1, 'python train.py --out x'), _entry(9, 1, 'python -m pip install x'),
             _entry(10, 1, ''), _entry(11, 1, 'tee -a log'), _entry(12, 1, 'ray::Host.start')]
  by_pid = {e['pid']: e for e in entries}
  assert [sp.kind(e, by_pid) for e in entries] == [
      'pytest-xdist worker (in-process tests)', 'fork server (tests/forkserver.py)',
      "forked by a fork server (a test's process)",
      "forked by a fork server's child (a supervisor's worker)",
      'new interpreter: -m mecefo_jax.launch', 'forked by -m mecefo_jax.launch (its workers)',
      'Ray (its daemons and workers)', 'new interpreter: train.py', 'pip',
      'kernel threads and processes gone before their first sample', 'tee',
      'Ray (its daemons and workers)']


def test_what_a_live_parent_reaped_beyond_what_was_seen_is_the_missed_tail():
  # Parent 1 (alive at the last sample, 9) reaped child 2 (seen for 1.0 s, its own child 3
  # seen for 0.5 s) and child 4, never seen: 3.0 s reaped in all, so 1.5 s missed.
  entries = [_entry(1, 0, 'a', reaped_s=3.0), _entry(2, 1, 'b', alive=5, reaped_s=0.7),
             _entry(3, 2, 'c', cpu_s=0.5, alive=4)]
  assert sp.tails_s(entries, last_round=9) == 1.5
  # A process that ran before the sampling began counts from its CPU then, not as a child.
  entries.append(_entry(5, 1, 'd', cpu_s=0.2, alive=3, first=True))
  assert sp.tails_s(entries, last_round=9) == 1.5
  kinds = sp.summary(entries, last_round=9)
  assert kinds[sp.TAILS] == {'cpu_s': 1.5, 'processes': 0} and sum(
      k['processes'] for k in kinds.values()) == 4


def test_the_largest_processes_are_listed_with_their_parents_command():
  entries = [_entry(1, 0, 'python train.py --out x', cpu_s=2.0), _entry(2, 1, 'tee', cpu_s=0.4),
             _entry(3, 1, 'python -m benchmarks.mfu', cpu_s=5.0)]
  assert sp.largest(entries) == [
      {'cpu_s': 5.0, 'kind': 'new interpreter: -m benchmarks.mfu',
       'cmd': 'python -m benchmarks.mfu', 'parent': 'python train.py --out x'},
      {'cpu_s': 2.0, 'kind': 'new interpreter: train.py', 'cmd': 'python train.py --out x',
       'parent': ''}]
