"""Fixtures independent of the machine: no file under tests/fixtures/ names an absolute path
(a run's --out, its trace, its tmpfs folder), which exists only where the fixture was made."""
import os
import re
from pathlib import Path

FIXTURES = Path(__file__).parent / 'fixtures'
ROOT = Path(__file__).resolve().parents[1]
# Where machine-specific paths start: scratch, tmpfs, homes, this checkout; not after a
# character of a path name (so 'a/tmp/b', a relative path, is not one).
PLACES = ('/tmp/', '/dev/shm/', '/home/', '/root/', '/Users/', '/var/folders/', '/private/',
          '/mnt/', '/work/', f'{ROOT}/', f'{Path.home()}/')
ABSOLUTE = re.compile(rb'(?<![\w.~@/-])(' +
                      b'|'.join(re.escape(os.fsencode(p)) for p in sorted(set(PLACES), key=len, reverse=True)) + rb')')


def absolute_paths(root: Path) -> dict[str, list[bytes]]:
  """{file: the absolute paths it names}, over every file under `root` (text or binary)."""
  found = {}
  for path in sorted(p for p in root.rglob('*') if p.is_file()):
    hits = [m.group(1) for m in ABSOLUTE.finditer(path.read_bytes())]
    if hits:
      found[str(path.relative_to(root))] = hits
  return found


def test_no_fixture_names_an_absolute_path():
  assert FIXTURES.is_dir() and any(FIXTURES.rglob('*'))
  assert absolute_paths(FIXTURES) == {}, 'write a placeholder where the run recorded a path'


def test_the_check_finds_paths_in_text_and_binary_files(tmp_path):
  (tmp_path / 'a.json').write_text('{"failures": "trace:/tmp/oldT"}')
  (tmp_path / 'b.bin').write_bytes(b'\x00\x01/dev/shm/mecefo/x\x00')
  (tmp_path / 'c.txt').write_text(f'saved in {Path.home()}/runs and relative/tmp/ok')
  found = absolute_paths(tmp_path)
  assert sorted(found) == ['a.json', 'b.bin', 'c.txt'], found
  assert len(found['c.txt']) == 1  # the home directory; not the relative path
