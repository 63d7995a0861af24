"""Where a command's CPU goes, by process kind: every process of the machine sampled from /proc
while the command runs (`python -m benchmarks.suite_processes --json OUT -- bash .ci/run`).

tests/costs.py counts what each pytest process and the processes it waited for used; processes
nobody waits for (a Ray cluster's workers and the trainers its actors start, whatever a killed
parent left) escape it. This sampler sees every process, whoever its parent, at the price of
missing each one's last interval (0.25 s by default; a line adds what parents alive at the end
reaped beyond what was seen) and of counting the machine's other work. It books each process
under a kind read from its command line and its parents'."""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   'suite_processes')

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from mecefo_jax.records.job import stat_fields  # (standard library only: no jax)

REPO = Path(__file__).resolve().parents[1]

FORK_SERVER = 'forkserver.serve'  # tests/forkserver.py's command line, which its forks keep
TAILS = 'between samples (reaped by parents alive at the end)'


def read_proc(pid: str) -> tuple[int, str, float, float] | None:
  """(parent pid, start time in ticks, CPU seconds, CPU seconds of the children it reaped) of
  process `pid`, or None if it is gone."""
  fields = stat_fields(pid)
  if not fields:
    return None
  ticks = os.sysconf('SC_CLK_TCK')
  own, reaped = (int(fields[i]) + int(fields[i + 1]) for i in (11, 13))
  return int(fields[1]), fields[19], own / ticks, reaped / ticks


def command_line(pid: int | str) -> str:
  try:
    return Path(f'/proc/{pid}/cmdline').read_bytes().replace(b'\0', b' ').decode(
        errors='replace').strip()
  except OSError:
    return ''


class Sampler:
  """Every process's CPU seconds as last seen, keyed by (pid, start time): a pid reused is
  another process. One that ran before the sampling began counts from its CPU then."""

  def __init__(self, interval_s: float):
    self.interval_s, self.seen, self.stop = interval_s, {}, threading.Event()
    self.round = 0  # samples taken; an entry's 'alive': the last one that saw it
    self.thread = threading.Thread(target=self._run, daemon=True)

  def sample(self, first: bool = False) -> None:
    self.round += 1
    for pid in filter(str.isdigit, os.listdir('/proc')):
      read = read_proc(pid)
      if read is None:
        continue
      ppid, start, cpu_s, reaped_s = read
      entry = self.seen.get((pid, start))
      if entry is None:
        self.seen[(pid, start)] = entry = {
            'pid': int(pid), 'ppid': ppid, 'cmd': command_line(pid), 'first': first,
            'base': cpu_s if first else 0.0, 'reaped_base': reaped_s if first else 0.0}
      elif not entry['cmd']:
        entry['cmd'] = command_line(pid)
      entry['cpu_s'], entry['reaped_s'] = cpu_s - entry['base'], reaped_s - entry['reaped_base']
      entry['alive'] = self.round

  def _run(self) -> None:
    while not self.stop.wait(self.interval_s):
      self.sample()

  def __enter__(self) -> Sampler:
    self.sample(first=True)
    self.thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self.stop.set()
    self.thread.join()
    self.sample()


def kind(entry: dict, by_pid: dict[int, dict]) -> str:
  """What a process was, from its command line (and, for a fork, its parents')."""
  cmd = entry['cmd']
  if FORK_SERVER in cmd:
    parent = by_pid.get(entry['ppid'], {})
    if FORK_SERVER not in parent.get('cmd', ''):
      return 'fork server (tests/forkserver.py)'
    grandparent = by_pid.get(parent['ppid'], {})
    if FORK_SERVER in grandparent.get('cmd', ''):
      return "forked by a fork server's child (a supervisor's worker)"
    return "forked by a fork server (a test's process)"
  if '/ray/' in cmd or cmd.startswith('ray::'):  # (Ray names a busy worker by its task)
    return 'Ray (its daemons and workers)'
  if 'import ctypes, os, sys' in cmd:  # ray_host.py's trainer before it execs
    return 'new interpreter: -m mecefo_jax'
  if 'ipykernel' in cmd:
    return 'notebook kernel'
  if 'exec(eval(sys.stdin' in cmd:
    return 'pytest-xdist worker (in-process tests)'
  program = re.search(r'python[0-9.]*\s+(?:-[uSIEB]+\s+)*(-m\s+\S+|-c|\S+\.py)', cmd)
  if program:
    name = re.sub(r'\s+', ' ', program.group(1))
    if '-m pip' in name or 'ensurepip' in cmd:
      return 'pip'
    if name.endswith('.py'):
      name = Path(name).name
    parent = by_pid.get(entry['ppid'], {}).get('cmd', '')
    return f'forked by {name} (its workers)' if cmd == parent else f'new interpreter: {name}'
  if not cmd:
    return 'kernel threads and processes gone before their first sample'
  return Path(cmd.split()[0]).name


