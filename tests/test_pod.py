"""The pod recipe's CPU-runnable parts: the controller's per-host commands (parsed by train.py's
parser), its probe rules, its restarts run on fake devices (processes on this machine), and the
GKE JobSet manifest's command checked against train.py's parser and config. Nothing here ran on
a TPU pod or a GKE cluster."""
import json
import re
import shlex
import sys
import time
import tomllib
from pathlib import Path

import pytest
import yaml

from deploy import pod_controller as pc
from mecefo_jax.supervisor import free_port
from mecefo_jax.run import cli
from mecefo_jax.run.stop import TEST_DEATH_ENV
from procs import ROOT, TINY, kill, report, usage_error

HOSTS = '10.0.0.2,10.0.0.3,10.0.0.4,10.0.0.5'
TRAIN = ['--config', 'configs/llama_1b.yaml', '--out', '/mnt/runs/a', 'mesh.fsdp=4']


def _dry_run(capsys, *argv) -> dict[int, list[str]]:
  """The printed command of each logical host: {host: argv}."""
  assert pc.main(['--dry-run', *argv]) == 0
  lines = capsys.readouterr().out.splitlines()
  return {int(line.split(':')[0].split()[1]): shlex.split(line.split(': ', 1)[1]) for line in lines}


def _train_part(remote: str) -> tuple[dict, list[str]]:
  """(environment, train.py arguments) of the shell command a host runs."""
  last = shlex.split(remote.split(' && ')[-1])[1:]  # after `exec`
  env = {}
  if last[0] == 'env':
    last.pop(0)
    while '=' in last[0] and not last[0].startswith('-'):
      key, value = last.pop(0).split('=', 1)
      env[key] = value
  assert last[1:3] == ['-m', 'mecefo_jax'], last  # the installed trainer, not a checkout file
  return env, last[3:]


def test_first_start_every_host_its_slot_and_the_coordinator_on_host_0(capsys):
  commands = _dry_run(capsys, '--hosts', HOSTS, '--', *TRAIN)
  assert sorted(commands) == [0, 1, 2, 3]
  for host, argv in commands.items():
    assert argv[:2] == ['ssh', '-o'] and argv[-2] == HOSTS.split(',')[host]
    env, train = _train_part(argv[-1])
    args = cli.parse_args(train)
    assert (args.coordinator, args.num_processes, args.process_id, args.host_slot) == (
        '10.0.0.2:8476', 4, host, host)
    assert not env and not args.resume and args.out == '/mnt/runs/a'
    assert ('rm -f /mnt/runs/a/stop_request' in argv[-1]) == (host == 0)


def test_survivors_of_a_tpu_slice_keep_their_slots_and_renumber_slices(capsys):
  # 2 TPU slices of 2 hosts; slice 0 (hosts 0, 1) lost: hosts 2, 3 go on as processes 0, 1.
  template = ('gcloud compute tpus tpu-vm ssh my-slice-{unit} --zone=z --worker={worker} '
              '--command={cmd}')
  commands = _dry_run(capsys, '--hosts', HOSTS, '--slice-hosts', '2', '--megascale',
                      '--transport', template, '--survivors', '2,3', '--', *TRAIN, '--fresh')
  for pid, host in enumerate([2, 3]):
    argv = commands[host]
    assert argv[:6] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', 'my-slice-1']
    assert argv[7] == f'--worker={host - 2}' and argv[8].startswith('--command=cd mecefo-jax')
    env, train = _train_part(argv[8][len('--command='):])
    assert env == {'MEGASCALE_NUM_SLICES': '1', 'MEGASCALE_SLICE_ID': '0',
                   'MEGASCALE_COORDINATOR_ADDRESS': '10.0.0.4'}
    args = cli.parse_args(train)
    assert (args.coordinator, args.num_processes, args.process_id, args.host_slot) == (
        '10.0.0.4:8476', 2, pid, host)
    assert args.resume and not args.fresh  # a restart never wipes the run


