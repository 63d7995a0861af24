"""Programs by identity: the table of program kinds, `ProgramKey`, and what a live set needs.

A new kind of program is one `register(Kind(...))` here and its lowering in step/lowering.py;
the controller, the precompiler and the failure simulator all list programs through
`programs_for` and key them by `ProgramKey`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Container, Hashable, Iterator, Mapping, Sequence

from mecefo_jax.core.roles import Role, slice_list


@dataclasses.dataclass(frozen=True)
class RunPrograms:
  """What besides the roles decides the programs a run's steps request: its config."""
  ordered_reduce: bool = False  # mesh.ordered_reduce: never the fused step under failure
  refresh: str | None = None  # kept bases' mecefo.refresh ('warm' | 'full'); None: no refresh
  eval_every: int = 0  # train.eval_every: an eval program on the live set every N steps

  @classmethod
  def of(cls, cfg, keeps_bases: bool) -> 'RunPrograms':
    """The run's; `keeps_bases`: the basis kind keeps bases, refreshed every mecefo.tau steps
    (model/bases.py decides, below this package)."""
    return cls(cfg.mesh.ordered_reduce, cfg.mecefo.refresh if keeps_bases else None,
               cfg.train.eval_every)


@dataclasses.dataclass(frozen=True)
class Need:
  """What a live set's programs depend on: its roles, the run's config, and whether the bases
  were refreshed before (then a warm refresh can follow)."""
  live: tuple[int, ...]
  roles: Mapping[int, Role]
  run: RunPrograms
  refreshed: bool = False

  def __post_init__(self):
    # Worked out at once, not as cached properties: every kind's rule asks for them, and a
    # cached property takes a lock at each access on Python 3.11 (a replay lists ~10^5 sets).
    groups: dict[Role, list[int]] = {}
    for s in self.live:
      groups.setdefault(self.roles[s], []).append(s)
    # The slices of each role, in live order (roles in order of first appearance).
    object.__setattr__(self, 'groups', {role: tuple(slices) for role, slices in groups.items()})
    object.__setattr__(self, 'degraded', any(r.degraded for r in self.roles.values()))
    # One SPMD program for the whole step: every slice plays one single-pass role.
    object.__setattr__(self, 'fused', len(groups) == 1 and next(iter(groups)).passes == 1
                       and not self.run.ordered_reduce)


# A rule lists the (slices, variant) of the programs of its kind that a live set needs.
Rule = Callable[[Need], list[tuple[tuple[int, ...], Hashable]]]


@dataclasses.dataclass(frozen=True)
class Kind:
  """A kind of program. `stage`: 'step' (the step runs it), 'refresh' (the svd basis refresh,
  every mecefo.tau degraded steps), 'eval' (between steps) or 'copy' (state moves: not listed
  by `programs_for`). `optimizer`: its program applies the optimizer, so AdamW's numbers are
  compiled into it, and it takes the learning rate's schedule as an argument (the others take
  the optimizer's state, whose tree those numbers leave as it is: step/program_store.py
  recipe). Kinds compare by name, so keys agree across processes."""
  name: str
  stage: str
  rule: Rule = dataclasses.field(compare=False, repr=False, default=lambda need: [])
  optimizer: bool = dataclasses.field(compare=False, default=False)

  def __str__(self) -> str:
    return self.name


KINDS: dict[str, Kind] = {}  # name -> kind, in the order a failure needs them
STAGES = ('step', 'refresh', 'eval', 'copy')


def register(kind: Kind) -> Kind:
  if kind.stage not in STAGES:
    raise ValueError(f'program stage must be one of {STAGES}, got {kind.stage!r}')
  if kind.name in KINDS:
    raise ValueError(f'program kind {kind.name!r} is registered already')
  KINDS[kind.name] = kind
  return kind


def _warm_refresh(need: Need) -> bool:
  return need.run.refresh == 'warm' and need.refreshed


