"""What process 0 records of a run while it trains: history.jsonl, failures.txt, .reached."""
from __future__ import annotations

from pathlib import Path

from mecefo_jax import files, multihost
from mecefo_jax.records import history
from mecefo_jax.records.history import HISTORY, Kind
from mecefo_jax.run import hints, rundir
from mecefo_jax.run.storage import OutputGuard


class RunRecords:
  """The run files a training process keeps (run/rundir.py lists them); on processes other
  than 0 every method does nothing but steps_lost_total, which all call."""

  def __init__(self, out_dir: Path, enabled: bool, guard: OutputGuard | None = None):
    """`guard`: where a failed write goes (the run stops after its step) instead of raising."""
    self.out_dir, self.enabled = Path(out_dir), enabled
    self.guard = guard or OutputGuard()
    self._events_written = 0
    self._reached: rundir.Reached | None = None

  def start(self, start, events: list[dict], hosts, live) -> None:
    """A start from `start` (run/resume.Start) whose controller holds `events`: history.jsonl
    has the restored ones already; failures.txt is cut back to them."""
    self._events_written = len(start.meta.controller.events) if start.meta else 0
    if not self.enabled:
      return
    # A line that a crash or a full disk cut goes first, so that every line parses.
    self.guard.attempt(self.out_dir / HISTORY, files.cut_torn_lines, self.out_dir / HISTORY)
    if start.steps_lost:
      self.history(Kind.THROWN_AWAY, from_step=start.step, to_step=start.reached)
    self.history(Kind.START, step=start.step, restored=start.where, hosts=sorted(hosts),
                 live=list(live))
    self.events(events, cut_back=True)

  def events(self, events: list[dict], cut_back: bool = False) -> None:
    """failures.txt (the failures of the state held now) and history.jsonl (new events)."""
    if not self.enabled or (len(events) == self._events_written and not cut_back):
      return
    for event in events[self._events_written:]:
      self.history(Kind.FAILURE, event=event)
    self.guard.attempt(self.out_dir / rundir.FAILURES, rundir.write_failures, self.out_dir,
                       events, hints.replay(self.out_dir))
    self._events_written = len(events)

  def open_reached(self) -> None:
    self._reached = rundir.Reached(self.out_dir) if self.enabled else None

  def reached(self, steps: int) -> None:
    """`steps` are trained (the fetch of the last one waited for it)."""
    if self._reached:
      self.guard.attempt(self.out_dir / rundir.REACHED, self._reached.write, steps)

  def close_reached(self) -> None:
    if self._reached:
      self._reached.close()
      self._reached = None

  def history(self, kind: Kind, **fields) -> None:
    """A line of history.jsonl: `kind` and its keys `fields` (records/history.py)."""
    if self.enabled:
      self.guard.attempt(self.out_dir / HISTORY, history.append, self.out_dir, kind, **fields)

  def steps_lost_total(self) -> int:
    """Steps trained again over the run's life (history.jsonl, process 0's; all call it)."""
    return multihost.on_chief(lambda: sum(
        line.to_step - line.from_step for line in history.read(self.out_dir)
        if line.kind is Kind.THROWN_AWAY))
