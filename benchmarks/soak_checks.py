"""The soak's checks once its job has stopped: the records against what was injected, against
each other and against a one-process replay; what is left behind; what grew (benchmarks/soak.py)."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from benchmarks.soak_faults import ALSO, EXPECTED, FAULT_KINDS, TAKE_A_HOST, Injected
from mecefo_jax import files
from mecefo_jax.records import history
from mecefo_jax.records.history import HISTORY, HistoryLine, Kind
from mecefo_jax.records.job import process_state
from mecefo_jax.run.saving import AGREED_STOP
from mecefo_jax.snapshot.capacity import held_bytes

REPLAY_LINE = re.compile(r'# replay: `python -m mecefo_jax ([^`]*)`')


def _explains(fault: Injected, line: HistoryLine) -> bool:
  """Whether `fault` accounts for history `line` (a stop: the one it asks for)."""
  kind = line.kind
  if kind is Kind.STOP:  # the one the fault asks for, or the grow-back of a host it took out
    why = line.why or ''
    # Process 0's record of a stop another process's watch asked for first: AGREED_STOP.
    return (fault.kind == 'stop_supervisor' and ('supervisor' in why or why == AGREED_STOP) or
            fault.kind in ('ctrl_c', 'end') and 'SIGINT' in why or
            fault.kind in TAKE_A_HOST and 'grow-back' in why)
  return kind in EXPECTED.get(fault.kind, ()) or kind in ALSO.get(fault.kind, set())


def attribute(lines: list[HistoryLine], faults: list[Injected]) -> list[str]:
  """Disagreements between history.jsonl and the soak's log (`faults` in order, the soak's final
  Ctrl-C last as kind 'end'): a fault whose records are missing, a record no fault explains."""
  out = []
  bounds = [f.t for f in faults[1:]] + [float('inf')]
  for fault, until in zip(faults, bounds):
    seen = [line for line in lines if fault.t <= line.t < until]
    wanted = () if fault.kind == 'full_tmpfs' and fault.note else EXPECTED.get(fault.kind, ())
    for kind in wanted:
      if not any(line.kind is kind and (kind is not Kind.STOP or _explains(fault, line))
                 for line in seen):
        out.append(f'{fault.kind} at {fault.t:.1f} (step {fault.step}): no {kind.value} in '
                   'history')
  for line in lines:
    if line.kind not in FAULT_KINDS:
      continue
    owner = next((f for f, until in zip(faults, bounds) if f.t <= line.t < until), None)
    if line.kind is Kind.SNAPSHOT_SKIPPED:  # recorded as later saves wait: the last fill's
      owner = next((f for f in reversed(faults) if f.kind == 'full_tmpfs' and f.t <= line.t),
                   owner)
    if owner is None or not _explains(owner, line):
      last = owner.kind if owner else 'none'
      out.append(f'history {line.kind.value} at {line.t:.1f} ({_fields(line)}): no injected '
                 f"fault explains it (the soak's last before it: {last})")
  return out


def programs_per_restart(lines: list[HistoryLine]) -> list[dict]:
  """How each restart after a failure got its first step's programs (the `recovered` lines:
  {'cause', 'compiled', 'loaded', 'moved'})."""
  return [{'cause': r.cause, **{how: r.programs_built.get(how, 0)
                                for how in ('compiled', 'loaded', 'moved')}}
          for r in (line.recovered for line in lines if line.kind is Kind.RECOVERED) if r]


def _fields(line: HistoryLine) -> str:
  shown = (('step', line.step), ('host', line.host), ('why', line.why), ('code', line.code))
  return ', '.join(f'{k}={v}' for k, v in shown if v is not None)


def records(run: Path, exit_code: int) -> list[str]:
  """Disagreements between the run's own records: report.json's samples and metrics.jsonl's
  rows, steps_lost_total and the thrown_away lines, failures.txt and the report's failure
  events, run_state.json's status and the job's exit."""
  report = json.loads((run / 'report.json').read_text())
  lines = history.read(run)
  seq_len = report['config']['model']['seq_len']
  rows = {}
  for line in (run / 'metrics.jsonl').read_text().splitlines():
    row = json.loads(line)
    if row.get('kind') == 'train' and row['step'] < report['steps']:
      rows[row['step']] = row  # a step trained again: its last row
  out = []
  from_rows = round(sum(r['exact_tokens'] + r['degraded_tokens'] for r in rows.values()) / seq_len)
  s = report['samples']
  if from_rows != s['exact'] + s['degraded'] or len(rows) != report['steps']:
    out.append(f"report samples {s} against {from_rows} from {len(rows)} metrics rows "
               f"(report steps {report['steps']})")
  lost = sum(line.to_step - line.from_step for line in lines if line.kind is Kind.THROWN_AWAY)
  if lost != report['steps_lost_total']:
    out.append(f"steps_lost_total {report['steps_lost_total']} against {lost} thrown away")
  events = [x for x in (run / 'failures.txt').read_text().splitlines()
            if x.strip() and not x.startswith('#')]
  if len(events) != len(report['failure_events']):
    out.append(f"failures.txt has {len(events)} events, the report "
               f"{len(report['failure_events'])}")
  status = json.loads((run / 'run_state.json').read_text())['status']
  if status != {0: 'finished', 143: 'stopped'}.get(exit_code, status + '?'):
    out.append(f'run_state status {status!r} against the exit {exit_code}')
  return out


def replay(run: Path, cwd: Path, env: dict, timeout: float = 1800) -> dict:
  """failures.txt's replay command as printed, stopped after the step the run stopped at
  (--stop-after: the learning-rate schedule stays the run's, of its endless train.steps):
  whether its params and samples equal the run's."""
  line = (run / 'failures.txt').read_text().splitlines()[0]
  steps = json.loads((run / 'report.json').read_text())['steps']
  # --no-snapshots: a stopped replay would keep its in-memory snapshots in /dev/shm.
  args = [*shlex.split(REPLAY_LINE.fullmatch(line).group(1)), '--stop-after', str(steps),
          '--no-snapshots']
  done = subprocess.run([sys.executable, '-m', 'mecefo_jax', *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=timeout)
  if done.returncode not in (0, 143):  # 143: stopped after --stop-after
    return {'sha_equal': False, 'error': done.stderr[-2000:]}
  ours = json.loads((run / 'report.json').read_text())
  theirs = json.loads((run / 'replay' / 'report.json').read_text())
  return {'sha_equal': ours['params_sha256'] == theirs['params_sha256'],
          'samples_equal': ours['samples'] == theirs['samples'],
          'params_sha256': ours['params_sha256'], 'replay_params_sha256': theirs['params_sha256']}


def leftovers(pids: set[int], marker: str, shm: Path, hosts: int) -> list[str]:
  """Processes of the job still alive (any pid it started, or a command line naming `marker`),
  and tmpfs parts of no host of the job or left by a save that never finished."""
  out = [f'process {p} alive' for p in sorted(pids) if alive(p)]
  for proc in Path('/proc').glob('[0-9]*'):
    try:
      cmd = (proc / 'cmdline').read_bytes().replace(b'\0', b' ').decode(errors='replace')
    except OSError:
      continue
    if marker in cmd and int(proc.name) != os.getpid() and int(proc.name) not in pids:
      out.append(f'process {proc.name} alive: {cmd[:120]}')
  parts = [p for p in shm.rglob('host*') if p.is_dir()]  # (on Ray: under each node's directory)
  out += [f'tmpfs part {p} of no host of the job' for p in parts
          if int(p.name.removeprefix('host')) >= hosts]
  out += [f'unfinished save {p}' for p in shm.rglob('*.orbax-checkpoint-tmp*')]
  return out


def ray_leftovers(cluster, raylets: list) -> list[str]:
  """After the cluster's shutdown: an actor's mark left in a node's TMPDIR, a Ray process of
  the cluster (`raylets`: ray's node process records, taken before) still running."""
  out = [f'actor mark {p} left' for d in cluster.tmps.values() if d.exists() for p in d.iterdir()]
  return out + [f'Ray process {p.process.pid} alive' for p in raylets if p.process.poll() is None]


def alive(pid: int) -> bool:
  """Whether process `pid` runs (a zombie runs nothing)."""
  return process_state(pid) not in (None, 'Z')


def growth(pids: list[int], shm: Path, store: Path, run: Path) -> dict:
  """What the job holds now: RSS and open fds of its processes, tmpfs and program-store bytes,
  history lines."""
  rss = fds = 0
  for pid in pids:
    try:
      status = Path(f'/proc/{pid}/status').read_text()
      rss += int(re.search(r'VmRSS:\s+(\d+)', status).group(1)) * 1024
      fds += len(os.listdir(f'/proc/{pid}/fd'))
    except (OSError, AttributeError):
      continue
  return {'rss_bytes': rss, 'open_fds': fds, 'shm_bytes': held_bytes(shm),
          'program_store_bytes': held_bytes(store),
          'history_lines': len((files.read_text(run / HISTORY) or '').splitlines())}
