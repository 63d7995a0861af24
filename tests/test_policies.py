"""Takeover policies: each plans as it did at c849826 (every live set of up to 6 slices), and a
new policy is one registration."""
import hashlib
import itertools
import json
from pathlib import Path

import pytest

from mecefo_jax import config
from mecefo_jax.core import takeover
from mecefo_jax.core.takeover import Planner

# Digests of the plans made at c849826, by tests/test_policies.py's `expected_plans` run against
# that commit's mecefo_jax (a `git worktree` first on sys.path).
FIXTURE = Path(__file__).parent / 'fixtures' / 'takeover_plans_c849826.json'
SPECS = [('neighbor', 1.0), ('spread', 1.0), ('exact', 1.0), ('budget', 1.0), ('budget', 1.05),
         ('drop', 1.0), ('naive', 1.0)]
SIZES = [(n, b, g) for n in range(1, 7) for b in (4, 8) for g in (1, 2)]


def _rows(rows) -> str:
  return ','.join(f'{r.owner}.{r.start}-{r.stop}' for r in rows)


def plan_text(a) -> str:
  """An Assignment as text: every slice's exact and degraded rows and role, the rows dropped."""
  work = ';'.join(f'{s}:e{_rows(w.exact)}:d{_rows(w.degraded)}' for s, w in sorted(a.work.items()))
  roles = ';'.join(f'{s}:{r.exact}/{r.degraded}/{r.passes}' for s, r in sorted(a.roles.items()))
  return f'{work}|{_rows(a.dropped)}|{roles}'


def plan_digests(planner) -> list[str]:
  """A short digest of the plan of every live set, in itertools.combinations order."""
  n = planner.n_slices
  return [hashlib.sha256(plan_text(planner.plan(live)).encode()).hexdigest()[:12]
          for k in range(1, n + 1) for live in itertools.combinations(range(n), k)]


def expected_plans() -> dict[str, list[str]]:
  return {f'{policy}:{budget}/{n}/{b}/{g}': plan_digests(Planner(n, b, policy, g,
                                                                 time_budget=budget))
          for policy, budget in SPECS for n, b, g in SIZES}


def test_every_policy_plans_as_at_c849826():
  """Rows, roles and dropped rows of every live set of 1..6 slices, micro-batch 4 and 8,
  granule 1 and 2, equal to the starting commit's (before policies were objects)."""
  want = json.loads(FIXTURE.read_text())
  got = expected_plans()
  assert got.keys() == want.keys()
  differ = {case: [i for i, (x, y) in enumerate(zip(got[case], want[case])) if x != y]
            for case in want if got[case] != want[case]}
  assert not differ, f'plans differ from c849826 (case: live-set indices): {differ}'


def test_the_registry_names_the_configs_policies():
  """config.py cannot import core (layering), so it keeps the names; they must be the
  registry's, in order (the config's and the CLI's choices)."""
  assert tuple(takeover.REGISTRY) == config.POLICIES


def test_roles_are_the_plans_roles():
  for policy, budget in SPECS:
    planner = Planner(5, 4, policy, 2, time_budget=budget)
    for live in [(0, 1, 2, 3, 4), (1, 2, 4), (3,)]:
      assert planner.roles(live) == planner.plan(live).roles


def test_a_new_policy_is_one_registration(monkeypatch):
  """A dummy policy registered at test time plans through Planner with no other edit: the
  first live slice carries every orphan, exactly."""
  monkeypatch.setattr(takeover, 'REGISTRY', dict(takeover.REGISTRY))  # restored after

  @takeover.register
  class FirstTakesAll(takeover.Policy):
    name = 'first_takes_all'

    def handout(self, p, live):
      orphaned = [(live[0], f, p.micro_batch) for f in takeover.orphans(p, live)]
      return takeover.Handout.of(takeover.own_pieces(p, live) + orphaned)  # all exact

  planner = Planner(4, 8, 'first_takes_all')
  a = planner.plan((1, 3))
  assert a.work[1].exact == [takeover.Rows(1, 0, 8), takeover.Rows(0, 0, 8), takeover.Rows(2, 0, 8)]
  assert a.work[3].counts() == (8, 0) and not a.dropped
  assert planner.roles((1, 3)) == {1: takeover.Role(24), 3: takeover.Role(8)}
  with pytest.raises(ValueError, match='registered already'):
    takeover.register(FirstTakesAll)
