"""Pod controller: runs train.py on every host of a pod and restarts the hosts that answer after a death.

  python deploy/pod_controller.py --hosts ADDR,ADDR,... [--transport ssh|local|TEMPLATE]
      [--slice-hosts K] [--dry-run [--survivors SLOTS]] -- <train.py args>

Host i of --hosts is logical host i (`--host-slot i`) for the whole run. The controller starts
process p of each job on its host through the transport (ssh by default) and watches them, as
the local supervisor (mecefo_jax/launch.py) does. When one dies, it stops the others, asks every
host whether it is usable (--probe) and restarts the usable ones as a job that resumes the run
(`--resume`), each with its own --host-slot, so that its in-memory snapshot part stays valid. A
host that did not answer is asked again every --probe-every seconds; once it answers, the job
stops at an agreed step and restarts with it. With --slice-hosts K, hosts K*u .. K*u+K-1 form
TPU slice u, usable only whole. See docs/tpu.md. Tested on CPU (processes on one machine, the
`local` transport); NOT run on a TPU pod.
"""
from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the repository's package

from mecefo_jax.config import DEFAULT_OUT, ConfigError  # noqa: E402
from mecefo_jax.launch import serve  # noqa: E402
from mecefo_jax.job_rules import exit_text, megascale_env  # noqa: E402
from mecefo_jax.records.history import Kind  # noqa: E402
from mecefo_jax.records.job import (ALL_DOWN, BAD_INPUT, PARENT, STOP_FILE,  # noqa: E402
                                    STOPPED_S, SUPERVISOR_ENV)
from mecefo_jax.supervisor import Supervisor  # noqa: E402
from mecefo_jax.run import cli  # noqa: E402

# {host}: the host's address, {slot}: its logical host, {unit}: its TPU slice, {worker}: its
# index in that slice, {cmd}: the shell command to run there (one argument).
TRANSPORTS = {
    # ServerAlive: a dead host is seen within ~30 s, before the survivors' --heartbeat-s runs out.
    'ssh': 'ssh -o BatchMode=yes -o ConnectTimeout=10 -o ServerAliveInterval=10 '
           '-o ServerAliveCountMax=3 {host} {cmd}',
    'local': 'sh -c {cmd}',  # every host is this machine (tests, a try-out on CPU)
}
# Set by the controller for each job, never by the user's train.py arguments.
_OWN_FLAGS = ('--coordinator', '--num-processes', '--process-id', '--host-slot')
_REMOTE_TIMEOUT_S = 60.0  # a probe, a kill or a stop request on one host


