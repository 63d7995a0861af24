"""Real multi-process runs on localhost (CPU, gloo): the death of a process, noticed by the
heartbeat, then the loss of every host's in-memory snapshot, survived through the durable tier
with the same params as one process (parity rebuilds, a process with no live slice, and a rejoin
across processes: tests/test_launch.py); and the multi-process helpers in one process."""
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jax.sharding import NamedSharding, PartitionSpec as P

from mecefo_jax import multihost, sharding
from mecefo_jax.config import load_config
from mecefo_jax.supervisor import free_port
from mecefo_jax.run import rundir
from mecefo_jax.records.job import DIVERGED, PEER_LOST
from mecefo_jax.records.run_dir import MANIFEST_NAME
from mecefo_jax.snapshot.aside import TEST_DELAY_ENV
from mecefo_jax.snapshot.capacity import TEST_DEV_FULL_ENV
from mecefo_jax.records.run_state import read_run_state
from mecefo_jax.run.hooks import TEST_POISON_ENV
from procs import report, wait_all

STEPS = 8
# Slice 3 fails at step 1 and is repaired at step 3: a failure and a rejoin within a process.
TRACE = '1 3 fail\n3 3 repair\n'
ARGS = ['mesh.slice=4', 'mesh.fsdp=2', 'mesh.ordered_reduce=true', f'train.steps={STEPS}',
        'train.log_every=1', 'train.micro_batch=4', 'model.n_layers=2', 'model.seq_len=16',
        'snapshot.every=1', 'train.eval_every=0', 'train.plot=false',
        # No supervisor: a death is resumed by the whole job, never by survivors, so the programs
        # of the survivors' job (built ahead with several processes) would go unused.
        'faults.precompile=never']


def _args(tmp: Path, out: str, *extra) -> list[str]:
  trace = tmp / 'trace.txt'
  trace.write_text(TRACE)
  return [*ARGS, f'--failures=trace:{trace}', '--out', str(tmp / out),
          f'snapshot.dir={tmp / (out + "_shm")}', *extra]


def _spawn(launcher, tmp: Path, out: str, n: int, *extra, heartbeat=100, env=None):
  """n local processes of one job (gloo on CPU), output in <out>_<i>.log; the suite's program
  store (a resume loads what the job before it compiled); `env`: more environment."""
  port = free_port()
  procs = []
  for i in range(n):
    log = open(tmp / f'{out}_{i}.log', 'ab')
    cmd = [sys.executable, 'train.py', f'--host-devices={8 // n}', f'--coordinator=localhost:{port}',
           f'--num-processes={n}', f'--process-id={i}', f'--heartbeat-s={heartbeat}',
           *_args(tmp, out, *extra)]
    procs.append(launcher.start(cmd, env=launcher.env(**(env or {})), stdout=log, stderr=log))
  return procs


def _memory_tier(tmp: Path) -> Path:
  """The in-memory snapshots of run 'run': one folder per run id under snapshot.dir."""
  return tmp / 'run_shm' / read_run_state(tmp / 'run').run_id


def _logs(tmp: Path, out: str, tail: int = 3000) -> str:  # tail=0: all
  return '\n'.join(p.read_text(errors='replace')[-tail:] for p in sorted(tmp.glob(f'{out}_*.log')))


@pytest.fixture(scope='module')
def reference(launcher, tmp_path_factory):
  """params_sha256 of the same run in one process with all 8 devices."""
  tmp = tmp_path_factory.mktemp('single')
  proc = launcher.train('--host-devices=8', *_args(tmp, 'run'), timeout=420)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return report(tmp / 'run')


