"""Settings given as text (a YAML file's mapping, dotted CLI overrides) applied to a frozen config,
each value coerced to its field's type; the declared rules are checked by config.validate."""
from __future__ import annotations

import dataclasses
import types
import typing

from mecefo_jax.files import read_yaml


class ConfigError(ValueError):
  """A bad configuration value; the message is one line naming the key and what is allowed."""


def _coerce(key: str, value, typ):
  """`value` as a `typ` (the field's annotation); declared rules are checked by config.validate."""
  if typing.get_origin(typ) is types.UnionType:  # e.g. int | str: the first arm that fits
    for arm in typing.get_args(typ):
      try:
        return _coerce(key, value, arm)
      except ConfigError:
        pass
    names = ' or '.join(arm.__name__ for arm in typing.get_args(typ))
    raise ConfigError(f"config key '{key}' must be {names}, got {value!r}")
  if typ is float and not isinstance(value, bool):
    # PyYAML reads '3e-3' (no dot) as a string; accept any float literal.
    try:
      value = float(value) if isinstance(value, (int, str)) else value
    except ValueError:
      pass
  if typ is bool or isinstance(value, bool):
    ok = isinstance(value, bool) and typ is bool
  else:
    ok = isinstance(value, typ)
  if not ok:
    raise ConfigError(f"config key '{key}' must be {typ.__name__}, got {value!r}")
  return value


def apply_updates(cfg, updates: dict, prefix: str = ''):
  """Returns cfg with `updates` (a nested dict) applied, checking names and types."""
  hints = typing.get_type_hints(type(cfg))
  fields = {f.name: f for f in dataclasses.fields(cfg)}
  names = list(fields)
  changes = {}
  for name, value in updates.items():
    key = f'{prefix}{name}'
    if name not in names:
      allowed = ', '.join(prefix + n for n in names)
      raise ConfigError(f"unknown config key '{key}'; allowed: {allowed}")
    if dataclasses.is_dataclass(hints[name]):
      if not isinstance(value, dict):
        raise ConfigError(f"config key '{key}' is a section; give it a mapping, got {value!r}")
      changes[name] = apply_updates(getattr(cfg, fields[name].name), value, key + '.')
    else:
      changes[name] = _coerce(key, value, hints[name])
  return dataclasses.replace(cfg, **changes)


def parse_override(text: str) -> dict:
  """'model.n_layers=4' -> {'model': {'n_layers': 4}} (value parsed as YAML)."""
  if '=' not in text:
    raise ConfigError(f"override {text!r} must look like section.key=value")
  dotted, raw = text.split('=', 1)
  value = read_yaml(raw, f'override {text!r}', ConfigError) if raw.strip() else ''
  nested: dict = {}
  node = nested
  parts = dotted.strip().split('.')
  for part in parts[:-1]:
    node = node.setdefault(part, {})
  node[parts[-1]] = value
  return nested