def parse_args(argv=None):
  p = cli.OneLineParser(prog='python deploy/pod_controller.py',
                        description=__doc__.split('\n')[0],
                        epilog='example: python deploy/pod_controller.py --hosts 10.0.0.2,10.0.0.3 '
                               '-- --config configs/llama_1b.yaml --out /mnt/runs/a mesh.fsdp=4')
  p.add_argument('--hosts', required=True,
                 help='the hosts\' addresses, in logical host order (comma, semicolon or space '
                      'separated); host 0 of each job also runs its coordinator')
  p.add_argument('--transport', default='ssh',
                 help='ssh | local | a command template with {host} {slot} {unit} {worker} {cmd}, '
                      "e.g. 'gcloud compute tpus tpu-vm ssh my-pod --zone=Z --worker={worker} "
                      "--command={cmd}'")
  p.add_argument('--workdir', default='mecefo-jax', help='the repository on every host')
  p.add_argument('--python', default='python3', help='the Python of every host')
  p.add_argument('--port', type=int, default=8476,
                 help='coordinator port of the first job; restart r uses PORT+r')
  p.add_argument('--slice-hosts', type=cli.at_least(1), default=1, metavar='K',
                 help='hosts per TPU slice (the unit that fails and comes back whole)')
  p.add_argument('--megascale', action='store_true',
                 help='TPU multislice: set MEGASCALE_NUM_SLICES, _SLICE_ID and _COORDINATOR_ADDRESS '
                      'for the TPU slices of each job (not run on a pod)')
  p.add_argument('--probe', default='true',
                 help='shell command that succeeds on a usable host ({slot}: its logical host)')
  p.add_argument('--probe-every', type=cli.at_least(0, float), default=60.0, metavar='SECONDS',
                 help='ask the hosts that did not answer again this often')
  p.add_argument('--max-wait', type=cli.at_least(0, float), default=3600.0, metavar='SECONDS',
                 help='with fewer than 2 usable hosts, wait this long for more, then give up')
  p.add_argument('--max-restarts', type=int, default=10, help='give up after this many restarts')
  p.add_argument('--pid-dir', default='/tmp', help='where each host keeps its train.py pid')
  p.add_argument('--log-dir', default=None,
                 help='output of the hosts other than process 0 (default: pod-logs/<run name>)')
  p.add_argument('--events', default=None, metavar='FILE', help='also write events as JSON lines')
  p.add_argument('--dry-run', action='store_true', help='print each host\'s command and exit')
  p.add_argument('--survivors', default=None, metavar='SLOTS',
                 help='with --dry-run: the commands of a restart of these logical hosts')
  p.add_argument('train_args', nargs='*', help='-- then train.py arguments')
  args = p.parse_args(argv)
  args.hosts = args.hosts.replace(';', ',').replace(' ', ',').strip(',').split(',')
  if len(args.hosts) < 2 or len(args.hosts) % args.slice_hosts:
    p.error(f'need >= 2 hosts, a multiple of --slice-hosts={args.slice_hosts}; got '
            f'{len(args.hosts)}')
  own = [a for a in args.train_args if a.split('=')[0] in _OWN_FLAGS]
  if own:
    p.error(f'{own[0].split("=")[0]} is set by the controller; leave it out of the train.py '
            'arguments')
  try:
    args.survivors = args.survivors and sorted({int(s) for s in args.survivors.split(',')})
  except ValueError:
    p.error(f'--survivors: expected logical hosts like 0,2,3, got {args.survivors!r}')
  if args.survivors and not set(args.survivors) <= set(range(len(args.hosts))):
    p.error(f'--survivors {args.survivors}: logical hosts are 0..{len(args.hosts) - 1}')
  args.out = Path(check_train_args(args.train_args).out or DEFAULT_OUT)
  args.log_dir = Path(args.log_dir or Path('pod-logs') / args.out.name)
  # What Supervisor reads: the job's size, no local devices, and no timed replacement.
  args.num_processes, args.rejoin_after, args.argv = len(args.hosts), None, []
  args.stopped_s = STOPPED_S  # the remote processes watch their ssh parent instead
  args.spawn = 'exec'  # each process is an ssh command, started anew
  return args


def check_train_args(argv: list[str]):
  """train.py's parse of `argv`, whose config (a built-in name, or a path relative to the
  repository as on the hosts) is loaded as train.py loads a new run's: a bad flag or override
  fails here, in one line (exit BAD_INPUT), before any host is reached."""
  args = cli.parse_args(argv)
  if args.config is not None and (ROOT / args.config).is_file():
    args.config = str(ROOT / args.config)
  try:
    cli.new_config(args)
  except ConfigError as err:
    print(f'error: train.py arguments: {err}', file=sys.stderr)
    sys.exit(BAD_INPUT)
  return args


def _pid_file(args, slot: int) -> str:
  """Where host `slot` keeps the pid of its train.py (one file per run directory and host)."""
  tag = hashlib.sha1(str(args.out).encode()).hexdigest()[:8]
  return f'{args.pid_dir}/mecefo-{tag}-host{slot}.pid'


