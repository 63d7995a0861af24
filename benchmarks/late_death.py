"""A death seen late, its survivors' exits at once: which host the supervisor restarts for.

Run: python -m benchmarks.late_death [--victim 0] [--late-s 30] [--ignore-words] [--json OUT]
A 3-process job of tiny on this machine's CPU, under the local supervisor, whose look at the
victim's process shows its exit --late-s seconds after the first of its survivors' exits (as a
transport to another machine sees a dead host late: Ray's health checks take up to half a
minute). The victim is SIGKILLed once
every process has trained step 20; its survivors exit at once, on their own (gloo's exit 7,
or the coordination service's abort when process 0 holds it). The job must restart on the
survivors, for the victim. --ignore-words applies the rule before the last words were read
(an abort alone counts as the death after 5 s).
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import argparse
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import common
from mecefo_jax import job_rules, launch, supervisor
from mecefo_jax.records import history
from mecefo_jax.records.history import Kind
from mecefo_jax.records.progress_marks import mark_path, read_mark

_CAP_S = 120.0  # the victim's exit shows this long after it at the latest


class _Late:
  """A process whose exit shows `late_s` after the first of the others' exits (`first()`: when
  the supervisor saw it, None before), or _CAP_S after its own where none comes."""

  def __init__(self, proc, late_s: float, first):
    self.proc, self.late_s, self.first, self.ended = proc, late_s, first, None

  def poll(self):
    code = self.proc.poll()
    if code is None:
      return None
    now, first = time.monotonic(), self.first()
    self.ended = self.ended or now
    shown = now - self.ended >= _CAP_S or first is not None and now - first >= self.late_s
    return code if shown else None

  def __getattr__(self, name):
    return getattr(self.proc, name)


def _kill_at_step(sup, victim: int, step: int, killed: dict) -> None:
  """SIGKILLs the victim once every process's progress mark has reached `step`."""
  marks = sup.args.log_dir / 'marks'
  while True:
    time.sleep(0.5)
    seen = [read_mark(mark_path(marks, h)) for h in sup.hosts]
    if all(m is not None and m.step >= step for m in seen):
      break
  killed['at_s'] = time.monotonic() - sup.t0
  os.kill(sup.procs[victim].proc.pid, signal.SIGKILL)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--victim', type=int, default=0)
  p.add_argument('--late-s', type=float, default=30.0)
  p.add_argument('--ignore-words', action='store_true')
  p.add_argument('--json', default=None)
  a = p.parse_args(argv)
  if a.ignore_words:
    job_rules.PEER_WORDS = ()  # read at each look: the old rule
  out = Path(tempfile.mkdtemp(prefix='late-death-')) / 'run'
  args = launch.parse_args(['-n', '3', '--devices-per-process', '1', '--', '--out', str(out),
                            'mesh.slice=3', 'train.steps=40', 'snapshot.every=1',
                            'train.log_every=1', 'train.eval_every=0', 'train.plot=false'])

  class Late(supervisor.Supervisor):
    first_other = None  # when the first exit of another process was seen

    def spawn(self, pid, host, n, port):
      proc = super().spawn(pid, host, n, port)
      late = host == a.victim and self.restarts == 0
      return _Late(proc, a.late_s, lambda: self.first_other) if late else proc

    def _watch(self):
      if self.first_other is None and any(
          p.poll() is not None for h, p in self.procs.items() if h != a.victim):
        self.first_other = time.monotonic()
      return super()._watch()

  sup, killed = Late(args), {}
  threading.Thread(target=_kill_at_step, args=(sup, a.victim, 20, killed), daemon=True).start()
  try:
    code = sup.run()
  finally:
    sup.stop_all()
  lines = [line for line in history.read(out) if line.kind.value.startswith('launch')]
  deaths = [line.host for line in lines if line.kind is Kind.LAUNCH_DEATH]
  said = {h: next((line[:200] for line in (args.log_dir / f'host{h}.log').read_text().splitlines()
                   if 'Terminating process' in line or line.startswith('error:')), None)
          for h in range(3) if h != a.victim}  # how each survivor ended
  result = {**common.run_info(__spec__.name, argv), 'victim': a.victim, 'late_s': a.late_s,
            'ignore_words': a.ignore_words, 'killed_at_s': killed.get('at_s'), 'exit': code,
            'deaths': deaths, 'restarted_for_victim': deaths[:1] == [a.victim],
            'survivors_said': said, 'run': str(out)}
  common.emit(result, common.markdown_table([result], ['victim', 'late_s', 'ignore_words',
                                                       'deaths', 'restarted_for_victim']), a.json)
  return result


if __name__ == '__main__':
  main()