def tails_s(entries: list[dict], last_round: int) -> float:
  """CPU seconds the samples missed (each process's last interval, or all of one that lived
  less than one): what each parent alive at the end reaped, less what was seen of the process
  trees it reaped."""
  children: dict[int, list[dict]] = {}
  for e in entries:
    if e['alive'] < last_round and not e['first']:  # ended while sampled
      children.setdefault(e['ppid'], []).append(e)

  def seen(e: dict, depth: int = 0) -> float:  # (depth: a pid reused deeper down its own tree)
    below = children.get(e['pid'], ()) if depth < 64 else ()
    return e['cpu_s'] + sum(seen(c, depth + 1) for c in below if c is not e)

  return sum(max(0.0, e['reaped_s'] - sum(seen(c) for c in children.get(e['pid'], ())))
             for e in entries if e['alive'] == last_round)


def summary(entries: list[dict], last_round: int) -> dict[str, dict]:
  """Kind -> {cpu_s, processes}, the largest first (this process's own CPU left out)."""
  by_pid = {e['pid']: e for e in entries}
  kinds: dict[str, dict] = {}
  for entry in entries:
    if entry['cpu_s'] <= 0 or entry['pid'] == os.getpid():
      continue
    row = kinds.setdefault(kind(entry, by_pid), {'cpu_s': 0.0, 'processes': 0})
    row['cpu_s'] += entry['cpu_s']
    row['processes'] += 1
  kinds[TAILS] = {'cpu_s': tails_s(entries, last_round), 'processes': 0}
  return {k: {**v, 'cpu_s': round(v['cpu_s'], 1)}
          for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]['cpu_s'])}


def largest(entries: list[dict], floor_s: float = 1.0) -> list[dict]:
  """Each process that used at least `floor_s` CPU seconds, the largest first: its kind, its
  command line and its parent's (which test's process it was is read from them)."""
  by_pid = {e['pid']: e for e in entries}
  rows = [{'cpu_s': round(e['cpu_s'], 1), 'kind': kind(e, by_pid), 'cmd': e['cmd'][:300],
           'parent': by_pid.get(e['ppid'], {}).get('cmd', '')[:300]}
          for e in entries if e['cpu_s'] >= floor_s and e['pid'] != os.getpid()]
  return sorted(rows, key=lambda r: -r['cpu_s'])


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--json', type=Path, required=True)
  parser.add_argument('--interval-s', type=float, default=0.25)
  parser.add_argument('command', nargs=argparse.REMAINDER, help='-- CMD ARGS...')
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ['--'] else args.command
  if not command:
    parser.error('no command: give it after --')
  head = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=REPO, capture_output=True, text=True)
  result = {'commit': head.stdout.strip() or None, 'command': command,
            'date': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()),
            'cpus': os.cpu_count(), 'load_before': os.getloadavg(), 'interval_s': args.interval_s}
  started = time.monotonic()
  with Sampler(args.interval_s) as sampler:  # (jax is never imported here: no CPU of its own)
    code = subprocess.call(command)
  kinds = summary(list(sampler.seen.values()), sampler.round)
  result.update(exit_code=code, wall_s=round(time.monotonic() - started, 1),
                cpu_s=round(sum(k['cpu_s'] for k in kinds.values()), 1), kinds=kinds,
                processes=largest(list(sampler.seen.values())))
  args.json.write_text(json.dumps(result, indent=1) + '\n')
  print('| kind | CPU s | processes |\n|---|---|---|')
  for name, row in kinds.items():
    print(f"| {name} | {row['cpu_s']} | {row['processes']} |")
  print(f"{result['cpu_s']} CPU s in {result['wall_s']} s wall on {result['cpus']} CPUs "
        f'(exit {code})')
  return code


if __name__ == '__main__':
  sys.exit(main())