def remote_command(args, hosts: list[int], pid: int, port: int, train_args: list[str]) -> str:
  """The shell command that runs process `pid` of the job of logical hosts `hosts` on its host:
  its pid kept in a file (to signal it later), then the installed trainer (`python -m
  mecefo_jax`, which the checkout's `train.py` also is) in place of the shell."""
  slot = hosts[pid]
  train = [args.python, '-m', 'mecefo_jax', f'--coordinator={args.hosts[hosts[0]]}:{port}',
           f'--num-processes={len(hosts)}', f'--process-id={pid}', f'--host-slot={slot}',
           *train_args]
  ms = megascale_env(hosts, slot, args.slice_hosts, args.hosts[hosts[0]]) if args.megascale else {}
  env = [f'{k}={v}' for k, v in ms.items()]
  steps = [f'cd {shlex.quote(args.workdir)}']
  if pid == 0:  # a stop request that no job honoured must not stop this one
    steps.append(f'rm -f {shlex.quote(str(args.out / STOP_FILE))}')
  # The process stops the job at an agreed step once its parent (the transport's session) is
  # gone: a controller that died leaves no job training unwatched (run/supervised.py).
  steps += [f'echo $$ > {shlex.quote(_pid_file(args, slot))}', f'export {SUPERVISOR_ENV}={PARENT}',
            'exec ' + shlex.join(['env', *env, *train] if env else train)]
  return ' && '.join(steps)


