"""Every relative link and anchor in README.md, docs/*.md and colab/README.md points somewhere."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / 'README.md', ROOT / 'colab' / 'README.md', *sorted((ROOT / 'docs').glob('*.md'))]
LINK = re.compile(r'\[[^\]]*\]\(([^)\s]+)\)')
FENCE = re.compile(r'^(```|~~~).*?^\1', re.M | re.S)


def slug(heading: str) -> str:
  """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
  text = re.sub(r'`|\*\*|\[([^\]]*)\]\([^)]*\)', r'\1', heading.strip()).lower()
  return re.sub(r'[^\w\- ]', '', text).replace(' ', '-')


def anchors(path: Path) -> set[str]:
  """The anchors of a page's headings (a repeated one gets -1, -2, ... as GitHub gives)."""
  seen: dict[str, int] = {}
  out = set()
  for heading in re.findall(r'^#{1,6} (.+)$', FENCE.sub('', path.read_text()), re.M):
    base = slug(heading)
    n = seen.get(base, 0)
    seen[base] = n + 1
    out.add(base if n == 0 else f'{base}-{n}')
  return out


def links(path: Path) -> list[str]:
  return [target for target in LINK.findall(FENCE.sub('', path.read_text()))
          if not re.match(r'[a-z]+:', target)]  # http:, https:, mailto: are not checked here


def test_the_slug_is_githubs():
  assert slug('Throughput under failures (controller)') == 'throughput-under-failures-controller'
  assert slug("A stop within a preemption's grace period") == 'a-stop-within-a-preemptions-grace-period'
  assert slug('Gradient error (choice of `rank`, `tau`)') == 'gradient-error-choice-of-rank-tau'
  assert slug('Quality at the §5 failure presets') == 'quality-at-the-5-failure-presets'


@pytest.mark.parametrize('page', PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
  broken = []
  for target in links(page):
    file, _, anchor = target.partition('#')
    dest = (page.parent / file).resolve() if file else page
    if not dest.exists():
      broken.append(f'{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}')
    elif anchor and dest.suffix == '.md' and anchor not in anchors(dest):
      broken.append(f'{target}: no heading with that anchor in {dest.name}')
  assert not broken, f'{page.name}: ' + '; '.join(broken)


def test_a_broken_link_is_seen(tmp_path):
  page = tmp_path / 'p.md'
  page.write_text('# Title\n[a](#title) [b](#nope) [c](missing.md) [d](https://x.org/y)\n'
                  '```\n[e](inside-a-code-block.md)\n```\n')
  assert links(page) == ['#title', '#nope', 'missing.md']
  assert anchors(page) == {'title'}