@pytest.mark.parametrize('argv, expected', [
    (['--hosts', 'a'], 'need >= 2 hosts'),
    (['--hosts', 'a,b,c', '--slice-hosts', '2'], 'a multiple of --slice-hosts=2'),
    (['--hosts', 'a,b', '--', '--host-slot=1'], '--host-slot is set by the controller'),
    (['--hosts', 'a,b', '--survivors', '0,x'], '--survivors: expected logical hosts'),
    (['--hosts', 'a,b', '--survivors', '0,2'], 'logical hosts are 0..1'),
    (['--hosts', 'a,b', '--', '--bogus'], 'unrecognized arguments: --bogus'),
    (['--hosts', 'a,b', '--', 'mesh.bogus=1'], "unknown config key 'mesh.bogus'")])
def test_input_errors_are_one_line_before_any_host_is_reached(capsys, argv, expected):
  line = usage_error(capsys, pc.parse_args, argv)
  assert expected in line, line


def test_a_tpu_slice_is_usable_only_whole(monkeypatch):
  pod = pc.PodController(pc.parse_args(['--hosts', HOSTS, '--slice-hosts', '2', '--', *TRAIN]))
  asked = []

  def answers(commands):
    asked.append(sorted(commands))
    return {h: h != 3 for h in commands}  # host 3 does not answer
  monkeypatch.setattr(pod, '_on_hosts', answers)
  assert pod.usable([0, 1, 2, 3]) == [0, 1]
  assert pod.usable([2]) == [] and asked[-1] == [2, 3]  # its whole slice asked
  assert pod._regroup() == [2, 3] and pod.hosts == [0, 1] and sorted(pod.ready_at) == [2, 3]


def _command(container: dict) -> list[str]:
  return [*container.get('command', []), *container.get('args', [])]


def test_jobset_manifest_runs_the_installed_trainer_with_flags_it_accepts():
  manifest = yaml.safe_load((ROOT / 'deploy' / 'jobset-tpu.yaml').read_text())
  assert manifest['kind'] == 'JobSet' and manifest['apiVersion'].startswith('jobset.x-k8s.io/')
  [job] = manifest['spec']['replicatedJobs']
  spec = job['template']['spec']
  pod = spec['template']['spec']
  [container] = pod['containers']
  command = _command(container)
  assert command[0] == 'mecefo-train', command  # the package's console script (pyproject.toml)
  args = pc.check_train_args(command[1:])  # train.py's parser and load_config: exits if bad
  cfg = cli.new_config(args)
  assert not {'coordinator', 'process_id', 'host_slot', 'resume', 'fresh'} & {
      k for k, v in vars(args).items() if v not in (None, False)}  # auto-detected / resumed
  # One MeCeFO slice per host: fsdp * tensor = the chips each pod holds.
  chips = int(container['resources']['limits']['google.com/tpu'])
  assert cfg.mesh.fsdp * cfg.mesh.tensor == chips
  assert spec['parallelism'] == spec['completions'] and spec['backoffLimit'] == 0
  assert cfg.snapshot.durable_dir.startswith('gs://') and cfg.snapshot.durable_every > 0
  mounts = {m['mountPath']: m['name'] for m in container['volumeMounts']}
  volumes = {v['name']: v for v in pod['volumes']}
  assert volumes[mounts['/dev/shm']]['emptyDir']['medium'] == 'Memory'
  shared = [path for path, name in mounts.items() if 'persistentVolumeClaim' in volumes[name]]
  for path in (args.out, cfg.train.data.split(':', 1)[1]):  # on the volume every pod shares
    assert any(path.startswith(root + '/') for root in shared), path


