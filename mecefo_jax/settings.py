"""Config settings declared once: default, allowed values and doc; the checks and docs derive."""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass

RULE = 'mecefo_rule'  # the key of a setting's Rule in its dataclass field's metadata
# What a --resume may do to a setting (run/rundir.py checks it): keep it (the default), change
# it (the state carries over and the change is recorded), or only raise it (train.steps).
KEPT, MAY_CHANGE, MAY_GROW = 'kept', 'may change', 'may grow'
ON_RESUME = (KEPT, MAY_CHANGE, MAY_GROW)


def _number(text: str) -> float:
  """A bound as declared: '1', '0.5', 'inf', '2**63'."""
  text = text.strip()
  if '**' in text:
    base, power = text.split('**')
    return int(base) ** int(power)
  try:
    return int(text)
  except ValueError:
    return float(text)


@dataclass(frozen=True)
class Bounds:
  """An interval as written, e.g. '[0, 1)' or '(0, inf]', or a half line, e.g. '>= 1'; NaN is in
  none, and inf only where a closed bound is inf."""
  text: str
  low: float
  high: float
  low_in: bool
  high_in: bool

  @classmethod
  def parse(cls, text: str) -> Bounds:
    if text.startswith('>'):
      return cls(text, _number(text.lstrip('>=')), math.inf, text.startswith('>='), False)
    if text[0] not in '[(' or text[-1] not in '])' or text.count(',') != 1:
      raise ValueError(f"bounds must look like '[low, high)' or '>= low', got {text!r}")
    low, high = text[1:-1].split(',')
    return cls(text, _number(low), _number(high), text[0] == '[', text[-1] == ']')

  def holds(self, value: float) -> bool:
    # Written so that NaN compares False everywhere and fails.
    above = value >= self.low if self.low_in else value > self.low
    below = value <= self.high if self.high_in else value < self.high
    return above and below

  def wording(self) -> str:
    return self.text if self.text.startswith('>') else f'in {self.text}'


@dataclass(frozen=True)
class Rule:
  """What one setting is for and what it accepts beyond its type (nothing declared: any value)."""
  doc: str
  choices: tuple = ()  # the only values allowed (with `forms`)
  forms: tuple = ()  # 'PREFIX:NAME': also PREFIX followed by a non-empty rest, e.g. 'trace:PATH'
  bounds: Bounds | None = None
  also: tuple = ()  # values allowed outside `bounds`, e.g. -1 or 'auto'
  hint: str = ''  # what refusals add in parentheses, e.g. '0 disables clipping'
  on_resume: str = KEPT  # whether a --resume may change it: KEPT, MAY_CHANGE or MAY_GROW

  def allowed(self) -> str:
    """What the setting accepts, as refusals and docs/config.md say it; '' = any value."""
    if self.choices or self.forms:
      return 'one of ' + ', '.join((*self.choices, *self.forms))
    if self.bounds is None:
      return ''
    return ' or '.join((self.bounds.wording(), *map(repr, self.also)))

  def _fits_a_form(self, value) -> bool:
    prefixes = (form[:form.index(':') + 1] for form in self.forms)
    return isinstance(value, str) and any(
        value.startswith(prefix) and len(value) > len(prefix) for prefix in prefixes)

  def admits(self, value) -> bool:
    if value in self.choices or value in self.also or self._fits_a_form(value):
      return True
    if self.choices or self.forms:
      return False
    return self.bounds is None or (not isinstance(value, str) and self.bounds.holds(value))

  def refusal(self, key: str, value) -> str | None:
    """The one-line refusal of `value` for config key `key`; None where it is allowed."""
    if self.admits(value):
      return None
    hint = f' ({self.hint})' if self.hint else ''
    return f"config key '{key}' must be {self.allowed()}{hint}, got {value!r}"


def setting(default, doc: str, *, choices: typing.Iterable = (), forms: typing.Iterable = (),
            within: str | None = None, also: typing.Iterable = (), hint: str = '',
            on_resume: str = KEPT):
  """A config field: its default, what it is for (`doc`) and what it accepts beyond its type:
  `choices` (and `forms` like 'trace:PATH'), or `within` bounds ('[0, 1)', '>= 1') and `also`
  values outside them; `hint`: the note a refusal adds; `on_resume`: whether a --resume may
  change it (KEPT, MAY_CHANGE, MAY_GROW). The one place a rule is written."""
  if on_resume not in ON_RESUME:
    raise ValueError(f'on_resume must be one of {ON_RESUME}, got {on_resume!r}')
  bounds = Bounds.parse(within) if within else None
  rule = Rule(doc, tuple(choices), tuple(forms), bounds, tuple(also), hint, on_resume)
  if not rule.admits(default):
    raise ValueError(f'default {default!r} breaks its own rule: {rule.allowed()}')
  return dataclasses.field(default=default, metadata={RULE: rule})


_UNDECLARED = Rule('')  # a field declared without setting(): no doc, any value of its type


def leaves(cfg, prefix: str = '') -> typing.Iterator[tuple[str, typing.Any, typing.Any, Rule]]:
  """(dotted key, value, type, rule) of every setting of the config `cfg`, sections flattened in
  declaration order."""
  hints = typing.get_type_hints(type(cfg))
  for f in dataclasses.fields(cfg):
    value = getattr(cfg, f.name)
    if dataclasses.is_dataclass(value):
      yield from leaves(value, f'{prefix}{f.name}.')
    else:
      yield prefix + f.name, value, hints[f.name], f.metadata.get(RULE, _UNDECLARED)


def type_name(typ) -> str:
  return typ.__name__ if isinstance(typ, type) else str(typ)


def _cell(text: str) -> str:
  return text.replace('|', '\\|')


def markdown(cfg) -> str:
  """A markdown table of every setting of `cfg`: key, type, default, allowed values, whether a
  resume may change it, doc."""
  lines = ['| key | type | default | allowed | on resume | doc |',
           '|---|---|---|---|---|---|']
  for key, value, typ, rule in leaves(cfg):
    allowed = rule.allowed() + (f' ({rule.hint})' if rule.hint else '')  # '': any value
    lines.append(f'| `{key}` | {_cell(type_name(typ))} | `{value!r}` | {_cell(allowed)} | '
                 f'{rule.on_resume} | {_cell(rule.doc)} |')
  return '\n'.join(lines)
