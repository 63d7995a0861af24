"""One-line errors of train.py and its tools, Ctrl-C, strict JSON outputs, packaging."""
import dataclasses
import json
import math
import os
import re
import runpy
import signal
import subprocess
import sys
import time
import types
import typing
from pathlib import Path

import pytest

from mecefo_jax import install, sections
from mecefo_jax.config import Config, ConfigError, load_config, rule_of
from mecefo_jax.records import job
from mecefo_jax.run import cli, ending, plot, report_schema, stop
from mecefo_jax.records.metrics import EvalRow, TrainRow
from mecefo_jax.run.metrics import MetricsWriter, to_json
from mecefo_jax.records.run_state import RunState, read_run_state, write_run_state
from mecefo_jax.run.parts import StartMode
from procs import ROOT, TINY, error_lines, wait_for

RUN = (*TINY, 'mesh.slice=1', 'train.compile_cache=')


def _main(capsys, *argv, main=cli.main):
  """(exit code, stderr) of a command line run in this process (argparse exits included)."""
  try:
    code = main([str(a) for a in argv])
  except SystemExit as stop:
    code = stop.code
  return types.SimpleNamespace(returncode=code, stderr=capsys.readouterr().err)


def _one_error(proc, needle: str, code: int = 2) -> None:
  """Exit `code`, exactly one `error:` line holding `needle`, and no traceback."""
  lines = error_lines(proc.stderr)
  assert proc.returncode == code, proc.stderr[-2000:]
  assert len(lines) == 1 and needle in lines[0], proc.stderr[-2000:]
  assert 'Traceback' not in proc.stderr, proc.stderr[-2000:]


# ---- command line and config: one line each --------------------------------------------------

@pytest.mark.parametrize('make_out, needle', [
    (lambda tmp: tmp / 'file.txt', 'exists and is not a directory'),
    (lambda tmp: tmp / 'file.txt' / 'run', 'cannot create run directory'),
    pytest.param(lambda tmp: Path('/proc/mecefo-x'), "cannot create run directory '/proc/mecefo-x'",
                 marks=pytest.mark.skipif(not os.path.isdir('/proc'), reason='no /proc')),
])
def test_unusable_out_fails_in_one_line(tmp_path, capsys, make_out, needle):
  (tmp_path / 'file.txt').write_text('not a directory')
  proc = _main(capsys, '--out', make_out(tmp_path), '--no-snapshots', 'train.steps=2', *RUN)
  _one_error(proc, needle)


def test_yaml_syntax_errors_fail_in_one_line(tmp_path, capsys):
  bad = tmp_path / 'bad.yaml'
  bad.write_text('model: {d_model: 32\ntrain: [\n')
  _one_error(_main(capsys, '--config', bad, '--print-config'),
             f"config file '{bad}' is not valid YAML (line ")
  _one_error(_main(capsys, 'train.steps=[1,', '--print-config'),
             "override 'train.steps=[1,' is not valid YAML")


def test_an_empty_config_or_a_section_given_twice_fails_in_one_line(tmp_path, capsys):
  """Neither trains something the user did not ask for: an empty file would train Config()'s
  defaults (not `tiny`), and PyYAML alone keeps only the second of two `train:` sections."""
  empty, twice = tmp_path / 'empty.yaml', tmp_path / 'twice.yaml'
  empty.write_text('# settings to come\n')
  twice.write_text('train: {steps: 3}\nmodel: {d_model: 32}\ntrain: {seed: 1}\n')
  _one_error(_main(capsys, '--config', empty, '--print-config'),
             f"config file '{empty}' holds no settings (empty)")
  _one_error(_main(capsys, '--config', twice, '--print-config'),
             f"config file '{twice}' gives 'train' twice (line 3)")
  _one_error(_main(capsys, 'train={steps: 1, steps: 2}', '--print-config'),
             "gives 'steps' twice")
  ok = tmp_path / 'ok.yaml'  # each section once: loads
  ok.write_text('train: {seed: 3}\nfaults: {failures: none}\nsnapshot: {enabled: false}\n')
  assert load_config(ok).train.seed == 3


