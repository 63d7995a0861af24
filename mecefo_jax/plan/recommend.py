"""The rule that picks the recommended approach from a replay's table (docs/failures.md)."""
from __future__ import annotations

TIE_POINTS = 0.2  # loss-equivalent points at r -> inf within which two approaches tie
SPARE_POOL = 'checkpoint-restart'  # the approaches that hold servers back as spares
RULE = ('the approach with the highest loss-equivalent progress at r -> inf on the fixed fleet; '
        "one that trains degraded rows only where v's 95% interval lies above its threshold (its "
        "lower end > d for budget, which keeps the step time; > 2d, spread's threshold at r = 1, "
        f'for one that lengthens the step: spread, neighbor); ties within {TIE_POINTS:g} points '
        'go to the approach with no degraded rows, then to one with no dropped rows; spare pools '
        '(checkpoint-restart with k spares) only where spares are offered (--spares)')


def threshold(name: str, thresholds: dict) -> float:
  """The v a takeover that degrades rows must beat: d for `budget` (the step time kept), else 2d
  (`spread`'s at r = 1: the step lengthened, as for spread and neighbor)."""
  return thresholds['budget'] if name.partition(':')[0] == 'budget' else thresholds['spread_r1']


def why_not(name: str, a: dict, v_low: float, thresholds: dict, spares: bool) -> str | None:
  """Why the rule leaves `name` (its table row `a`) out, or None."""
  if name.startswith(SPARE_POOL) and not spares:
    return 'left out: a spare pool (no --spares)'
  bar = threshold(name, thresholds)
  if a['degraded_pct'] > 0 and not v_low > bar:
    return f"left out: degraded rows, v's 95% low end {v_low:.2f} <= {bar:.2f}"
  return None


def recommend(approaches: dict[str, dict], v_low: float, thresholds: dict, spares: bool
              ) -> dict:
  """The rule (RULE) on `approaches` (name -> loss_equivalent_pct, degraded_pct, dropped_pct):
  {'recommended', 'tied' (within TIE_POINTS of the best allowed), 'excluded' (name -> why)}."""
  excluded = {n: why for n, a in approaches.items()
              if (why := why_not(n, a, v_low, thresholds, spares)) is not None}
  allowed = {n: a for n, a in approaches.items() if n not in excluded}
  if not allowed:
    raise ValueError('no approach is allowed by the rule')
  best = max(a['loss_equivalent_pct'] for a in allowed.values())
  tied = [n for n, a in allowed.items() if a['loss_equivalent_pct'] >= best - TIE_POINTS]
  order = lambda n: (allowed[n]['degraded_pct'] > 0, allowed[n]['dropped_pct'] > 0,
                     -allowed[n]['loss_equivalent_pct'])
  return {'recommended': min(tied, key=order), 'tied': tied, 'excluded': excluded}