def test_the_image_installs_the_package_and_the_docs_run_the_installed_commands():
  """deploy/Dockerfile installs the package (its console scripts on PATH, configs inside it);
  docs/tpu.md starts training with the installed commands, never a file of the checkout."""
  dockerfile = (ROOT / 'deploy' / 'Dockerfile').read_text()
  assert re.search(r'^RUN pip install [^\n]*--no-deps \.$', dockerfile, re.M), dockerfile
  scripts = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']['scripts']
  tpu = (ROOT / 'docs' / 'tpu.md').read_text()
  runs_a_checkout_file = re.findall(r'python\S*\s+(?:train\.py|-m mecefo_jax\.launch)\b', tpu)
  assert not runs_a_checkout_file, runs_a_checkout_file
  used = set(re.findall(r'\bmecefo-(?:train|launch|prepare|plot|report)\b', tpu))
  assert {'mecefo-train', 'mecefo-launch', 'mecefo-prepare'} <= used <= set(scripts), used


def _events(path: Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(path: Path, count: int, proc, timeout: float = 300) -> list[dict]:
  """The events once `count` 'start' events are written (or the controller ended)."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline and proc.poll() is None:
    events = _events(path)
    if sum(e['kind'] == 'start' for e in events) >= count:
      return events
    time.sleep(0.2)
  raise AssertionError(f'no start #{count} in {timeout} s: {_events(path)}')


def test_controller_restarts_the_usable_hosts_and_grows_back_on_fake_devices(launcher, tmp_path):
  """3 hosts on this machine (`local` transport, 1 CPU device each). Host 1 dies after step 2
  and stops answering the probe (a file stands for the lost VM): hosts 0 and 2 resume as a
  2-process job with their slots; once host 1 answers again, the job stops at an agreed step
  and all 3 train on to the end."""
  # 6 steps after the death: the probe (every 1 s) answers within the 2-process job's start-up,
  # so that it stops for the grow-back at its first step, long before its last.
  events, down, steps, death = tmp_path / 'events.jsonl', tmp_path / 'down1', 8, 2
  run = tmp_path / 'run'
  cmd = [sys.executable, ROOT / 'deploy' / 'pod_controller.py', '--hosts', '127.0.0.1,' * 2 +
         '127.0.0.1', '--transport', 'local', '--workdir', ROOT, '--python', sys.executable,
         '--port', free_port(), '--probe', f'test ! -e {tmp_path}/down{{slot}}',
         '--probe-every', '1', '--pid-dir', tmp_path, '--log-dir', tmp_path / 'logs',
         '--events', events, '--', '--host-devices=1', '--out', run,
         f'snapshot.dir={tmp_path / "shm"}', 'mesh.slice=3', 'mesh.fsdp=1', *TINY,
         f'train.steps={steps}', 'train.log_every=1', 'snapshot.every=1', 'train.eval_every=0',
         # No programs built ahead for failures that never come (none but the death here):
         # what the controller does is the same, at a fraction of the compiles.
         'faults.precompile=never']
  env = launcher.env(**{TEST_DEATH_ENV: f'1:{death}'})
  proc = launcher.start(cmd, env=env, stdout=open(tmp_path / 'out.log', 'wb'),
                        stderr=open(tmp_path / 'err.log', 'wb'))
  try:
    _wait_for(events, 1, proc)
    down.touch()  # after the first start's probe: host 1 is lost once it dies
    second = [e for e in _wait_for(events, 2, proc) if e['kind'] == 'start'][-1]
    assert second['hosts'] == [0, 2]
    down.unlink()  # host 1 is back
    code = proc.wait(timeout=400)
  finally:
    kill(proc)  # with the processes it started, if it is still running
  log = (tmp_path / 'err.log').read_text() + (tmp_path / 'out.log').read_text()
  assert code == 0, log[-4000:]
  kinds = [e['kind'] for e in _events(events)]
  assert kinds == ['start', 'death', 'probe', 'start', 'rejoin-ready', 'rejoin', 'start',
                   'end'], kinds
  result = report(run)
  assert result['steps'] == steps and result['samples']['dropped'] == 0
  assert result['live_slices_at_end'] == [0, 1, 2]
  fail, repair = result['failure_events']
  assert (fail['step'], fail['slice'], fail['kind'], fail['source']) == (death, 1, 'fail',
                                                                      'absent')
  assert (repair['slice'], repair['kind'], repair['source']) == (1, 'repair', 'present')

