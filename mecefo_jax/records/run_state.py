"""run_state.json: a run's status, identity, config and layout, the first thing a start reads."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mecefo_jax import files
from mecefo_jax.config import ConfigError
from mecefo_jax.sections import entry

RUN_STATE = 'run_state.json'
UNFINISHED = ('running', 'stopped')  # statuses a start resumes without being asked


@dataclasses.dataclass(frozen=True)
class ModelId:
  """The model a run trains: a resume with another parameter tree is refused."""
  kind: str = entry('', 'model.kind')
  tree: str = entry('', "digest of the model's parameter tree (its paths, shapes and dtypes)")


@dataclasses.dataclass(frozen=True)
class Diverged:
  """Where a run diverged (run/hooks.Divergence): a resume goes back to a snapshot of a step
  <= last_finite_step."""
  diverged_at_step: int = entry('step', 'the step whose training loss or gradient norm was not '
                                'finite')
  last_finite_step: int = entry('step', 'the last step seen with a finite loss and gradient norm')
  rollback_to: int | None = entry('step', 'the newest step <= it with a snapshot, null if none')


@dataclasses.dataclass(frozen=True)
class RunState:
  """run_state.json. Keys a run written by an earlier version may lack are optional."""
  status: str = entry('', "'running' until the run ends, then 'stopped' or 'finished'")
  run_id: str = entry('', "the run's id: its snapshots' and checkpoints' folder")
  config: dict[str, Any] | None = entry('', 'the config as given (auto stays auto)',
                                        optional=True)
  n_slices: int | None = entry('slices', 'data-parallel slices of the mesh', optional=True)
  model: ModelId | None = entry('', 'the model trained', optional=True)
  n_hosts: int | None = entry('hosts', 'processes that train it', optional=True)
  platform: str | None = entry('', 'the backend it trains on', optional=True)
  compute_dtype: str | None = entry('', 'model.compute_dtype resolved', optional=True)
  host_devices: int | None = entry('devices', 'simulated CPU devices a process had (CPU only)',
                                   optional=True)
  all_down_at: int | None = entry('step', 'every slice went down at this step: a resume brings '
                                  'them back there', optional=True)
  diverged: Diverged | None = entry('', 'where the run diverged; a resume goes back before it',
                                    optional=True)


def read_run_state(out_dir: Path) -> RunState | None:
  """The run_state.json of `out_dir`, None if there is none; one that cannot be read is a
  ConfigError naming the file and what to do (its snapshots and checkpoints are left alone)."""
  remedy = ('the run\'s snapshots and checkpoints are still there, but this start cannot tell '
            'which run they are: restore the file, or start anew with --fresh (or another '
            '--out)')
  return files.read_json(Path(out_dir) / RUN_STATE, RunState, remedy=remedy, error=ConfigError)


def unfinished(out_dir: Path) -> bool:
  """Whether `out_dir` holds a run that has not ended ('running' or 'stopped'): a start resumes
  it without being asked."""
  state = read_run_state(out_dir)
  return state is not None and state.status in UNFINISHED


def write_run_state(out_dir: Path, state: RunState) -> None:
  """Replaces run_state.json; on a full disk written over the old file's own bytes (it holds
  the same keys, so the status says the truth)."""
  path = Path(out_dir) / RUN_STATE
  text = files.json_text(state)
  try:
    files.replace_text(path, text)
  except OSError:
    if not files.overwrite_in_place(path, text):
      raise
