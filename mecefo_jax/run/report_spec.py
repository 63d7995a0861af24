"""The type specs of report.json's schema: each checks a JSON value and names itself for the docs."""
from __future__ import annotations

import dataclasses
import math


class Spec:
  name = '?'

  def check(self, value, path: str, errors: list[str]) -> None:
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Scalar(Spec):
  typ: type  # int, float, str or bool; a float field accepts a JSON integer (e.g. 0)

  @property
  def name(self) -> str:
    return self.typ.__name__

  def check(self, value, path, errors):
    ok = (type(value) is self.typ or  # bool is an int in Python: exact types only
          (self.typ is float and type(value) is int))
    if not ok:
      errors.append(f'{path}: expected {self.name}, got {type(value).__name__} {value!r:.60}')
    elif type(value) is float and not math.isfinite(value):  # strict JSON has no NaN/Infinity
      errors.append(f'{path}: expected a finite float, got {value!r} (write null where allowed)')


@dataclasses.dataclass(frozen=True)
class Choice(Spec):
  options: tuple[str, ...]

  @property
  def name(self) -> str:
    return ' \\| '.join(f"'{o}'" for o in self.options)

  def check(self, value, path, errors):
    if value not in self.options:
      errors.append(f'{path}: expected one of {self.options}, got {value!r:.60}')


@dataclasses.dataclass(frozen=True)
class Nullable(Spec):
  inner: Spec

  @property
  def name(self) -> str:
    return f'{self.inner.name} \\| null'

  def check(self, value, path, errors):
    if value is not None:
      self.inner.check(value, path, errors)


@dataclasses.dataclass(frozen=True)
class ListOf(Spec):
  item: Spec

  @property
  def name(self) -> str:
    return f'list of {self.item.name}'

  def check(self, value, path, errors):
    if not isinstance(value, list):
      errors.append(f'{path}: expected a list, got {type(value).__name__}')
      return
    for i, item in enumerate(value):
      self.item.check(item, f'{path}[{i}]', errors)


@dataclasses.dataclass(frozen=True)
class Pair(Spec):
  first: Spec
  second: Spec

  @property
  def name(self) -> str:
    return f'[{self.first.name}, {self.second.name}]'

  def check(self, value, path, errors):
    if not isinstance(value, list) or len(value) != 2:
      errors.append(f'{path}: expected a pair [{self.name}], got {value!r:.60}')
      return
    self.first.check(value[0], f'{path}[0]', errors)
    self.second.check(value[1], f'{path}[1]', errors)


@dataclasses.dataclass(frozen=True)
class MapOf(Spec):
  value: Spec | None  # None: any JSON value

  @property
  def name(self) -> str:
    return f'object of {self.value.name}' if self.value else 'object'

  def check(self, value, path, errors):
    if not isinstance(value, dict):
      errors.append(f'{path}: expected an object, got {type(value).__name__}')
      return
    for key, item in value.items():
      if self.value is not None:
        self.value.check(item, f'{path}.{key}', errors)


@dataclasses.dataclass(frozen=True)
class Field:
  spec: Spec
  unit: str
  doc: str


@dataclasses.dataclass(frozen=True)
class Record(Spec):
  """An object with exactly these keys (a missing or an undocumented key is an error)."""
  fields: dict[str, Field]
  name: str = 'object'

  def check(self, value, path, errors):
    if not isinstance(value, dict):
      errors.append(f'{path or "report"}: expected an object, got {type(value).__name__}')
      return
    prefix = f'{path}.' if path else ''
    for key, field in self.fields.items():
      if key not in value:
        errors.append(f'{prefix}{key}: missing')
      else:
        field.spec.check(value[key], prefix + key, errors)
    for key in value.keys() - self.fields.keys():
      errors.append(f'{prefix}{key}: not in the schema (document it in report_schema.py)')
