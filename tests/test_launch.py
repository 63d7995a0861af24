"""The supervisor with a real death placed at an exact step (the process SIGKILLs itself, as a
test hook asks), a rejoin and a stop at exact steps (stop requests, not sleeps): the survivors
take over at once, every step and record is kept across the restarts, the printed resume
command works as printed, and the run equals a one-process replay of its failures.txt."""
import json
import os
import re
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from mecefo_jax import job_rules, launch, supervisor
from mecefo_jax.records import history, run_dir
from mecefo_jax.records.history import Kind
from mecefo_jax.records.job import BAD_INPUT, STOPPED
from mecefo_jax.run import plot
from mecefo_jax.run.cli import TEST_START_ERROR_ENV
from mecefo_jax.run.stop import TEST_DEATH_ENV
from mecefo_jax.records.run_state import RunState, write_run_state
from procs import ROOT, error_lines, report, requeued_ids, usage_error

# 3 processes x 2 CPU devices, one slice per device: host h holds slices 2h, 2h+1.
# Each phase a few steps long: the death after step 3, the grow-back after the survivors' one
# step (4), the failure of host 2's slices at 6 and their repair at 8, the stop at 10.
STEPS, DEATH, STOP = 12, 3, 10
FAIL, REPAIR = 6, 8
ARGS = ['mesh.slice=6', 'mesh.fsdp=1', 'mesh.ordered_reduce=true', f'train.steps={STEPS}',
        'train.log_every=1', 'train.micro_batch=4', 'model.n_layers=2', 'model.seq_len=16',
        'snapshot.every=1', 'train.eval_every=0', 'train.plot=false']
# Slices 4 and 5 (host 2) fail and are repaired after the rejoin: host 2 has no live slice then.
TRACE = f'{FAIL} 4 fail\n{FAIL} 5 fail\n{REPAIR} 4 repair\n{REPAIR} 5 repair\n'