# A step runs one fused SPMD program when every slice plays one single-pass role (and not
# mesh.ordered_reduce), else one group program per role over its slices, then the update. A
# group is one program over its slices, not a one-slice program run on each: where a slice is
# one device, XLA compiles a one-device program differently from one partitioned over several
# (sums differ in the last bits), and results must not depend on how many slices share a role.
FUSED = register(Kind('fused', 'step', lambda n: [(n.live, n.roles[n.live[0]])] if n.fused else [],
                      optimizer=True))
GROUP = register(Kind('group', 'step', lambda n: [] if n.fused else
                      [(slices, role) for role, slices in n.groups.items()]))
UPDATE = register(Kind('update', 'step', lambda n: [] if n.fused else [(n.live, None)],
                       optimizer=True))
# The first refresh of a run, or every one with mecefo.refresh=full.
REFRESH_COLD = register(Kind('refresh_cold', 'refresh', lambda n: (
    [(n.live, None)] if n.run.refresh and n.degraded and not _warm_refresh(n) else [])))
REFRESH_WARM = register(Kind('refresh_warm', 'refresh', lambda n: (
    [(n.live, None)] if n.run.refresh == 'warm' and n.degraded else [])))
EVAL = register(Kind('eval', 'eval', lambda n: [(n.live, None)] if n.run.eval_every else []))
# The state copied onto repaired slices across processes; variant: the slices that held it.
REJOIN = register(Kind('rejoin', 'copy'))


@dataclasses.dataclass(frozen=True)
class ProgramKey:
  """One program: its kind, the logical slices whose devices run it, and its variant (the
  role of a fused or group program; None for the others)."""
  kind: Kind
  slices: tuple[int, ...]
  variant: Hashable = None

  def __post_init__(self):
    # Hashed once: keys are looked up at every build and their slices may be hundreds long.
    object.__setattr__(self, '_hash', hash((self.kind, self.slices, self.variant)))

  def __hash__(self) -> int:
    return self._hash

  @property
  def shape(self) -> tuple:
    """What the program's HLO depends on (the in-slice mesh, the config and the graph are the
    run's): programs of one shape move between sets of slices (step/retarget.py)."""
    return (self.kind.name, len(self.slices), self.variant)

  def __str__(self) -> str:
    variant = '' if self.variant is None else f' {self.variant}'
    return f'{self.kind.name}{variant} program for slices {slice_list(self.slices)}'


MOVED, COMPILED = 'moved', 'compiled'  # how the program cache builds what no store holds


def how_built(key: ProgramKey, shapes_built: Container[tuple], move: bool) -> str:
  """How the program cache (step/cache.py) builds `key` where the program store lacks it:
  moved from the program of its shape built before, with moves on (step/retarget.py), else
  compiled. The failure replay's stand-in cache (plan/ledger.py) follows the same rule."""
  return MOVED if move and key.shape in shapes_built else COMPILED


def programs_for(need: Need, stages: tuple[str, ...] = ('step', 'refresh', 'eval')
                 ) -> list[ProgramKey]:
  """The programs of the kinds in `stages` that steps on `need.live` request, in table order:
  the step's, then the refreshes, then the eval."""
  return [ProgramKey(kind, slices, variant) for kind in KINDS.values() if kind.stage in stages
          for slices, variant in kind.rule(need)]


def next_live_sets(live: tuple[int, ...], n_slices: int, down: Sequence[int] | None = None
                   ) -> Iterator[tuple[int, ...]]:
  """Live sets one event away, likeliest first, listed as taken (a replay at scale takes a few
  of hundreds): one slice back, in the order of `down` (the failed slices; default slice
  order), since a given failed slice is repaired sooner than a given live one fails while
  fewer are down than live; then one more down (none when `live` is a single slice)."""
  members = set(live)
  for r in (range(n_slices) if down is None else down):
    if r not in members:
      yield tuple(sorted((*live, r)))
  if len(live) > 1:
    for f in live:
      yield tuple(s for s in live if s != f)