def test_a_job_that_lost_every_tmpfs_resumes_from_its_durable_checkpoint(launcher, reference,
                                                                          tmp_path):
  """A death the heartbeat notices, then every host's in-memory parts lost (all hosts replaced)
  and a byte of the newest durable checkpoint flipped: process 0 sets that one aside (not
  deleted, nor any newer one the death left unfinished), the older durable checkpoint all processes wrote together is the newest usable
  state, and the records count the steps trained again from what the killed job had trained."""
  procs = _spawn(launcher, tmp_path, 'run', 2, 'snapshot.durable_every=2', heartbeat=5)
  metrics = tmp_path / 'run' / 'metrics.jsonl'
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline and procs[0].poll() is None:
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    if len(lines) >= 6:  # durable checkpoints 2 and 4 written
      break
    time.sleep(0.2)
  assert len(metrics.read_text().splitlines()) < STEPS, 'the run finished before it was killed'
  procs[1].send_signal(signal.SIGKILL)
  survivor = wait_all(procs[:1], 120)[0]
  # The survivor's next collective fails (gloo: the peer's connection is reset): it says so in
  # one line and exits at once; where it waited elsewhere, JAX's coordination service ends it
  # after the heartbeat timeout (it would otherwise wait forever).
  assert survivor != 0, _logs(tmp_path, 'run')
  text = _logs(tmp_path, 'run', tail=0)  # the service says it in one of two ways
  assert (survivor == PEER_LOST and 'error: host 0: a collective failed, a peer process of the '
          'job is gone' in text and 'Traceback' not in text or 'heartbeat timeout' in text or
          'stopped sending heartbeats' in text), text[-3000:]
  reached = rundir.read_reached(tmp_path / 'run')
  shutil.rmtree(_memory_tier(tmp_path))  # every host's parts: only the durable tier is left
  run_id = read_run_state(tmp_path / 'run').run_id
  complete = sorted(int(d.name) for d in (tmp_path / 'run' / 'checkpoints' / run_id).iterdir()
                    if d.name.isdigit() and (d / MANIFEST_NAME).exists())
  assert len(complete) >= 2, complete
  damaged = tmp_path / 'run' / 'checkpoints' / run_id / str(complete[-1])
  block = sorted((damaged / 'state').glob('ocdbt.process_*/d/*'))[0]
  data = bytearray(block.read_bytes())
  data[len(data) // 2] ^= 1
  block.write_bytes(bytes(data))
  codes = wait_all(_spawn(launcher, tmp_path, 'run', 2, 'snapshot.durable_every=2', '--resume'),
                   420)
  assert codes == [0, 0], _logs(tmp_path, 'run')
  assert 'resumed from the durable checkpoint' in _logs(tmp_path, 'run', tail=0)
  result = report(tmp_path / 'run')
  assert result['params_sha256'] == reference['params_sha256']
  step = result['resumed_from_step']
  # Process 0's report: the damaged checkpoint, and any newer one the killed job had not finished
  # (its manifest unwritten), each set aside where it can be put back from.
  moved = result['snapshots']['set_aside']
  assert all(m.startswith(str(tmp_path / 'run' / 'checkpoints' / 'set_aside' / run_id))
             and Path(m).is_dir() for m in moved), moved
  moved_steps = sorted(int(Path(m).name) for m in moved)
  assert moved_steps[0] == complete[-1] > step and set(moved_steps[1:]).isdisjoint(complete), (
      moved_steps, complete)
  assert step % 2 == 0 and result['steps_lost'] == reached - step >= 0, (step, reached, result)
  assert result['snapshots']['durable_retained_steps'][-1] == STEPS
  # Every process planned every step alike (the running hash of each one's plans).
  plans = [re.findall(r'plans: (\d+) steps, digest (\w+)', log.read_text(errors='replace'))[-1:]
           for log in sorted(tmp_path.glob('run_*.log'))]
  assert len(plans) == 2 and plans[0] and plans[0] == plans[1], plans


def test_a_rollback_past_a_durable_checkpoint_saves_it_again_on_every_process(launcher,
                                                                            reference, tmp_path):
  """Step 4 reads as diverged (the test hook): durable checkpoint 4 (of the state step 4 began
  from) is set aside by process 0 on --resume, which goes back to step 3. Every process must see
  it gone before step 4's durable save: one that still listed it skipped that save (Orbax's
  `should_save`) while the other waited in it (a hang the stall watch ended, seen in a soak;
  here, before the fix, the job hung until the test's timeout)."""
  poison = tmp_path / 'poison'
  poison.write_text('4')
  first = _spawn(launcher, tmp_path, 'run', 2, 'snapshot.durable_every=2',
                 env={TEST_POISON_ENV: str(poison)})
  assert wait_all(first, 420) == [DIVERGED, DIVERGED], _logs(tmp_path, 'run')
  checkpoints = tmp_path / 'run' / 'checkpoints' / read_run_state(tmp_path / 'run').run_id
  assert (checkpoints / '4' / MANIFEST_NAME).is_file()
  resume = _spawn(launcher, tmp_path, 'run', 2, 'snapshot.durable_every=2', '--resume',
                  env={TEST_DELAY_ENV: '3'})  # the move as slow as a bucket's: the other
  assert wait_all(resume, 240) == [0, 0], _logs(tmp_path, 'run')  # process lists 4 meanwhile
  result = report(tmp_path / 'run')
  assert result['resumed_from_step'] == 3, result['resumed_from_step']
  assert [Path(m).name for m in result['snapshots']['set_aside']] == ['4']
  assert (checkpoints / '4' / MANIFEST_NAME).is_file()  # written again, by this timeline
  assert result['params_sha256'] == reference['params_sha256']


def test_an_auto_interval_is_agreed_by_every_process(launcher, tmp_path):
  """snapshot.every=auto in a 2-process job: the processes propose at the same steps and take
  the larger interval, so both hosts keep their parts of the same steps."""
  steps = 30
  codes = wait_all(_spawn(launcher, tmp_path, 'auto', 2, f'train.steps={steps}',
                          'snapshot.every=auto', 'snapshot.max_every=3', 'snapshot.keep=3',
                          'snapshot.durable_every=0', 'snapshot.keep_when_finished=true'), 420)
  assert codes == [0, 0], _logs(tmp_path, 'auto')
  interval = report(tmp_path / 'auto')['snapshot_interval']
  # Saves every 3 steps at first (steps 3, 6, ...); a proposal every 4 save-to-save periods;
  # saves fall on the multiples of the interval in force: the 4th one after step 15 is next.
  every = interval['changes'][0][1]
  assert interval['auto'] and [s for s, _ in interval['changes']][:2] == [
      15, (15 // every + 4) * every], interval
  memory = tmp_path / 'auto_shm' / read_run_state(tmp_path / 'auto').run_id
  held = [sorted(int(p.name) for p in (memory / f'host{h}').iterdir() if p.name.isdigit())
          for h in (0, 1)]
  assert held[0] == held[1] and held[0][-1] == steps, held


# --- the same helpers in one process (fast): what a multi-process run builds on ---------------

@pytest.fixture(scope='module')
def slices(devices):
  """Logical slices 0..3 of 2 devices each."""
  cfg = load_config(None, ['mesh.slice=4', 'mesh.fsdp=2'])
  return sharding.PresentSlices(sharding.make_mesh(cfg.mesh), (0, 1, 2, 3))


def test_put_batch_makes_each_slices_rows_on_its_devices(slices):
  mesh = slices.sub((0, 2, 3))
  rows = np.arange(3 * 4 * 5, dtype=np.int32).reshape(3, 4, 5)
  batch = multihost.put_batch(rows.__getitem__, rows.shape, sharding.batch_sharding(mesh))
  np.testing.assert_array_equal(np.asarray(batch), rows)
  assert batch.sharding == sharding.batch_sharding(mesh) and multihost.is_local(mesh)
  assert not multihost.is_multiprocess() and multihost.first_process(mesh) == 0
  multihost.check_slices_within_processes(mesh)  # one process holds every slice


def test_rejoin_program_copies_a_live_slices_state_bit_exactly(slices):
  keep, live = (1, 3), (1, 2, 3)  # slice 2 rejoins
  x = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)
  state = {'w': jax.device_put(x, NamedSharding(slices.sub(keep), P('fsdp')))}
  target = {'w': NamedSharding(slices.sub(live), P('fsdp'))}
  copy = multihost.rejoin_copy(target, live.index(keep[0]))
  out = copy(multihost.stack_for_rejoin(state, target))['w']
  assert out.sharding == target['w'] and len(out.addressable_shards) == 6
  for shard in out.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), x[shard.index])