def test_binary_config_trace_and_text_data_fail_in_one_line(tmp_path, capsys):
  blob = tmp_path / 'blob.bin'
  blob.write_bytes(bytes(range(256)) * 4)
  _one_error(_main(capsys, '--config', blob, '--print-config'), 'is not UTF-8 text')
  run = ('--no-snapshots', '--out', tmp_path / 'run', 'train.steps=2', *RUN)
  _one_error(_main(capsys, '--failures', f'trace:{blob}', *run),
             f"failure trace '{blob}' is not UTF-8 text")
  _one_error(_main(capsys, '--data', f'text:{blob}', *run),
             f"text:{blob}: file '{blob}' is not UTF-8 text (byte 0); is it a binary file?")


def test_a_directory_as_config_or_trace_says_so_and_a_traces_slice_names_its_line(tmp_path,
                                                                                  capsys):
  from mecefo_jax.core.failures import FailureSchedule
  _one_error(_main(capsys, '--config', tmp_path, '--print-config'),
             f"config file '{tmp_path}' is a directory; give the file itself")
  with pytest.raises(ConfigError, match=re.escape(f"failure trace '{tmp_path}' is a directory")):
    FailureSchedule.from_trace(tmp_path, 2)
  with pytest.raises(ConfigError, match=re.escape(f"failure trace '{tmp_path / 'no'}' not found")):
    FailureSchedule.from_trace(tmp_path / 'no', 2)
  trace = tmp_path / 'trace.txt'
  trace.write_text('# step slice kind\n3 1 fail\n5 2 fail\n')
  with pytest.raises(ConfigError) as err:
    FailureSchedule.from_trace(trace, 2)
  assert str(err.value) == f'{trace}:3: failure event slice 2 out of range [0, 2)'


def test_refused_starts_leave_no_directory_they_made(tmp_path, capsys):
  from mecefo_jax.config import to_dict
  from mecefo_jax.run.trainer import Trainer
  _one_error(_main(capsys, '--out', tmp_path / 'a' / 'run', '--data', f'text:{tmp_path / "no"}',
                   f'snapshot.dir={tmp_path / "shm"}', 'train.steps=2', *RUN), 'path not found')
  assert sorted(tmp_path.iterdir()) == []  # neither the run directory nor its parent
  # A refusal after the snapshot tiers were opened (their run's directories made): none stays.
  cfg = load_config(None, [*RUN, f'snapshot.dir={tmp_path / "shm"}', 'train.steps=2'])
  run = tmp_path / 'run'
  run.mkdir()
  write_run_state(run, RunState('stopped', run_id='abc', config=to_dict(cfg)))
  with pytest.raises(ConfigError, match='^resume=True: no usable snapshot or checkpoint'):
    Trainer(cfg, run, progress='quiet', start=StartMode(resume=True, explicit_resume=True))
  assert sorted(p.name for p in run.iterdir()) == ['.lock', 'run_state.json']  # no checkpoints/
  assert not (tmp_path / 'shm').exists()
  with pytest.raises(ConfigError, match='^resume=True: there is no run in'):
    Trainer(cfg, tmp_path / 'new', progress='quiet',
            start=StartMode(resume=True, explicit_resume=True))
  assert not (tmp_path / 'new').exists()


@pytest.mark.parametrize('override, needle', [
    ('train.seed=-1', "'train.seed' must be in [0, 2**63), got -1"),
    ('optimizer.lr=0', "'optimizer.lr' must be in (0, inf), got 0.0"),
    ('optimizer.lr=.nan', "'optimizer.lr' must be in (0, inf), got nan"),
    ('optimizer.b1=1', "'optimizer.b1' must be in [0, 1), got 1.0"),
    ('optimizer.b2=-0.1', "'optimizer.b2' must be in [0, 1), got -0.1"),
    ('optimizer.warmup_steps=-1', "'optimizer.warmup_steps' must be >= 0, got -1"),
    ('optimizer.grad_clip=-1', "'optimizer.grad_clip' must be in [0, inf) (0 disables"),
    ('faults.cluster_step_s=.inf', "'faults.cluster_step_s' must be in (0, inf), got inf"),
])
def test_bad_values_fail_at_validation_in_one_line(capsys, override, needle):
  _one_error(_main(capsys, override, '--print-config'), needle)


def test_every_float_key_refuses_nan_and_inf_except_time_budget_inf():
  floats = [f'{name}.{key}' for name, section in typing.get_type_hints(Config).items()
            for key, typ in typing.get_type_hints(section).items() if typ is float]
  unbounded = [key for key in floats if rule_of(key).bounds is None]
  assert not unbounded, f'float keys without a declared range: {unbounded}'
  for key in floats:
    for value in ('.nan', '.inf', '-.inf'):
      if key == 'faults.time_budget' and value == '.inf':
        assert math.isinf(load_config(None, [f'{key}={value}']).faults.time_budget)
        continue
      with pytest.raises(ConfigError, match=re.escape(f"config key '{key}' must be in")):
        load_config(None, [f'{key}={value}'])


