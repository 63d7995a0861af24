"""Frozen typed run configuration; YAML files and dotted CLI overrides only override the defaults."""
from __future__ import annotations

import codecs
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

# Takeover policies (mecefo_jax/core/takeover.py plans each).
POLICIES = ('neighbor', 'spread', 'exact', 'budget', 'drop', 'naive')
# Basis kinds: the names of model/bases.py's BASES (a test keeps them equal), here so that a bad
# name is refused with the config, before any file of a run is touched.
BASIS_NAMES = ('svd', 'gaussian')
# Cost of a degraded row relative to an exact one (policy budget): the FLOP ratio on llama_60m
# (two degraded micro-batches = 1.32 normal ones, benchmarks/ablation.py), what a compute-bound
# device pays; CPU step times give 0.3-0.6. Too high only degrades more rows than needed.
DEGRADED_COST = 0.65
DEFAULT_OUT = 'runs/latest'
COMPUTE_DTYPES = ('float32', 'bfloat16', 'float16')


class ConfigError(ValueError):
  """A bad configuration value; the message is one line naming the key and what is allowed."""


def resolve_compute_dtype(compute_dtype: str, platform: str) -> str:
  """model.compute_dtype on a backend (a jax platform name: 'cpu', 'gpu', 'tpu'): `auto` is
  float32 on CPU, bfloat16 on any accelerator; a named dtype stays as it is."""
  if compute_dtype != 'auto':
    return compute_dtype
  return 'float32' if platform == 'cpu' else 'bfloat16'


@dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = 256
  d_model: int = 64
  n_layers: int = 2
  n_heads: int = 4
  ffn_dim: int = 172
  seq_len: int = 64
  rope_theta: float = 10000.0
  norm_eps: float = 1e-6
  init_std: float = 0.02
  # auto: bfloat16 on TPU/GPU, float32 on CPU (its bfloat16 matmuls are emulated, slower),
  # resolved by resolve_compute_dtype where the backend is known; params stay param_dtype.
  compute_dtype: str = 'auto'
  param_dtype: str = 'float32'

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads


@dataclass(frozen=True)
class MeshConfig:
  slice: int = -1  # data-parallel replicas; -1 = all devices left after fsdp * tensor
  fsdp: int = 1  # in-slice parameter sharding (ZeRO-3 style)
  tensor: int = 1  # in-slice tensor parallelism
  # Sum gradients across slices in slice order (gather, then add) instead of XLA's all-reduce,
  # whose order depends on the collective library: params then match bit for bit whatever the
  # process layout. Costs slice-count x gradient memory and an extra program per step.
  ordered_reduce: bool = False


@dataclass(frozen=True)
class MeCeFOConfig:
  basis: str = 'svd'  # a name in model/bases.py's BASES: 'svd' (paper) | 'gaussian' (unbiased)
  rank: int = 0  # low-rank Wgrad rank; 0 = rank_fraction * d_in of each FFN matrix
  rank_fraction: float = 0.25
  tau: int = 10  # svd bases are recomputed every tau steps while degraded steps run
  power_iters: int = 2  # randomized-SVD power iterations
  refresh: str = 'warm'  # svd refresh: 'warm' (1 subspace iteration from the last bases) | 'full'
  ffn_remat: str = 'dots'  # 'full' (keep only the FFN input) | 'dots' (also gate/up outputs)


@dataclass(frozen=True)
class OptimizerConfig:
  lr: float = 3e-3
  warmup_steps: int = 20
  min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at train.steps
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  grad_clip: float = 1.0  # global-norm clip; 0 disables


@dataclass(frozen=True)
class TrainConfig:
  steps: int = 200
  micro_batch: int = 8  # sequences per slice per step; global batch = slices * micro_batch
  seed: int = 0
  log_every: int = 10
  out_dir: str = DEFAULT_OUT  # a new run here replaces a finished one (README: Snapshots)
  data: str = 'synthetic'  # synthetic | text:PATH | pydoc | tokens:PATH | hf:NAME (data/sources.py)
  eval_every: int = 100  # held-out eval every N steps and at the end; 0 = only at the end
  eval_batches: int = 4  # batches per eval (each: live slices x micro_batch sequences)
  plot: bool = True  # write <out>/training.png at the end (python -m mecefo_jax.run.plot)
  # train.py: the program store (step/store.py) in <compile_cache>/programs, so restarts and
  # new runs load their programs instead of compiling them ('' = off;
  # JAX_COMPILATION_CACHE_DIR wins), this size at most (least recently used evicted first).
  compile_cache: str = '~/.cache/mecefo-jax/xla'
  program_store_mb: int = 4096
  # A program compiled for one set of slices is moved onto other sets of the same shape instead
  # of compiled again (step/retarget.py): auto = on where its start-up probe passes, off on TPU.
  move_programs: str = 'auto'  # auto | always | never


