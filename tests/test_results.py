"""Generated docs (benchmarks.md's tables, README's results, failures.md's and limitations.md's
figures) match docs/results/*.json; each result's provenance."""
import json
import re
import subprocess

import pytest

from benchmarks import results, results_limits

RECORDED = ('date', 'device', 'commit', 'command')


@pytest.fixture(scope='module')
def loaded():
  return results.load()


def test_every_result_records_its_date_machine_commit_and_command(loaded):
  assert loaded, 'no docs/results/*.json'
  for name, d in loaded.items():
    missing = [k for k in RECORDED if not d.get(k)]
    assert not missing, f'{name} lacks {missing}'
    assert d['command'].startswith('python -m benchmarks.'), (name, d['command'])
    results.kind_of(name)  # a renderer for every file: none is left out of the page


def _commit_exists(sha: str) -> bool:
  return subprocess.run(['git', 'cat-file', '-e', f'{sha}^{{commit}}'], cwd=results.ROOT,
                        capture_output=True).returncode == 0


def test_every_result_names_a_commit_of_this_history_and_the_file_its_command_wrote(loaded):
  """Provenance: the commit a result was measured on is in this repository's history, and the
  file is what its command's --json wrote, or says it is a copy of it (`copied_from`)."""
  for name, d in loaded.items():
    sha = d['commit'].removesuffix('-dirty')
    assert re.fullmatch(r'[0-9a-f]{40}', sha) and _commit_exists(sha), (name, d['commit'])
    written = re.search(r'--json[ =](\S+)', d['command'])
    assert written, f'{name}: its command writes no --json'
    assert written[1] == f'docs/results/{name}' or d.get('copied_from') == written[1], \
        f'{name}: its command wrote {written[1]}; say so with "copied_from"'


def test_docs_benchmarks_md_tables_are_generated_from_the_json(loaded):
  """A figure changed by hand in a table, or a JSON changed without rerunning the command, fails
  here: `python -m benchmarks.results` rewrites them. Every JSON file has its row."""
  text = results.PAGE.read_text()
  assert results.page(text, loaded) == text, \
      'docs/benchmarks.md is stale: run python -m benchmarks.results'
  for name in loaded:
    assert f'| [{name}](results/{name}) |' in text, name
  tables = [line for line in text.splitlines() if line.startswith('|---')]
  assert len(tables) == len(results.KINDS)  # no table on the page but the generated ones


def test_readmes_results_table_is_generated_from_the_json(loaded):
  text = results.README.read_text()
  assert results.with_readme_table(text, results.readme_table(loaded)) == text, \
      'README.md results table is stale: run python -m benchmarks.results'


def test_a_changed_figure_makes_the_page_stale(loaded):
  """The check can fail: one number moved in one JSON changes the rendered page."""
  changed = json.loads(json.dumps(loaded))
  changed['step_cost_llama_60m.json']['time_ratio'] += 0.5
  text = results.PAGE.read_text()
  assert results.page(text, changed) != results.page(text, loaded)
  assert results.readme_table(changed) != results.readme_table(loaded)


def test_failures_md_trace_replay_table_is_generated_from_the_json(loaded):
  text = results.FAILURES.read_text()
  assert results.with_trace_table(text, results.trace_table(loaded)) == text, \
      'docs/failures.md trace replay table is stale: run python -m benchmarks.results'
  changed = json.loads(json.dumps(loaded))
  name = next(n for n in changed if n.startswith('trace_goodput_'))
  changed[name]['by_profile']['spread']['fast']['goodput_pct'] += 1.0
  assert results.trace_table(changed) != results.trace_table(loaded)


def test_readme_rows_come_from_clean_commits(loaded):
  """A README row is a headline: measured on a commit with no uncommitted change."""
  for name, _, _ in results.README_ROWS:
    assert not loaded[name]['commit'].endswith('-dirty'), f'{name}: measured on a -dirty tree'


def test_limitations_md_figures_are_generated_from_the_json(loaded):
  """docs/limitations.md's measured figures are spans read from the JSON; a moved figure in a
  JSON changes them (once hand-typed, one had drifted: budget:1.0's 97.05% given as 97.1%)."""
  text = results_limits.LIMITATIONS.read_text()
  assert results_limits.limitations(text, loaded) == text, \
      'docs/limitations.md is stale: run python -m benchmarks.results'
  changed = json.loads(json.dumps(loaded))
  changed[results_limits.TRACE]['approaches']['spread']['goodput_pct'] += 1.0
  assert results_limits.limitations(text, changed) != text