@pytest.mark.parametrize('value', ['-2', '0'])
def test_host_devices_must_be_positive(capsys, value):
  _one_error(_main(capsys, '--host-devices', value, '--print-config'),
             f'argument --host-devices: must be >= 1, got {value}')


def test_one_slice_with_a_failure_preset_warns_at_start(tmp_path, capsys, caplog):
  proc = _main(capsys, '--out', tmp_path / 'run', '--no-snapshots', '--failures', 'high',
               'train.steps=2', *RUN)
  assert proc.returncode in (0, 3), proc.stderr[-2000:]
  assert 'one slice: a failure leaves no live slice to take over' in caplog.text


def test_resuming_a_finished_run_says_there_is_nothing_to_do(tmp_path, capsys):
  run = ('--out', tmp_path / 'run', f'snapshot.dir={tmp_path / "shm"}', 'train.steps=2', *RUN)
  assert _main(capsys, *run).returncode == 0
  report = (tmp_path / 'run' / 'report.json').read_bytes()
  proc = _main(capsys, '--resume', '--quiet', *run)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stderr.splitlines()[-1] == (
      f"nothing to do: the run in {tmp_path / 'run'} has trained its train.steps=2 steps; pass a "
      'larger train.steps to train on')
  assert not any(line.startswith('done:') for line in proc.stderr.splitlines()), proc.stderr
  assert (tmp_path / 'run' / 'report.json').read_bytes() == report  # not overwritten
  assert not (tmp_path / 'shm').exists()  # no in-memory tier left behind
  # Stopped (SIGTERM) in its last step: resumed, it finishes (final eval, report).
  state = read_run_state(tmp_path / 'run')
  write_run_state(tmp_path / 'run', dataclasses.replace(state, status='stopped'))
  proc = _main(capsys, '--resume', '--quiet', *run)
  assert proc.returncode == 0 and proc.stderr.splitlines()[-1].startswith('done: 2 steps, ')
  assert read_run_state(tmp_path / 'run').status == 'finished'


def test_the_closing_line_says_whether_the_run_finished_or_stopped(tmp_path):
  # The keys of report.json (report_schema.Report) that the line reads.
  report = types.SimpleNamespace(
      steps=40, first_loss=5.0, final_loss=3.0, eval_loss=None, eval_perplexity=None,
      entropy_floor=None, wall_s=2.0, tokens_per_s=10.0, stopped=None, diverged_at_step=None,
      config={'train': {'steps': 40}})
  assert ending.summary(report, tmp_path).startswith('done: 40 steps, loss 5.0000 -> 3.0000, ')
  report.stopped = 'stopped by SIGINT (Ctrl-C) after 40 steps, ...'
  report.config = {'train': {'steps': 60}}
  assert ending.summary(report, tmp_path).startswith('stopped: 40 of 60 steps, loss 5.0000 -> ')


def test_resume_and_fresh_together_are_refused(capsys):
  _one_error(_main(capsys, '--resume', '--fresh', '--print-config'),
             'argument --fresh: not allowed with argument --resume')


def test_default_config_does_not_depend_on_the_cwd(tmp_path, capsys, monkeypatch):
  assert cli.main(['--config', str(ROOT / 'configs' / 'tiny.yaml'), '--print-config']) == 0
  explicit = capsys.readouterr().out
  monkeypatch.chdir(tmp_path)
  assert cli.main(['--print-config']) == 0
  assert capsys.readouterr().out == explicit and 'steps: 300' in explicit


# ---- report_schema and strict JSON -----------------------------------------------------------

def test_report_schema_cli_missing_or_bad_input_in_one_line(tmp_path, capsys):
  check = lambda path: _main(capsys, path, main=report_schema.main)
  _one_error(check(tmp_path / 'missing'), 'missing: not found')
  _one_error(check(tmp_path), f'{tmp_path}/report.json: not found')
  (tmp_path / 'report.json').write_text('{"steps": NaN}')
  _one_error(check(tmp_path), 'bare NaN is not JSON')