@dataclass(frozen=True)
class FaultConfig:
  failures: str = 'none'  # none | low | mid | high (docs/algorithm.md §5) | trace:PATH
  # per_device: a preset's interval is per device of the paper's 32-device cluster, so the
  # expected fraction of slices down is the paper's at any slice count; cluster: for the cluster.
  rate: str = 'per_device'  # per_device | cluster
  # spread: the default, measured fastest to the fault-free loss of the policies that keep every
  # sample and a normal step's memory (README, "Which takeover policy?"); neighbor: the paper's.
  takeover: str = 'spread'  # neighbor (paper) | spread, exact, budget | drop, naive
  # budget: each live slice's step cost stays within this multiple of the fault-free step's
  # (exact row 1, degraded row degraded_cost) with the fewest degraded rows; inf = all exact.
  time_budget: float = 1.0
  cluster_step_s: float = 60.0  # simulated cluster seconds per step, so short runs cover hours
  max_degraded_rows: int = 0  # most rows one degraded pass holds; 0 = 2 * train.micro_batch
  degraded_cost: float = DEGRADED_COST  # budget: cost of a degraded row / an exact row's
  # Build the programs of live sets one failure/repair away in a background thread (compile
  # new shapes, move the others): auto = on for GPU/TPU, off on CPU (it would take the step's
  # cores). With several processes: compiles into the program store for restarts.
  precompile: str = 'auto'  # auto | always | never
  precompile_max: int = 64  # most programs kept built ahead of need; 0 = no limit


@dataclass(frozen=True)
class SnapshotConfig:
  enabled: bool = True
  dir: str = ''  # in-memory tier; '' = /dev/shm/mecefo/<run name> (tmpfs: outlives the trainer)
  # steps between in-memory snapshots, or 'auto': the smallest interval whose measured cost
  # stays within overhead_budget of the step time (snapshot/interval.py), at most max_every
  every: int | str = 1
  overhead_budget: float = 0.01  # snapshot.every=auto: the share of step time snapshots may take
  max_every: int = 100  # snapshot.every=auto: the largest interval (the steps a crash may cost)
  keep: int = 2
  durable_dir: str = ''  # durable Orbax tier (local dir or bucket); '' = <out_dir>/checkpoints
  durable_every: int = 100  # 0 = no durable checkpoints
  durable_keep: int = 3
  keep_when_finished: bool = False  # keep the in-memory tier after a finished run (else removed)


@dataclass(frozen=True)
class Config:
  model: ModelConfig = field(default_factory=ModelConfig)
  mesh: MeshConfig = field(default_factory=MeshConfig)
  mecefo: MeCeFOConfig = field(default_factory=MeCeFOConfig)
  optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
  train: TrainConfig = field(default_factory=TrainConfig)
  faults: FaultConfig = field(default_factory=FaultConfig)
  snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)


_CHOICES = {
    'model.compute_dtype': ('auto', *COMPUTE_DTYPES),
    'model.param_dtype': ('float32', 'bfloat16'),
    'mecefo.ffn_remat': ('full', 'dots'),
    'mecefo.refresh': ('warm', 'full'),
    'mecefo.basis': BASIS_NAMES,
    'faults.takeover': POLICIES,
    'faults.rate': ('per_device', 'cluster'),
    'faults.precompile': ('auto', 'always', 'never'),
    'train.move_programs': ('auto', 'always', 'never'),
}


def _coerce(key: str, value, typ):
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
  if key in _CHOICES and value not in _CHOICES[key]:
    raise ConfigError(f"config key '{key}' must be one of {', '.join(_CHOICES[key])}, got {value!r}")
  return value


def _apply(cfg, updates: dict, prefix: str = ''):
  """Returns cfg with `updates` (a nested dict) applied, checking names and types."""
  hints = typing.get_type_hints(type(cfg))
  names = [f.name for f in dataclasses.fields(cfg)]
  changes = {}
  for name, value in updates.items():
    key = f'{prefix}{name}'
    if name not in names:
      raise ConfigError(f"unknown config key '{key}'; allowed: {', '.join(prefix + n for n in names)}")
    if dataclasses.is_dataclass(hints[name]):
      if not isinstance(value, dict):
        raise ConfigError(f"config key '{key}' is a section; give it a mapping, got {value!r}")
      changes[name] = _apply(getattr(cfg, name), value, key + '.')
    else:
      changes[name] = _coerce(key, value, hints[name])
  return dataclasses.replace(cfg, **changes)


