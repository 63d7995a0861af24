"""Runs a benchmark as its users do, `python -m benchmarks.NAME ARGS` from the repository root,
and checks the run metadata that every result JSON carries (commit, command, device, date)."""
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(name: str, *args, json_path) -> dict:
  """The result JSON of `python -m benchmarks.<name> *args --json json_path` (must exit 0)."""
  args = [*map(str, args), '--json', str(json_path)]
  proc = subprocess.run([sys.executable, '-m', f'benchmarks.{name}', *args], cwd=REPO,
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  result = json.loads(Path(json_path).read_text())
  assert result['command'] == shlex.join(['python', '-m', f'benchmarks.{name}', *args])
  assert result['commit'] is None or re.fullmatch(r'[0-9a-f]{40}(-dirty)?', result['commit'])
  device = result['device']
  assert device['platform'] == 'cpu' and device['device_kind'] and device['device_count'] >= 1
  assert device['host_cpu_count'] >= 1 and re.fullmatch(r'\d{4}-\d\d-\d\dT.*\+00:00', result['date'])
  return result
