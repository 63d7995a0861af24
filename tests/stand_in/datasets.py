"""A stand-in for the Hugging Face `datasets` package (~300 MB, and no Hub here): only what
mecefo_jax/data/documents.py calls, with the package's semantics, so the real hf: code runs.

Put on sys.path by the `hf_datasets` fixture (tests/conftest.py). `HUB` stands in for the Hub:
`load_dataset` finds a name there (every other name fails as an offline machine does) and
records each call in `LOADS`; `save_to_disk` / `load_from_disk` keep a dataset as JSON.
"""
from __future__ import annotations

import json
from pathlib import Path

HUB: dict[str, dict[str, list[dict]]] = {}   # name -> split -> rows
LOADS: list[tuple[tuple, dict]] = []          # the arguments of each load_dataset call
_SAVED = 'stand_in_dataset.json'


class Value:
  """A column's type, as `datasets.Value`: `dtype` 'string' for text."""

  def __init__(self, dtype: str):
    self.dtype = dtype

  def __repr__(self):
    return f"Value('{self.dtype}')"


def _features(rows: list[dict]) -> dict[str, Value]:
  types = {str: 'string', int: 'int64', float: 'float64', bool: 'bool'}
  return {k: Value(types.get(type(v), 'null')) for k, v in (rows[0] if rows else {}).items()}


class Dataset:
  """A map-style dataset: rows of a table, known columns and features."""

  def __init__(self, rows: list[dict]):
    self._rows = rows
    self.features = _features(rows)
    self.column_names = list(self.features)

  @classmethod
  def from_dict(cls, columns: dict[str, list]) -> Dataset:
    names = list(columns)
    return cls([dict(zip(names, values)) for values in zip(*columns.values())])

  def __len__(self):
    return len(self._rows)

  def __iter__(self):
    return iter(self._rows)

  def select(self, indices) -> Dataset:
    return Dataset([self._rows[i] for i in indices])

  def select_columns(self, column_names: list[str]) -> Dataset:
    return Dataset([{c: r[c] for c in column_names} for r in self._rows])

  def save_to_disk(self, path) -> None:
    _save(path, {'rows': self._rows})


class DatasetDict(dict):
  """Splits by name, each a Dataset."""

  def save_to_disk(self, path) -> None:
    _save(path, {'splits': {name: ds._rows for name, ds in self.items()}})


class IterableDataset:
  """A stream of rows (`streaming=True`): no length, no select; columns unknown until read, as
  for many Hub streams."""

  def __init__(self, rows: list[dict]):
    self._rows, self.column_names, self.features = rows, None, None

  def __iter__(self):
    return iter(self._rows)

  def skip(self, n: int) -> IterableDataset:
    return IterableDataset(self._rows[n:])

  def select_columns(self, column_names: list[str]) -> IterableDataset:
    return IterableDataset([{c: r[c] for c in column_names} for r in self._rows])


def load_dataset(path: str, name: str | None = None, *, split: str, streaming: bool = False):
  """Split `split` of a dataset of `HUB` (documents.py always names one); any other name cannot
  be reached."""
  LOADS.append(((path, name), {'split': split, 'streaming': streaming}))
  if path not in HUB:
    raise ConnectionError(f"Couldn't reach '{path}' on the Hub (offline)\n(stand-in: not in HUB)")
  kind = IterableDataset if streaming else Dataset
  splits = HUB[path]
  if split not in splits:
    raise ValueError(f'Unknown split "{split}". Should be one of {list(splits)}.')
  return kind(splits[split])


def load_from_disk(dataset_path: str):
  """What save_to_disk wrote there: a Dataset or a DatasetDict."""
  file = Path(dataset_path) / _SAVED
  if not file.is_file():
    raise FileNotFoundError(f'Directory {dataset_path} is neither a `Dataset` directory nor a '
                            f'`DatasetDict` directory.')
  saved = json.loads(file.read_text())
  if 'splits' in saved:
    return DatasetDict({name: Dataset(rows) for name, rows in saved['splits'].items()})
  return Dataset(saved['rows'])


def _save(path, content: dict) -> None:
  Path(path).mkdir(parents=True, exist_ok=True)
  (Path(path) / _SAVED).write_text(json.dumps(content))
