"""Records as dataclasses (report.json's sections, and every file and message a run or a job
writes and reads back): the strict check, the reader, the writer and the docs rows, from their
fields."""
from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from typing import Any, Iterator, Literal, Union


def entry(unit: str, doc: str, default: Any = dataclasses.MISSING,
          factory: Any = dataclasses.MISSING, *, optional: bool = False) -> Any:
  """A section's field: its unit ('' for none) and meaning; its annotation is its JSON type
  (int, float, str, bool, X | None, list[X], tuple[X, Y] (a pair), dict[str, X], dict[str, Any]
  (any object), Literal[...] (a choice), an Enum of strings or a nested section).
  `optional`: the key may be absent (read as `default`, None unless given; not written while
  None): a key files written before it was added lack, or one written only sometimes."""
  if optional and default is dataclasses.MISSING and factory is dataclasses.MISSING:
    default = None
  return dataclasses.field(default=default, default_factory=factory,
                           metadata={'unit': unit, 'doc': doc, 'optional': optional})


def is_optional(field: dataclasses.Field) -> bool:
  return field.metadata.get('optional', False)


@functools.cache
def _hints(section: type) -> dict[str, Any]:
  return typing.get_type_hints(section)


def fields(section: type) -> Iterator[tuple[str, Any, str, str]]:
  """(key, type, unit, doc) of each field of `section`, in order."""
  hints = _hints(section)
  for f in dataclasses.fields(section):
    yield f.name, hints[f.name], f.metadata.get('unit', ''), f.metadata.get('doc', '')


def is_section(tp) -> bool:
  return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def nullable(tp):
  """X for `X | None`, else None."""
  if typing.get_origin(tp) in (Union, types.UnionType):
    rest = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(rest) == 1 and len(typing.get_args(tp)) == 2:
      return rest[0]
  return None


def name(tp) -> str:
  """The type as docs/report.md writes it, e.g. 'list of [int, float \\| null]'."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  inner = nullable(tp)
  if inner is not None:
    return f'{name(inner)} \\| null'
  if is_section(tp):
    return 'object'
  if isinstance(tp, type) and issubclass(tp, enum.Enum):
    return ' \\| '.join(f"'{m.value}'" for m in tp)
  if origin is Literal:
    return ' \\| '.join(f"'{o}'" for o in args)
  if origin is list:  # nullable items in parentheses, apart from a null list
    item = name(args[0])
    return f'list of ({item})' if nullable(args[0]) is not None else f'list of {item}'
  if origin is tuple:
    return f'[{name(args[0])}, {name(args[1])}]'
  if tp is dict or origin is dict:
    return 'object' if not args or args[1] is Any else f'object of {name(args[1])}'
  return tp.__name__


# ---- the strict check --------------------------------------------------------------------------

def check(tp, value, path: str, errors: list[str], strict: bool = True) -> None:
  """Appends to `errors` every mismatch between the JSON `value` at `path` and the type `tp`
  (`strict`: a key a section does not declare is one too)."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  inner = nullable(tp)
  if inner is not None:
    if value is not None:
      check(inner, value, path, errors, strict)
  elif is_section(tp):
    _check_section(tp, value, path, errors, strict)
  elif origin is Literal:
    if value not in args:
      errors.append(f'{path}: expected one of {args}, got {value!r:.60}')
  elif isinstance(tp, type) and issubclass(tp, enum.Enum):
    if value not in {m.value for m in tp}:
      errors.append(f'{path}: expected one of {tuple(m.value for m in tp)}, got {value!r:.60}')
  elif origin is list:
    _check_list(args[0], value, path, errors, strict)
  elif origin is tuple:
    _check_pair(tp, value, path, errors, strict)
  elif tp is dict or origin is dict:
    _check_map(args[1] if args and args[1] is not Any else None, value, path, errors,
               strict)
  else:
    _check_scalar(tp, value, path, errors)


def _check_scalar(tp: type, value, path, errors) -> None:
  ok = (type(value) is tp or  # bool is an int in Python: exact types only
        (tp is float and type(value) is int))  # a float field accepts a JSON integer (e.g. 0)
  if not ok:
    errors.append(f'{path}: expected {tp.__name__}, got {type(value).__name__} {value!r:.60}')
  elif type(value) is float and not math.isfinite(value):  # strict JSON has no NaN/Infinity
    errors.append(f'{path}: expected a finite float, got {value!r} (write null where allowed)')


def _check_list(item, value, path, errors, strict) -> None:
  if not isinstance(value, list):
    errors.append(f'{path}: expected a list, got {type(value).__name__}')
    return
  for i, element in enumerate(value):
    check(item, element, f'{path}[{i}]', errors, strict)


def _check_pair(tp, value, path, errors, strict) -> None:
  if not isinstance(value, list) or len(value) != 2:
    errors.append(f'{path}: expected a pair [{name(tp)}], got {value!r:.60}')
    return
  first, second = typing.get_args(tp)
  check(first, value[0], f'{path}[0]', errors, strict)
  check(second, value[1], f'{path}[1]', errors, strict)


