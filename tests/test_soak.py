"""The soak (benchmarks/soak.py) in its short form: each fault kind once, with a fixed seed, on a
tiny job; every record agrees with what it injected and with the one-process replay."""
import pytest

from benchmarks.soak_faults import KINDS
from procs import TINY


@pytest.mark.slow
def test_the_soak_injects_each_fault_once_and_every_record_agrees(launcher, tmp_path):
  # Two processes, not the soak's three: every fault still hits a host of a job with a
  # survivor (the job's steps cost a third less CPU; 76 vs 87 CPU s, one run each).
  result = launcher.benchmark('soak', '--rounds', '1', '--seed', '0', '--busy', '0', '--gap-s',
                              '0.5:1', '--rejoin-after', '1', '--processes', '2', '--program-store',
                              launcher.compile_cache, *TINY, json_path=tmp_path / 'soak.json')
  assert result['faults'] == dict.fromkeys(KINDS, 1), result['faults']
  assert result['hangs'] == 0 and result['disagreements'] == [], result['disagreements']
  assert result['sha_equal'] and result['replay']['samples_equal'], result['replay']
  assert result['leftovers'] == [] and result['ok'], result['leftovers']
  # Each fault's recovery timed: the first step of a job started after it.
  assert set(result['recovery_s']) >= {'kill', 'stop_worker', 'ctrl_c', 'divergence'}
  # The restarts after the death and the stall: how each got its programs.
  assert {r['cause'] for r in result['programs_per_restart']} >= {'death', 'stall'}
  if result['tmpfs'] != 'mounted':  # no privilege to mount: that fault said so, unchecked
    [full] = [f for f in result['injected'] if f['kind'] == 'full_tmpfs']
    assert full['note'].startswith(result['tmpfs'].removeprefix('not mounted: '))