def _yaml_load(text: str, where: str):
  """yaml.safe_load, with a syntax error as one ConfigError line naming `where`."""
  try:
    return yaml.safe_load(text)
  except yaml.YAMLError as err:
    mark = getattr(err, 'problem_mark', None)
    at = f' (line {mark.line + 1}, column {mark.column + 1})' if mark else ''
    problem = getattr(err, 'problem', None) or str(err).splitlines()[0]
    raise ConfigError(f'{where} is not valid YAML{at}: {problem}') from None


def check_text(data: bytes, path: Path, what: str, *, final: bool = True,
               error: type[ValueError] = ConfigError, offset: int = 0) -> None:
  """Raises `error` (one line) where `data`, the bytes of `path`, are not text: a NUL byte or
  bytes that are not UTF-8. `final=False`: `data` is only the file's start (it may end inside a
  character). `offset`: where `data` starts in the file (the message counts from the file's
  start)."""
  nul = data.find(b'\0')
  try:
    codecs.getincrementaldecoder('utf-8')().decode(data[:nul] if nul >= 0 else data,
                                                   final or nul >= 0)
  except UnicodeDecodeError as err:
    nul = err.start
  if nul >= 0:
    raise error(f'{what} {str(path)!r} is not UTF-8 text (byte {offset + nul}); is it a '
                f'binary file?')


def read_text(path: Path, what: str) -> str:
  """The UTF-8 text of `path`; missing, a directory, unreadable or binary: one ConfigError line."""
  if path.is_dir():
    raise ConfigError(f'{what} {str(path)!r} is a directory; give the file itself')
  if not path.is_file():
    raise ConfigError(f'{what} {str(path)!r} not found')
  try:
    data = path.read_bytes()
  except OSError as err:
    raise ConfigError(f'cannot read {what} {str(path)!r}: {err.strerror or err}') from None
  check_text(data, path, what)
  return data.decode('utf-8')


def parse_override(text: str) -> dict:
  """'model.n_layers=4' -> {'model': {'n_layers': 4}} (value parsed as YAML)."""
  if '=' not in text:
    raise ConfigError(f"override {text!r} must look like section.key=value")
  dotted, raw = text.split('=', 1)
  value = _yaml_load(raw, f'override {text!r}') if raw.strip() else ''
  nested: dict = {}
  node = nested
  parts = dotted.strip().split('.')
  for part in parts[:-1]:
    node = node.setdefault(part, {})
  node[parts[-1]] = value
  return nested


# Every float key with its allowed range: (low, high, low inclusive, high inclusive); NaN is
# always refused and so is inf, except where a bound is inf (faults.time_budget).
_FLOAT_RANGES = {
    'model.rope_theta': (0.0, math.inf, False, False),
    'model.norm_eps': (0.0, math.inf, False, False),
    'model.init_std': (0.0, math.inf, False, False),
    'mecefo.rank_fraction': (0.0, 1.0, False, True),
    'optimizer.lr': (0.0, math.inf, False, False),
    'optimizer.min_lr_ratio': (0.0, 1.0, True, True),
    'optimizer.b1': (0.0, 1.0, True, False),
    'optimizer.b2': (0.0, 1.0, True, False),
    'optimizer.eps': (0.0, math.inf, True, False),
    'optimizer.weight_decay': (0.0, math.inf, True, False),
    'optimizer.grad_clip': (0.0, math.inf, True, False),
    'faults.time_budget': (1.0, math.inf, True, True),
    'faults.cluster_step_s': (0.0, math.inf, False, False),
    'faults.degraded_cost': (0.0, 1.0, False, False),
    'snapshot.overhead_budget': (0.0, 1.0, False, False),
}
_FLOAT_HINTS = {'optimizer.grad_clip': '0 disables clipping',
                'faults.time_budget': 'a multiple of the fault-free step time; inf = never degrade'}


def _in_range(value: float, low: float, high: float, low_in: bool, high_in: bool) -> bool:
  # Written so that NaN compares False everywhere and fails.
  above = value >= low if low_in else value > low
  below = value <= high if high_in else value < high
  return above and below


def _check_floats(cfg: Config) -> None:
  for key, (low, high, low_in, high_in) in _FLOAT_RANGES.items():
    section, name = key.split('.')
    value = getattr(getattr(cfg, section), name)
    if not _in_range(value, low, high, low_in, high_in):
      interval = f"{'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"
      hint = f' ({_FLOAT_HINTS[key]})' if key in _FLOAT_HINTS else ''
      raise ConfigError(f"config key '{key}' must be in {interval}{hint}, got {value}")