def _check_map(item, value, path, errors, strict) -> None:
  if not isinstance(value, dict):
    errors.append(f'{path}: expected an object, got {type(value).__name__}')
    return
  for k, element in value.items():
    if item is not None:
      check(item, element, f'{path}.{k}', errors, strict)


def _check_section(section: type, value, path, errors, strict) -> None:
  """An object with exactly the section's keys (a missing or an undeclared key is an error; an
  optional key may be absent)."""
  if not isinstance(value, dict):
    errors.append(f'{path or "report"}: expected an object, got {type(value).__name__}')
    return
  prefix = f'{path}.' if path else ''
  declared = set()
  for f, (k, tp, _, _) in zip(dataclasses.fields(section), fields(section)):
    declared.add(k)
    if k in value:
      check(tp, value[k], prefix + k, errors, strict)
    elif not is_optional(f):
      errors.append(f'{prefix}{k}: missing')
  for k in (value.keys() - declared) if strict else ():
    errors.append(f"{prefix}{k}: not in the schema (declare it in its section's dataclass)")


def errors(section: type, value) -> list[str]:
  """Every mismatch between `value` (parsed JSON) and `section`; [] if it matches."""
  found: list[str] = []
  check(section, value, '', found)
  return found


# ---- reading and writing ---------------------------------------------------------------------

def to_json(value) -> Any:
  """The JSON value of a record (its keys in field order; an optional key left out while None),
  an Enum (its value) or anything JSON already holds."""
  if is_section(type(value)):
    return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)
            if not (is_optional(f) and getattr(value, f.name) is None)}
  if isinstance(value, enum.Enum):
    return value.value
  if isinstance(value, (list, tuple)):
    return [to_json(v) for v in value]
  if isinstance(value, dict):
    return {k: to_json(v) for k, v in value.items()}
  return value


def from_json(tp, value) -> Any:
  """The record (or value) of type `tp` that the JSON `value` holds, checked by `check` first
  (the caller's): nested sections built, pairs as tuples, enums as members. Keys a section does
  not declare are passed over (a file written by a later version)."""
  inner = nullable(tp)
  if inner is not None:
    return None if value is None else from_json(inner, value)
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if is_section(tp):
    hints = _hints(tp)
    return tp(**{f.name: from_json(hints[f.name], value[f.name])
                 for f in dataclasses.fields(tp) if f.name in value})
  if isinstance(tp, type) and issubclass(tp, enum.Enum):
    return tp(value)
  if origin is list:
    return [from_json(args[0], v) for v in value]
  if origin is tuple:
    return tuple(from_json(a, v) for a, v in zip(args, value))
  if origin is dict and args and args[1] is not Any:
    return {k: from_json(args[1], v) for k, v in value.items()}
  return value


def part(section: type, name: str, keys: tuple[str, ...]) -> type:
  """A record of `section`'s fields `keys` alone (their types, units and docs), each optional:
  the part of a file one reader needs, from files of any version (a key may be absent)."""
  declared = {f.name: f for f in dataclasses.fields(section)}
  return dataclasses.make_dataclass(name, [
      (k, _hints(section)[k], entry(declared[k].metadata.get('unit', ''),
                                    declared[k].metadata.get('doc', ''), optional=True))
      for k in keys], frozen=True)


# ---- the docs ----------------------------------------------------------------------------------

def rows(section: type, prefix: str = '') -> Iterator[tuple[str, str, str, str]]:
  """(dotted key, type, unit, meaning) of every key, nested sections flattened."""
  for k, tp, unit, doc in fields(section):
    yield prefix + k, name(tp), unit, doc
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list and is_section(args[0]):
      yield from rows(args[0], f'{prefix}{k}[].')
    elif is_section(tp) or is_section(nullable(tp)):  # a section, or one that may be null
      yield from rows(nullable(tp) or tp, f'{prefix}{k}.')


class Draft:
  """A section filled in key by key by its owners before it is built: a key it does not declare
  is refused where it is set, and build() names the keys left without a value."""

  def __init__(self, section: type):
    object.__setattr__(self, '_section', section)
    object.__setattr__(self, '_values', {})

  def __setattr__(self, key: str, value) -> None:
    if key not in _hints(self._section):
      raise AttributeError(f'{self._section.__name__} declares no key {key!r}')
    self._values[key] = value

  def __getattr__(self, key: str):
    try:  # a key set before
      return self._values[key]
    except KeyError:
      raise AttributeError(f'{self._section.__name__} draft: no value for {key!r} yet') from None

  def build(self):
    unset = [f.name for f in dataclasses.fields(self._section) if f.name not in self._values
             and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if unset:
      raise ValueError(f'{self._section.__name__}: no value for {", ".join(unset)}')
    return self._section(**self._values)