def test_fetch_and_gathers_in_one_process(slices):
  metrics = {'loss': jax.numpy.float32(2.5), 'grad_norm': jax.numpy.float32(1.0)}
  assert multihost.fetch(metrics, slices.mesh, keys=('loss', 'grad_norm'), stop=True) == {
      'loss': 2.5, 'grad_norm': 1.0, 'stop': 1.0}
  assert multihost.allgather_json({'a': [1]}) == [{'a': [1]}]
  for data in (b'', b'run', bytes(range(64)), bytes(range(65)), b'x' * 1000):
    assert multihost.broadcast_bytes(data, 0) == data  # sent padded, returned at its length
  # Payloads of any length up to 64 bytes share one program, then one per power of two.
  assert [multihost._padded_length(n) for n in (0, 1, 64, 65, 128, 129, 1000)] == [
      64, 64, 64, 128, 128, 256, 1024]


def test_a_job_whose_tmpfs_is_full_skips_its_parts_and_trains_on(launcher, reference, tmp_path):
  """Every host's in-memory part fails with ENOSPC (MECEFO_TEST_DEV_FULL=memory: a real write to
  /dev/full in each save; a full tmpfs needs a small mount and root): each process skips its
  parts with a warning and trains on, as one process does; the same params as one process,
  no leftovers in the tier."""
  procs = _spawn(launcher, tmp_path, 'run', 2, env={TEST_DEV_FULL_ENV: 'memory'})
  assert wait_all(procs, 420) == [0, 0], _logs(tmp_path, 'run')
  logs = [log.read_text(errors='replace') for log in sorted(tmp_path.glob('run_*.log'))]
  assert all('in-memory snapshot part skipped' in text for text in logs), _logs(tmp_path, 'run')
  assert all('Traceback' not in text for text in logs), _logs(tmp_path, 'run')
  result = report(tmp_path / 'run')
  assert result['params_sha256'] == reference['params_sha256']
  assert result['snapshots']['skipped'] >= 1
  tier = tmp_path / 'run_shm'
  assert not [p for p in tier.rglob('*') if 'orbax-checkpoint-tmp' in p.name], list(tier.rglob('*'))