def validate(cfg: Config) -> Config:
  """Shape checks that do not need devices; mesh-vs-devices is checked when the mesh is built."""
  _check_floats(cfg)
  m, t, mc = cfg.model, cfg.train, cfg.mecefo
  if not 0 <= t.seed < 2**63:  # jax.random.PRNGKey takes a signed 64-bit seed
    raise ConfigError(f"config key 'train.seed' must be in [0, 2**63), got {t.seed}")
  if cfg.optimizer.warmup_steps < 0:
    raise ConfigError(f"config key 'optimizer.warmup_steps' must be >= 0, got "
                      f'{cfg.optimizer.warmup_steps}')
  positive = {'model.vocab_size': m.vocab_size, 'model.d_model': m.d_model,
              'model.n_layers': m.n_layers, 'model.n_heads': m.n_heads, 'model.ffn_dim': m.ffn_dim,
              'model.seq_len': m.seq_len, 'train.steps': t.steps,
              'train.micro_batch': t.micro_batch, 'train.log_every': t.log_every,
              'mecefo.tau': mc.tau, 'mesh.fsdp': cfg.mesh.fsdp, 'mesh.tensor': cfg.mesh.tensor}
  for key, value in positive.items():
    if value < 1:
      raise ConfigError(f"config key '{key}' must be >= 1, got {value}")
  if m.d_model % m.n_heads:
    raise ConfigError(f"model.n_heads={m.n_heads} must divide model.d_model={m.d_model}")
  if m.head_dim % 2:
    raise ConfigError(f"model.d_model / model.n_heads = {m.head_dim} must be even for RoPE")
  if t.eval_every < 0 or t.eval_batches < 1:
    raise ConfigError(f'train.eval_every must be >= 0 and train.eval_batches >= 1, got '
                      f'{t.eval_every}, {t.eval_batches}')
  if t.micro_batch % cfg.mesh.fsdp:
    raise ConfigError(f"train.micro_batch={t.micro_batch} must be divisible by mesh.fsdp={cfg.mesh.fsdp}")
  if cfg.mesh.slice == 0 or cfg.mesh.slice < -1:
    raise ConfigError(f"config key 'mesh.slice' must be >= 1 or -1 (all devices), got {cfg.mesh.slice}")
  if mc.rank < 0 or mc.rank > min(m.d_model, m.ffn_dim):
    raise ConfigError(f"mecefo.rank must be in [0, {min(m.d_model, m.ffn_dim)}] (0 = auto), got {mc.rank}")
  if mc.power_iters < 0:
    raise ConfigError(f"mecefo.power_iters must be >= 0, got {mc.power_iters}")
  sn = cfg.snapshot
  if sn.every != 'auto' and not (isinstance(sn.every, int) and sn.every >= 1):
    raise ConfigError(f"snapshot.every must be >= 1 or 'auto', got {sn.every!r}")
  if sn.keep < 1 or sn.durable_every < 0 or sn.durable_keep < 1 or sn.max_every < 1:
    raise ConfigError('snapshot.keep, snapshot.durable_keep, snapshot.max_every must be >= 1 and '
                      f'snapshot.durable_every >= 0; got {sn.keep}, {sn.durable_keep}, '
                      f'{sn.max_every}, {sn.durable_every}')
  f = cfg.faults
  trace = f.failures.startswith('trace:') and f.failures != 'trace:'
  if f.failures not in ('none', 'low', 'mid', 'high') and not trace:
    raise ConfigError(f"faults.failures must be none, low, mid, high or trace:PATH, got {f.failures!r}")
  if f.max_degraded_rows < 0:
    raise ConfigError(f"config key 'faults.max_degraded_rows' must be >= 0, got "
                      f'{f.max_degraded_rows}')
  if f.precompile_max < 0:
    raise ConfigError(f"config key 'faults.precompile_max' must be >= 0, got {f.precompile_max}")
  return cfg


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = (),
                base: dict | None = None) -> Config:
  """Defaults (or `base`: a recorded config, e.g. of a run to resume), then the YAML file at
  `path`, then dotted overrides; validated."""
  cfg = _apply(Config(), base) if base else Config()
  if path is not None:
    path = Path(path)
    data = _yaml_load(read_text(path, 'config file'), f'config file {str(path)!r}') or {}
    if not isinstance(data, dict):
      raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
    cfg = _apply(cfg, data)
  for text in overrides:
    cfg = _apply(cfg, parse_override(text))
  return validate(cfg)


def to_dict(cfg: Config) -> dict:
  return dataclasses.asdict(cfg)
