"""README.md as a front page: short, its set-up commands first, and every code block either run
here (at reduced steps), run by the test it names, or marked not run with why.

The marks are HTML comments on the line before a block: `<!-- not run: WHY -->` or
`<!-- run by tests/FILE.py::TEST (...) -->`; a block with no mark is run by
test_the_readmes_commands_run_at_reduced_steps. The README's test command is .ci/run's.
"""
import re
import shlex
import sys

from procs import ROOT, TINY, report

README = ROOT / 'README.md'
BLOCK = re.compile(r'(?:<!-- (not run|run by)[: ]\s*(.*?) -->\n)?```(\w*)\n(.*?)\n```', re.S)
HASH = re.compile(r'\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b')  # a commit id
RUNNABLE = (('python', 'train.py'), ('python', '-m', 'mecefo_jax.launch'), ('python', '-m', 'pytest'))


def blocks(text: str) -> list[tuple[str | None, str, str, str]]:
  """(mark, what the mark says, language, body) of every fenced block."""
  return [(m.group(1), m.group(2) or '', m.group(3), m.group(4)) for m in BLOCK.finditer(text)]


def commands(body: str) -> list[list[str]]:
  """The shell commands of a block as argv lists: comments dropped, continuations joined."""
  joined = re.sub(r'\\\n\s*', ' ', body)
  return [shlex.split(line, comments=True) for line in joined.splitlines()
          if shlex.split(line, comments=True)]


def ci_test_command() -> list[str]:
  """The test command .ci/run runs (`python -m pytest ...` before `|| status=$?`)."""
  line = re.search(r'^(python -m pytest[^|\n]*?)\s*\|\|', (ROOT / '.ci' / 'run').read_text(), re.M)
  assert line, '.ci/run runs no `python -m pytest` line'
  return shlex.split(line.group(1))


def to_run(text: str) -> list[list[str]]:
  return [cmd for mark, _, _, body in blocks(text) if mark is None for cmd in commands(body)]


def test_the_readme_is_a_front_page():
  text = README.read_text()
  lines = text.splitlines()
  assert len(lines) <= 200, f'README.md has {len(lines)} lines: the rest belongs in docs/'
  head = '\n'.join(lines[:30])
  assert 'python train.py' in head and 'python -m pytest -q' in head, 'set-up commands not first'
  assert not HASH.findall(text), f'a commit id in README.md: {HASH.findall(text)}'
  assert HASH.findall('at 9cfe818 and d33af66') == ['9cfe818', 'd33af66']


def test_every_block_is_run_or_says_why_not():
  text = README.read_text()
  found = blocks(text)
  assert len(found) == text.count('```') // 2, 'a block the pattern misses'
  for mark, why, lang, body in found:
    if mark == 'not run':
      assert len(why) > 20, f'say why this block is not run: {body[:80]!r}'
    elif mark == 'run by':
      file, _, name = why.split()[0].partition('::')
      assert (ROOT / file).is_file() and f'def {name}(' in (ROOT / file).read_text(), why
    else:
      assert lang == 'bash', f'an unmarked {lang!r} block: mark it or teach this test to run it'
      for cmd in commands(body):
        assert any(tuple(cmd[:len(p)]) == p for p in RUNNABLE), f'this test cannot run {cmd}'


def test_the_readmes_test_command_is_the_one_ci_runs():
  assert ci_test_command() in to_run(README.read_text())


def test_the_readmes_commands_run_at_reduced_steps(launcher, tmp_path):
  """Each command of an unmarked block as written, from an empty directory, with the tiny test
  model and 4 steps appended (the test command excepted: it is the suite this runs in)."""
  env = launcher.env(PYTHONPATH=str(ROOT))
  short = [*TINY, 'train.steps=4', 'train.eval_batches=1',
           f'snapshot.dir={tmp_path / "shm"}']
  ran = []
  for cmd in to_run(README.read_text()):
    if cmd == ci_test_command():
      continue
    assert cmd[0] == 'python'
    args = [sys.executable, *cmd[1:]]
    if cmd[1] == 'train.py':
      args[1] = str(ROOT / 'train.py')
    proc = launcher.run([*args, *short], timeout=420, cwd=tmp_path, env=env)
    assert proc.returncode == 0, (cmd, (proc.stdout + proc.stderr)[-3000:])
    out = cmd[cmd.index('--out') + 1] if '--out' in cmd else 'runs/latest'
    assert report(tmp_path / out)['steps'] == 4, cmd
    ran.append(cmd[:3])
  assert len(ran) >= 3, ran  # train.py, the failures example, the supervisor