def _events(path: Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _strip(events: list[dict]) -> list[tuple]:
  return [(e['step'], e['slice'], e['kind']) for e in events]


def test_a_death_a_rejoin_and_a_stop_keep_every_step_and_record(launcher, tmp_path):
  events, trace = tmp_path / 'events.jsonl', tmp_path / 'trace.txt'
  trace.write_text(TRACE)
  run = tmp_path / 'run'
  # Host 1 dies after step DEATH (its snapshot written, the background builds done); its
  # replacement is ready at once, so the survivors' job stops after its first step and
  # the job of all hosts trains on to the stop at STOP. faults.precompile=always: the first job
  # compiles into the program store the programs of the job that restarts after a death.
  cmd = [sys.executable, '-m', 'mecefo_jax.launch', '-n', '3', '--devices-per-process', '2',
         '--rejoin-after', '0', '--events', str(events), '--', '--out', str(run),
         f'snapshot.dir={tmp_path / "shm"}', f'--failures=trace:{trace}',
         'faults.precompile=always', *ARGS, '--stop-after', str(STOP)]
  env = launcher.env(compile_cache=False)
  first = launcher.run(cmd, timeout=600, env={**env, TEST_DEATH_ENV: f'1:{DEATH}'})
  log = first.stdout + first.stderr
  assert first.returncode == STOPPED, log[-4000:]
  kinds = [e['kind'] for e in _events(events)]
  assert kinds == ['start', 'death', 'start', 'rejoin-ready', 'rejoin', 'start', 'end'], kinds
  assert f'snapshot {DEATH}: part of host 1 rebuilt from the parity of the others' in log
  survivors = log[log.index('host 1 (pid'):log.index('host(s) [1] rejoin')]
  # The first job's processes share its (empty) program store: one of them lowered and
  # compiled each of its first programs and the others loaded it (step/cache.py Shared), and
  # each program built ahead for a restart was built by one process (its recipe's claim).
  logs = [(run / 'logs' / f'host{h}.log').read_text() for h in range(3)]
  for kind in ('group', 'update'):
    first_build = [re.search(rf'(compiling|loaded from the store) the {kind} program onto '
                             r'slices \[0-5\]\n', text).group(1) for text in logs]
    assert sorted(first_build) == ['compiling', *['loaded from the store'] * 2], (kind, first_build)
  ahead = [m for text in logs for m in re.findall(r'compiling the (.*) \(background\) into', text)]
  assert ahead and len(ahead) == len(set(ahead)), ahead
  # The survivors' job loaded the takeover's programs that the first job had stored, moved
  # onto its own devices, and stopped after its first step, saved in both tiers.
  assert 'loaded from the store the update program onto slices [0, 1, 4, 5]' in survivors
  assert f'stopped by the grow-back of host(s) [1] after {DEATH + 1} steps, saved as the ' \
         'in-memory snapshot parts' in survivors
  stopped = report(run)
  assert stopped['steps'] == STOP and stopped['preempted'] and 'durable checkpoint' in \
      stopped['stopped']
  # The death's restart is booked (carried through the rejoin) and on the plot's time axis.
  death = next(line.t for line in history.read(run) if line.kind is Kind.LAUNCH_DEATH)
  assert 0 < stopped['goodput']['restart'] < time.time() - death
  alone = tmp_path / 'rows'  # the same rows without the history: no death, no gap
  alone.mkdir()
  shutil.copy(run / 'metrics.jsonl', alone)
  gap = plot.read_rows(run)[-1].t - plot.read_rows(alone)[-1].t
  assert gap >= stopped['goodput']['restart']  # the death's gap: its restart and then some

  # The resume command the stop printed, run exactly as printed: nothing trained again.
  resume = re.findall(r'resume with `(python -m mecefo_jax\.launch [^`]*)`', log)[-1]
  assert '--stop-after' not in resume
  second = launcher.run([sys.executable, *shlex.split(resume)[1:]], timeout=600, env=env)
  assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
  result = report(run)
  assert (result['steps'], result['resumed_from_step'], result['steps_lost'],
          result['steps_lost_total']) == (STEPS, STOP, 0, 0)
  assert result['programs']['loaded'] >= 1, result['programs']
  assert _strip(result['failure_events']) == [
      (DEATH, 2, 'fail'), (DEATH, 3, 'fail'), (DEATH + 1, 2, 'repair'), (DEATH + 1, 3, 'repair'),
      (FAIL, 4, 'fail'), (FAIL, 5, 'fail'), (REPAIR, 4, 'repair'), (REPAIR, 5, 'repair')]
  # The default, requeue: the rows of the slices down were trained later, none degraded or
  # dropped; metrics.jsonl's ids, across the death, the survivors' job, the rejoin, the stop and
  # the resume, are each id of the stream once, in order.
  assert result['samples']['dropped'] == 0 and result['samples']['degraded'] == 0
  assert requeued_ids(run, seq_len=16) == list(range(result['samples']['exact']))
  assert result['live_slices_at_end'] == list(range(6))
  lines = history.read(run)
  assert [line.kind for line in lines if line.kind in (Kind.STOP, Kind.LAUNCH_DEATH)] == [
      Kind.LAUNCH_DEATH, Kind.STOP, Kind.STOP]
  assert [line.step for line in lines if line.kind is Kind.STOP] == [DEATH + 1, STOP]

  # failures.txt's own replay line, run exactly as printed (from tmp_path): one process with
  # every device, the same records and parameters, in run/replay (runs/latest is not touched).
  line = (run / 'failures.txt').read_text().splitlines()[0]
  # The supervised processes are `python -m mecefo_jax`: the line names that (the package
  # importable, as where it is installed).
  replay_cmd = re.fullmatch(r'# replay: `(python -m mecefo_jax [^`]*)`', line).group(1)
  replay = launcher.run([sys.executable, *shlex.split(replay_cmd)[1:]], timeout=600,
                        cwd=tmp_path, env={**env, 'PYTHONPATH': str(ROOT)})
  assert replay.returncode == 0, replay.stderr[-3000:]
  reference = report(run / 'replay')
  assert not (tmp_path / 'runs').exists()
  assert result['params_sha256'] == reference['params_sha256']
  assert result['samples'] == reference['samples']
  assert _strip(result['failure_events']) == _strip(reference['failure_events'])


@pytest.mark.parametrize('argv, expected', [
    (['-n', '3', '--', '--host-devices=2'], '--host-devices is set by'),
    (['-n', '1'], 'need -n >= 2'),
    (['-n', '2', '--rejoin-after', '-5'], 'argument --rejoin-after: must be >= 0, got -5'),
    (['-n', '2', '--rejoin-after', 'nan'], 'argument --rejoin-after: must be >= 0, got nan'),
    (['-n', '2', '--stall-s', '-1'], 'argument --stall-s: must be >= 0, got -1'),
    (['-n', '4', '--slice-hosts', '2'], '--slice-hosts and --megascale place hosts on TPU '
                                        'slices: they need --backend ray'),
    (['-n', '3', '--backend', 'ray', '--slice-hosts', '2'], '-n 3: a multiple of --slice-hosts=2')])
def test_supervisor_input_errors_are_one_line(capsys, argv, expected):
  line = usage_error(capsys, launch.parse_args, argv)
  assert expected in line, line


def _supervise(launcher, tmp_path, *train_args, env=None) -> tuple[int, str]:
  """A 3-process job of the supervisor that ends in start-up: (its code, its stderr). No
  process of it is left, and the others did not end on their own (a timeout of a wait for the
  failed host, a lost peer): the supervisor stopped them once that host exited."""
  run, events = tmp_path / 'run', tmp_path / 'events.jsonl'
  proc = launcher.run([sys.executable, '-m', 'mecefo_jax.launch', '-n', '3', '--events',
                       events, '--', '--out', run, 'model.n_layers=1', 'model.seq_len=16',
                       'train.steps=4', f'snapshot.dir={tmp_path / "shm"}', *train_args],
                      env={**launcher.env(), **(env or {})}, timeout=240)
  [start] = [e for e in _events(events) if e['kind'] == 'start']
  left = [pid for pid in start['pids'].values() if Path(f'/proc/{pid}').exists()]
  assert not left, f'processes of the job left: {left}'
  assert 'error:' in (run / 'logs' / 'host2.log').read_text(errors='replace')
  host1 = (run / 'logs' / 'host1.log').read_text(errors='replace')
  for own_end in ('a collective failed', 'heartbeat', 'timed out', 'DEADLINE_EXCEEDED'):
    assert own_end not in host1, host1[-3000:]
  return proc.returncode, proc.stderr


def test_more_processes_than_slices_is_one_line_naming_the_rule(launcher, tmp_path):
  """3 processes for 2 slices: host 2 would hold none (it hung in the controller, silently)."""
  code, err = _supervise(launcher, tmp_path, 'mesh.slice=2')
  assert code == BAD_INPUT, (code, err[-3000:])
  lines = error_lines(err)
  assert lines and all(line == lines[0] for line in lines), err[-3000:]
  assert lines[0].startswith('error: mesh.slice=2 on 3 processes of 1 device(s): every process '
                             'of a job holds the same number of whole slices'), lines


def test_a_start_up_failure_on_one_host_ends_the_job_with_its_line(launcher, tmp_path):
  """Host 2 fails in start-up (a test hook) while the others wait for it in a collective: it
  exits at once, and the supervisor shows its line and ends the job with its code."""
  code, err = _supervise(launcher, tmp_path, 'mesh.slice=3', env={TEST_START_ERROR_ENV: '2'})
  assert code == BAD_INPUT, (code, err[-3000:])
  assert error_lines(err) == [f'error: {TEST_START_ERROR_ENV}=2: host 2 fails in start-up (a '
                              'test hook)'], err[-3000:]
  assert 'host 2 failed in start-up (exit 2 (bad input)' in err


@pytest.mark.parametrize('argv, expected', [
    (['-n', '2', '--max-restarts', '-1'], 'argument --max-restarts: must be >= 0, got -1'),
    (['-n', '2', '--out', 'D'], 'unrecognized arguments: --out; the training arguments go '
                                'after --, e.g. -- --out D')])
def test_supervisor_refuses_a_negative_restart_limit_and_hints_at_the_dashes(capsys, argv,
                                                                            expected):
  assert usage_error(capsys, launch.parse_args, argv).startswith(f'error: {expected}')


def test_gpus_without_enough_gpus_is_refused(capsys, tmp_path, monkeypatch):
  monkeypatch.setattr(launch, '_GPU_DEVICES', str(tmp_path / 'nvidia[0-9]*'))
  line = usage_error(capsys, launch.parse_args, ['-n', '2', '--gpus'])
  assert line.startswith('error: --gpus: the job needs 2 GPU(s) (-n x --devices-per-process) '
                         'and this machine shows 0'), line
  for i in range(4):
    (tmp_path / f'nvidia{i}').touch()
  monkeypatch.delenv('JAX_PLATFORMS', raising=False)
  args = launch.parse_args(['-n', '2', '--devices-per-process', '2', '--gpus', '--', '--out',
                            str(tmp_path / 'run')])
  _, env = supervisor.Supervisor(args).command(1, 1, 2, 1234)
  assert env['CUDA_VISIBLE_DEVICES'] == '2,3' and env['JAX_PLATFORMS'] == 'cuda'


class _Exited:
  """A process of the job that has exited with `code` (for the supervisor's bookkeeping)."""

  def __init__(self, code: int, pid: int = 1):
    self.returncode, self.pid = code, pid

  def poll(self):
    return self.returncode

  wait = poll


def test_a_stop_by_ctrl_c_ends_with_a_closing_line_and_a_history_row(tmp_path, capsys):
  run = tmp_path / 'run'
  run.mkdir()
  sup = supervisor.Supervisor(launch.parse_args(['-n', '2', '--', '--out', str(run)]))
  sup.procs = {0: _Exited(STOPPED), 1: _Exited(STOPPED)}
  sup.interrupted = 'SIGINT'
  sup._ask_stop()
  assert sup._watch() == STOPPED
  last = capsys.readouterr().err.splitlines()[-1]
  assert 'job stopped by SIGINT (exit 143) after 0 death(s), 0 rejoin(s), 0 restart(s); resume ' \
         'it with the same command' in last, last
  [end] = [line for line in history.read(run) if line.kind is Kind.LAUNCH_END]
  assert end.code == STOPPED
  # A stop of the job's own (--stop-after): its closing line says it stopped, not ended.
  sup.interrupted = None
  assert sup._finished({0: STOPPED, 1: STOPPED}) == STOPPED
  assert 'job stopped (exit 143) after 0 death(s)' in capsys.readouterr().err


def test_an_abort_waits_for_the_death_that_caused_it(tmp_path, capsys, monkeypatch):
  """gloo aborts a survivor whose peer died in a collective (SIGABRT), and a transport may see
  that abort a look before the peer's own death (a loaded suite run on Ray took host 0 for the
  dead one after host 1's SIGKILL): the death that is no abort is the one restarted for; an
  abort alone counts once no other death showed within the wait."""
  run = tmp_path / 'run'
  run.mkdir()
  sup = supervisor.Supervisor(launch.parse_args(['-n', '3', '--', '--out', str(run)]))
  restarted = []
  monkeypatch.setattr(sup, '_without', restarted.append)
  sup.procs = {0: _Exited(-signal.SIGABRT), 1: _Exited(None), 2: _Exited(None)}
  assert sup._watch() is None and restarted == []  # an abort alone: the cause may follow
  sup.procs[1] = _Exited(-signal.SIGKILL, pid=11)
  assert sup._watch() is None and restarted == [1]
  assert 'host 1 (pid 11) died (killed by SIGKILL)' in capsys.readouterr().err
  sup.procs, sup.abort_since = {0: _Exited(-signal.SIGABRT), 1: _Exited(None)}, None
  assert sup._watch() is None and restarted == [1]
  sup.abort_since -= supervisor._ABORT_WAIT_S + 1  # no other death within the wait
  assert sup._watch() is None and restarted == [1, 0] and sup.deaths == 2


# An abort's last words, as jax 0.10.2 on CPU writes them (run here): the coordination service's
# in a process whose peer stopped sending heartbeats, gloo's in a collective with a dead peer.
_SERVICE_WORDS = ('E1129 17:47:31.543612   29669 coordination_service_agent.cc:289] Polled an '
                  'error from coordination service (this can be an error from this or another '
                  "task).\nterminate called after throwing an instance of 'std::bad_cast'\n")
_GLOO_WORDS = ("terminate called after throwing an instance of 'gloo::IoException'\n  what():  "
               '[gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:41233\n')


def test_an_abort_a_peers_death_caused_waits_for_that_death_seen_30_s_later(
    tmp_path, capsys, monkeypatch):
  """A dead process on another machine shows late (Ray notices a lost node by its health checks,
  up to half a minute), its survivors' aborts at once: an abort whose last words say a peer died
  is a survivor's, whatever order the exits show in, and the death restarted for is the one
  that shows 30 s later; an abort without such words is a death of its own."""
  run = tmp_path / 'run'
  run.mkdir()
  sup = supervisor.Supervisor(launch.parse_args(['-n', '3', '--', '--out', str(run)]))
  sup.args.log_dir.mkdir(parents=True)
  now = [1000.0]
  monkeypatch.setattr(supervisor.time, 'monotonic', lambda: now[0])
  restarted = []
  monkeypatch.setattr(sup, '_without', restarted.append)
  (sup.args.log_dir / 'host0.log').write_text('step 40 ...\n' + _SERVICE_WORDS)
  (sup.args.log_dir / 'host2.log').write_text(_GLOO_WORDS)
  sup.procs = {0: _Exited(-signal.SIGABRT), 1: _Exited(None), 2: _Exited(-signal.SIGABRT)}
  for _ in range(30):  # a look each second for 30 s: the survivors wait for the death
    assert sup._watch() is None and restarted == [] and sup.deaths == 0
    now[0] += 1.0
  sup.procs[1] = _Exited(-signal.SIGKILL, pid=11)
  assert sup._watch() is None and restarted == [1]
  assert 'host 1 (pid 11) died (killed by SIGKILL)' in capsys.readouterr().err
  # An abort of its own (a runtime's check failed): the death, once none other shows in 5 s.
  (sup.args.log_dir / 'host0.log').write_text('F1129 cuda_executor.cc:211] Check failed\n')
  sup.procs, sup.abort_since = {0: _Exited(-signal.SIGABRT), 1: _Exited(None)}, None
  sup.outputs = job_rules.Outputs(sup.args.log_dir)  # the next job's
  assert sup._watch() is None and restarted == [1]
  now[0] += supervisor._ABORT_WAIT_S + 1
  assert sup._watch() is None and restarted == [1, 0] and sup.deaths == 2


@pytest.mark.parametrize('state, train_args, resuming', [
    (None, [], False), ('stopped', [], True), ('finished', [], False),
    ('stopped', ['--fresh'], False), (None, ['--resume'], True)])
def test_a_start_line_says_when_the_job_resumes_the_run(tmp_path, state, train_args, resuming):
  run = tmp_path / 'run'
  run.mkdir()
  if state:
    write_run_state(run, RunState(state, run_id='r'))
  sup = supervisor.Supervisor(launch.parse_args(['-n', '2', '--', '--out', str(run), *train_args]))
  assert sup._resuming() is resuming
  sup.resume = True  # a restart resumes the run where one exists, else starts it anew
  assert sup._resuming() is (state is not None)
  restart_args = sup._train_args()
  assert ('--resume' in restart_args) is (state is not None) and '--fresh' not in restart_args


def test_a_job_that_stopped_itself_while_its_supervisor_was_stopped_is_taken_back(tmp_path,
                                                                                  capsys):
  run = tmp_path / 'run'
  run.mkdir()
  write_run_state(run, RunState('stopped', run_id='r'))
  sup = supervisor.Supervisor(launch.parse_args(['-n', '2', '--', '--out', str(run)]))
  starts = []
  sup.start = lambda: starts.append(sup._train_args())
  sup.procs = {0: _Exited(STOPPED), 1: _Exited(STOPPED)}
  history.append(run, Kind.STOP, step=41, why=f'the supervisor (pid {os.getpid()}) has been '
                                              'stopped for 30 s', saved=[])
  assert sup._watch() is None and starts == [['--out', str(run), '--resume']]
  assert 'the job stopped itself after step 41 while this supervisor was stopped' in \
      capsys.readouterr().err
  # Another supervisor's stop, or the user's (--stop-after): the job ends as it stopped.
  history.append(run, Kind.STOP, step=50, why='--stop-after 50', saved=[])
  assert sup._watch() == STOPPED and len(starts) == 1
  # The record is process 0's: where another process asked first it names no supervisor, and
  # the supervisor's own gap between two looks (it was stopped) says it.
  history.append(run, Kind.STOP, step=60, why='a stop agreed by the job', saved=[])
  sup.looked_at -= sup.args.stopped_s + 1
  assert sup._watch() is None and len(starts) == 2


def test_what_a_run_has_saved_is_read_from_its_tiers_and_empty_tmpfs_folders_go(tmp_path,
                                                                               monkeypatch):
  """The supervisor's line after a stop at once: the newest step complete on every host (a
  manifest each), the newest durable checkpoint with its manifest; its sweep at the end."""
  run, shm = tmp_path / 'run', tmp_path / 'shm'
  run.mkdir()
  assert run_dir.newest(run) == (None, None)  # no run yet
  write_run_state(run, RunState('stopped', run_id='r',
                         config={'snapshot': {'dir': str(shm), 'durable_dir': ''}}))
  assert 'no snapshot of this run is complete' in run_dir.describe(run)
  for host, steps in ((0, (4, 5)), (1, (4,))):  # host 1 never finished step 5
    for step in steps:
      (shm / 'r' / f'host{host}' / str(step)).mkdir(parents=True)
      (shm / 'r' / f'host{host}' / str(step) / 'mecefo_manifest.json').write_text('{}')
  (run / 'checkpoints' / 'r' / '3').mkdir(parents=True)
  (run / 'checkpoints' / 'r' / '3' / 'mecefo_manifest.json').write_text('{}')
  (run / 'checkpoints' / 'r' / '5').mkdir()  # no manifest: an unfinished save
  assert run_dir.newest(run) == (4, 3)
  assert run_dir.describe(run).startswith('the newest complete in-memory snapshot is step 4, '
                                          'the newest durable checkpoint step 3: a resume '
                                          'continues from step 4')
  # The sweep: the default tmpfs folder of the run directory loses its empty folders only.
  root = tmp_path / 'tmpfs' / 'mecefo' / run_dir.run_name(run)
  monkeypatch.setattr(run_dir.files, 'default_snapshot_dir', lambda name: root.parent / name)
  (root / 'killed-start').mkdir(parents=True)
  (root / 'kept' / '7').mkdir(parents=True)
  (root / 'kept' / '7' / 'data').write_text('x')
  run_dir.sweep_empty_memory_dirs(run)
  assert sorted(p.name for p in root.iterdir()) == ['kept']