def test_to_json_writes_null_for_non_finite_floats():
  np = pytest.importorskip('numpy')
  row = {'loss': math.nan, 'pair': (1, -math.inf), 'x': np.float32('inf'), 'n': np.int64(3),
         'ok': 1.5, 'nested': [{'v': math.inf}]}
  text = to_json(row)
  assert json.loads(text, parse_constant=lambda c: pytest.fail(f'bare {c}')) == {
      'loss': None, 'pair': [1, None], 'x': None, 'n': 3, 'ok': 1.5, 'nested': [{'v': None}]}
  assert to_json({'a': 1}, indent=2) == json.dumps({'a': 1}, indent=2)


def test_a_diverged_run_stops_with_one_line_and_keeps_only_finite_snapshots(tmp_path, capsys,
                                                                             caplog):
  out, shm = tmp_path / 'run', tmp_path / 'shm'
  proc = _main(capsys, '--out', out, 'optimizer.lr=1e9', 'optimizer.warmup_steps=0',
               'train.steps=20', 'snapshot.every=1', f'snapshot.dir={shm}', *RUN)
  lines = [r for r in caplog.messages if 'the training loss and gradient norm are not finite' in r]
  assert proc.returncode == 4 and len(lines) == 1, caplog.text[-2000:]
  report = json.loads((out / 'report.json').read_text())  # strict JSON (json.loads allows NaN)
  step = report['diverged_at_step']
  assert step is not None and report['stopped'] and report['final_loss'] is not None
  assert report['snapshots']['retained_steps'] and max(report['snapshots']['retained_steps']) <= step
  assert all(math.isfinite(loss) for _, loss in report['losses'])
  assert json.loads((out / 'run_state.json').read_text())['status'] == 'stopped'


def test_metrics_jsonl_is_strict_json(tmp_path):
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.write(TrainRow(step=0, degraded_tokens=0.0, exact_tokens=64.0, grad_norm=math.inf,
                          loss=math.nan, wall_s=0.1, live_slices=1, tokens_per_s=100.0))
  line = (tmp_path / 'metrics.jsonl').read_text()
  assert 'NaN' not in line and 'Infinity' not in line
  assert json.loads(line)['loss'] is None


def test_schema_floats_are_finite_and_losses_nullable():
  found = []
  sections.check(float, math.nan, 'wall_s', found)
  assert found and 'expected a finite float' in found[0]
  found = []
  losses = typing.get_type_hints(report_schema.Report)['losses']
  sections.check(losses, [[0, None], [1, 2.5]], 'losses', found)
  assert found == []


# ---- plot: one run or a comparison -----------------------------------------------------------

def _fake_run(directory: Path, losses) -> Path:
  directory.mkdir(parents=True)
  rows = [TrainRow(step=10 * i, degraded_tokens=0.0, exact_tokens=64.0, grad_norm=1.0,
                   loss=loss, wall_s=0.1 * (i + 1), live_slices=1, tokens_per_s=100.0)
          for i, loss in enumerate(losses)]
  rows.append(EvalRow(10 * (len(losses) - 1), losses[-1] + 0.1, math.exp(losses[-1] + 0.1),
                      eval_s=0.1, wall_s=0.1 * len(losses), live_slices=1))
  (directory / 'metrics.jsonl').write_text(''.join(to_json(sections.to_json(r)) + '\n'
                                                   for r in rows))
  (directory / 'report.json').write_text(to_json({'steps': 10 * len(losses), 'losses': []}))
  return directory


def test_plot_compares_several_runs_on_one_figure(tmp_path, capsys):
  a = _fake_run(tmp_path / 'runs' / 'neighbor', [5.0, 4.0, 3.2, 2.9])
  b = _fake_run(tmp_path / 'runs' / 'spread', [5.1, 3.9, None, 2.8])  # null: a NaN loss
  png = tmp_path / 'compare.png'
  assert plot.main([str(a), str(b), '--out', str(png)]) == 0
  assert capsys.readouterr().out.strip() == str(png)
  assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  assert plot._labels([a, b]) == ['neighbor', 'spread']
  assert plot._labels([a, tmp_path / 'other' / 'neighbor'])[0] == str(a)  # same name: the path


def test_plot_several_runs_need_out(tmp_path, capsys):
  a, b = _fake_run(tmp_path / 'a', [3.0, 2.0]), _fake_run(tmp_path / 'b', [3.0, 2.5])
  assert plot.main([str(a), str(b)]) == 2
  assert capsys.readouterr().err.strip() == 'error: comparing 2 runs needs --out PNG'
  assert plot.main([str(a), str(tmp_path / 'missing'), '--out', str(tmp_path / 'x.png')]) == 2
  assert f'{tmp_path / "missing"}: no such run directory' in capsys.readouterr().err