def on_host(args, slot: int, command: str) -> list[str]:
  """The local argv that runs the shell `command` on logical host `slot` through the transport."""
  fields = {'{host}': args.hosts[slot], '{slot}': str(slot), '{cmd}': command,
            '{unit}': str(slot // args.slice_hosts), '{worker}': str(slot % args.slice_hosts)}
  argv = []
  for token in shlex.split(TRANSPORTS.get(args.transport, args.transport)):
    if token == '{cmd}':
      argv.append(command)
      continue
    for key, value in fields.items():
      token = token.replace(key, value)
    argv.append(token)
  return argv


class PodController(Supervisor):
  """The supervisor's watch, stop and restart rules, with processes on remote hosts: started
  through the transport, signalled through their pid files, probed after every death. No
  stall watch: the progress marks are files on each host (docs/tpu.md: what catches a stall)."""
  watches_stalls = False

  def __init__(self, args):
    super().__init__(args)
    self.back: set[int] = set()  # absent hosts that answered since: they rejoin at the next stop

  def _port(self) -> int:
    return self.args.port + self.restarts

  def _clear_stop_request(self) -> None:
    pass  # process 0's command removes it on its host (remote_command)

  def _run_exists(self) -> bool:
    return True  # on the hosts, unseen from here: a restart resumes

  def command(self, pid: int, host: int, n: int, port: int) -> tuple[list[str], dict]:
    remote = remote_command(self.args, self.hosts, pid, port, self._train_args())
    return on_host(self.args, host, remote), dict(os.environ, PYTHONUNBUFFERED='1')

  def _on_hosts(self, commands: dict[int, str]) -> dict[int, bool]:
    """Runs each host's command at once; whether each succeeded within the time limit."""
    procs = {h: subprocess.Popen(on_host(self.args, h, c), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for h, c in commands.items()}
    deadline, done = time.monotonic() + _REMOTE_TIMEOUT_S, {}
    for h, p in procs.items():
      try:
        done[h] = p.wait(max(0.0, deadline - time.monotonic())) == 0
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        done[h] = False
    return done

  def _signal(self, name: str) -> None:
    """Sends SIG`name` to the train.py of every host whose process is still running."""
    running = [h for h, p in self.procs.items() if p.poll() is None]
    self._on_hosts({h: f'kill -{name} "$(cat {shlex.quote(_pid_file(self.args, h))})"'
                    for h in running})

  def kill_all(self) -> None:
    self._signal('KILL')  # the remote processes; a killed ssh client would leave them running
    super().kill_all()

  def _ask_stop(self, reason: str | None = None) -> None:
    """A stop request file on process 0's host (honoured at a step whenever it lands), or,
    without a reason or where it cannot be written, SIGTERM to every process."""
    self.stopping, self.stop_asked_at = True, time.monotonic()
    if reason is not None and self.hosts:
      path = shlex.quote(str(self.args.out / STOP_FILE))
      written = self._on_hosts({self.hosts[0]: f'cd {shlex.quote(self.args.workdir)} && '
                                                f'printf %s {shlex.quote(reason)} > {path}'})
      if all(written.values()):
        return
    self._signal('TERM')

  def usable(self, hosts) -> list[int]:
    """Those of `hosts` whose whole TPU slice answers the probe now."""
    asked = sorted({u for h in hosts for u in self.unit_of(h)})
    answers = self._on_hosts({h: self.args.probe.replace('{slot}', str(h)) for h in asked})
    return sorted(h for h in hosts if all(answers[u] for u in self.unit_of(h)))

  def _ready(self) -> list[int]:
    """The absent hosts that answered (asked every --probe-every seconds)."""
    now = time.monotonic()
    due = [h for h, t in self.ready_at.items() if now >= t and h not in self.back]
    if due:
      self.back.update(self.usable(due))
      for h in set(due) - self.back:
        self.ready_at[h] = now + self.args.probe_every
    return sorted(h for h in self.ready_at if h in self.back)

  def _regroup(self) -> list[int]:
    """Puts every usable host in the next job and the others in ready_at; the lost hosts."""
    every = range(len(self.args.hosts))
    self.hosts = self.usable(every)
    lost = [h for h in every if h not in self.hosts]
    self.ready_at = {h: time.monotonic() + self.args.probe_every for h in lost}
    self.back -= set(lost) | set(self.hosts)
    return lost

  def _death(self, host: int, code: int) -> int | None:
    self.deaths += 1
    self.clock.failure('death', host, self.clock.since_last_look())
    # Whichever process was seen first (the coordination service may end the survivors before
    # a lost host's ssh notices), every host is probed: only the probe decides who goes on.
    self.say(Kind.LAUNCH_DEATH,
             f'host {host}\'s process ended ({exit_text(code)}): stopping the others, asking '
             'every host whether it is usable', host=host, code=code)
    self.kill_all()  # they would wait in the next collective for the dead one
    self.clock.stopped()
    lost, deadline = self._regroup(), time.monotonic() + self.args.max_wait
    while len(self.hosts) < 2:
      if time.monotonic() > deadline:
        self.say(Kind.LAUNCH_GIVE_UP,
                 f'fewer than 2 usable hosts for --max-wait={self.args.max_wait:.0f} s: the run '
                 'stops here; start the controller again to resume it')
        return ALL_DOWN
      time.sleep(self.args.probe_every)
      lost = self._regroup()
    self.say(Kind.LAUNCH_PROBE,
             f'usable hosts {self.hosts}' + (f'; hosts {lost} do not answer (asked again every '
                                             f'{self.args.probe_every:.0f} s)' if lost else
                                             ' (every host: the process died, not its host)'),
             hosts=self.hosts, lost=lost)
    return self._restart()

  def run(self) -> int:
    lost = self._regroup()
    if lost:
      self.say(Kind.LAUNCH_GIVE_UP,
               f'hosts {lost} do not answer the probe: nothing was started')
      return BAD_INPUT
    return super().run()


def main(argv=None) -> int:
  args = parse_args(argv)
  pod = PodController(args)
  if args.dry_run:
    if args.survivors:
      pod.hosts, pod.resume = args.survivors, True
    for pid, host in enumerate(pod.hosts):
      print(f'host {host}: {shlex.join(pod.command(pid, host, len(pod.hosts), args.port)[0])}')
    return 0
  return serve(pod)


if __name__ == '__main__':
  sys.exit(main())