def test_a_benchmark_run_as_a_file_says_in_one_line_to_run_it_as_a_module(monkeypatch):
  scripts = [p for p in sorted((ROOT / 'benchmarks').glob('*.py'))
             if "if __name__ == '__main__':" in p.read_text()]
  assert len(scripts) >= 9, scripts
  for script in scripts:  # as `python benchmarks/NAME.py --help` runs it (__package__ unset)
    monkeypatch.setattr(sys, 'argv', [str(script), '--help'])
    with pytest.raises(SystemExit) as stop:
      runpy.run_path(str(script), run_name='__main__')
    assert stop.value.code == ('error: run it from the repository root as python -m '
                               f'benchmarks.{script.stem}'), script


# ---- Ctrl-C (train.py's SIGTERM and Ctrl-C stops share one handler: tests/test_recovery.py) --

def test_ctrl_c_without_snapshots_is_one_line(launcher, tmp_path):
  out = tmp_path / 'run'
  proc = launcher.start([sys.executable, 'train.py', '--out', out, *TINY, 'mesh.slice=1',
                         '--no-snapshots', 'train.steps=100000', 'train.log_every=1'],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  metrics = out / 'metrics.jsonl'
  wait_for(lambda: metrics.is_file() and '"step": 2,' in metrics.read_text(), 180, 'step 2', proc)
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  _one_error(types.SimpleNamespace(returncode=proc.returncode, stderr=err), 'interrupted (Ctrl-C)',
             code=128 + signal.SIGINT)


def test_first_ctrl_c_stops_after_the_step_and_a_second_interrupts_at_once(caplog, tmp_path):
  # Python's own SIGINT handler is there to be replaced (tests/conftest.py: a suite started in
  # the background inherits SIGINT ignored, which install() keeps ignored, by design).
  request = stop.StopRequest(out_dir=tmp_path)
  request.install()
  try:
    assert not request.due(1)
    os.kill(os.getpid(), signal.SIGINT)  # the handler runs in this thread, here
    wait_for(lambda: request, 5, 'the first SIGINT handled')
    assert request.reason == 'SIGINT (Ctrl-C)' and request.due(1)
    assert caplog.messages == ['SIGINT (Ctrl-C): stopping after this step']
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(5)
  finally:
    request.uninstall()


def test_a_stop_comes_from_stop_after_or_the_request_file_once(tmp_path):
  request = stop.StopRequest(after_step=3)
  assert not request.due(2) and request.due(3) and request.reason == '--stop-after 3'
  request = stop.StopRequest(out_dir=tmp_path)
  assert not request.due(5)
  (tmp_path / job.STOP_FILE).write_text('the grow-back of host(s) [2]\n')
  assert request.due(6) and request.reason == 'the grow-back of host(s) [2]'
  assert not (tmp_path / job.STOP_FILE).exists()  # honoured once: the next start trains on


def test_exit_codes_are_the_documented_numbers():
  codes = {job.BAD_INPUT: 2, job.ALL_DOWN: 3, job.DIVERGED: 4,
           job.CHECKPOINTS_FAILING: 5, job.OUTPUTS_FAILING: 6,
           job.PEER_LOST: 7, job.STOPPED: 143,
           job.INTERRUPTED: 130}
  assert all(named == number for named, number in codes.items()), codes
  table = (ROOT / 'docs' / 'errors.md').read_text()
  assert all(f'| {number} |' in table for number in codes.values())
  assert set(job.JOB_EXITS) == {job.BAD_INPUT, job.ALL_DOWN, job.DIVERGED,
                                  job.CHECKPOINTS_FAILING, job.OUTPUTS_FAILING}


# ---- packaging -------------------------------------------------------------------------------

def test_pyproject_dependencies_match_requirements_txt():
  tomllib = pytest.importorskip('tomllib')  # Python >= 3.11
  project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
  runtime, test = map(set, install.sections((ROOT / 'requirements.txt').read_text()))
  assert {d.replace(' ', '') for d in project['dependencies']} == runtime
  assert {d.replace(' ', '') for d in project['optional-dependencies']['test']} == test
  assert any(r.startswith('xxhash') for r in runtime)
