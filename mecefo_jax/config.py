"""Frozen typed run configuration; YAML files and dotted CLI overrides only override defaults."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import typing
from dataclasses import dataclass, field
from pathlib import Path

from mecefo_jax.files import read_user_text, read_yaml
from mecefo_jax.overrides import ConfigError, apply_updates, parse_override
from mecefo_jax.settings import (KEPT, MAY_CHANGE, MAY_GROW, Rule, leaves,
                                 markdown as settings_markdown, setting)

# Value sets that other modules import; the fields below refer to them (their one declaration).
# Takeover policies (mecefo_jax/core/takeover.py plans each).
POLICIES = ('neighbor', 'spread', 'exact', 'budget', 'drop', 'requeue', 'naive')
# Basis kinds: the names of model/bases.py's BASES (a test keeps them equal), here so that a bad
# name is refused with the config, before any file of a run is touched.
BASIS_NAMES = ('svd', 'gaussian')
# Built-in models (model.kind): model/models.py's BUILTIN (a test keeps them equal); any other
# kind is a MODULE:FACTORY of a model of the contract (model/contract.py).
MODELS = ('llama', 'gpt2')
COMPUTE_DTYPES = ('float32', 'bfloat16', 'float16')
# Failure presets, docs/algorithm.md §5: (mean hours between failures in the cluster, hours until
# repair); core/failures.py draws them.
PRESETS = {'low': (2.0, 4.0), 'mid': (1.0, 3.0), 'high': (0.5, 2.0)}
RATES = ('per_device', 'cluster')  # how a preset's interval scales (core/failures.py)
AUTO_MODES = ('auto', 'always', 'never')  # faults.precompile, train.move_programs
# Cost of a degraded row relative to an exact one (policy budget): the FLOP ratio on llama_60m
# (two degraded micro-batches = 1.32 normal ones, benchmarks/ablation.py), what a compute-bound
# device pays; CPU step times give 0.3-0.6. Too high only degrades more rows than needed.
DEGRADED_COST = 0.65
DEFAULT_OUT = 'runs/latest'


def resolve_compute_dtype(compute_dtype: str, platform: str) -> str:
  """model.compute_dtype on a backend (a jax platform name: 'cpu', 'gpu', 'tpu'): `auto` is
  float32 on CPU, bfloat16 on any accelerator; a named dtype stays as it is."""
  if compute_dtype != 'auto':
    return compute_dtype
  return 'float32' if platform == 'cpu' else 'bfloat16'


# Each field is declared once, with setting(): default, doc and what it accepts (choices, forms,
# bounds). The checks, the overrides' coercion and docs/config.md are derived from these.
@dataclass(frozen=True)
class ModelConfig:
  kind: str = setting('llama', 'the model (`--model`): llama | gpt2 (built in) or '
                      'MODULE:FACTORY, a model of the contract (model/contract.py) whose factory '
                      'gets this section; a resume keeps the run\'s')
  vocab_size: int = setting(256, 'vocabulary size; follows the data\'s tokenizer (256 = bytes, '
                            'the built-in corpus)', within='>= 1')
  d_model: int = setting(64, 'residual width', within='>= 1')
  n_layers: int = setting(2, 'transformer blocks', within='>= 1')
  n_heads: int = setting(4, 'attention heads (must divide `d_model`; head dim must be even for '
                         'RoPE)', within='>= 1')
  ffn_dim: int = setting(172, 'SwiGLU hidden width', within='>= 1')
  seq_len: int = setting(64, 'tokens per sequence', within='>= 1')
  rope_theta: float = setting(10000.0, 'RoPE base', within='(0, inf)')
  norm_eps: float = setting(1e-6, 'RMSNorm epsilon', within='(0, inf)')
  init_std: float = setting(0.02, 'std of the normal init of the weights', within='(0, inf)')
  compute_dtype: str = setting(
      'auto', 'activations and matmuls; auto = bfloat16 on TPU/GPU, float32 on CPU (its bfloat16 '
      'matmuls are emulated, slower), resolved by resolve_compute_dtype where the backend is '
      'known (the resolved value is in the log, `report.json` and `run_state.json`)',
      choices=('auto', *COMPUTE_DTYPES),
      on_resume=MAY_CHANGE)
  param_dtype: str = setting('float32', 'stored parameters and optimizer state',
                             choices=('float32', 'bfloat16'))

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads


@dataclass(frozen=True)
class MeshConfig:
  slice: int = setting(-1, 'data-parallel slices (replicas, the unit that fails); -1 = all '
                       'devices left after fsdp × tensor', within='>= 1', also=(-1,),
                       hint='all devices')
  fsdp: int = setting(1, 'in-slice parameter sharding (ZeRO-3 style)', within='>= 1')
  tensor: int = setting(1, 'in-slice tensor parallelism', within='>= 1')
  ordered_reduce: bool = setting(
      False, 'sum gradients across slices in slice order (gather, then add) instead of XLA\'s '
      'all-reduce, whose order depends on the collective library: params then match bit for bit '
      'whatever the process layout, at slices × gradient memory and an extra program per step')


@dataclass(frozen=True)
class MeCeFOConfig:
  basis: str = setting('svd', 'a name in model/bases.py\'s BASES: svd (paper: top singular '
                       'subspace of W, randomized SVD) | gaussian (fresh each step, unbiased)',
                       choices=BASIS_NAMES)
  rank: int = setting(0, 'rank of the low-rank FFN weight gradients, at most min(d_model, '
                      'ffn_dim); 0 = `rank_fraction` × d_in of each matrix', within='>= 0',
                      hint='0 = auto')
  rank_fraction: float = setting(0.25, 'rank as a fraction of d_in when `rank` is 0',
                                 within='(0, 1]')
  tau: int = setting(10, 'svd bases are recomputed every `tau` steps while degraded steps run',
                     within='>= 1')
  power_iters: int = setting(2, 'randomized-SVD power iterations', within='>= 0')
  refresh: str = setting('warm', 'svd refresh after the first: warm (one subspace iteration '
                         'from the last bases, ≈ 6× cheaper, same gradient error) | full '
                         '(randomized SVD each time)', choices=('warm', 'full'))
  ffn_remat: str = setting('dots', 'degraded FFN checkpoint: dots (keep gate/up outputs) | full '
                           '(keep only the FFN input)', choices=('full', 'dots'))


@dataclass(frozen=True)
class OptimizerConfig:
  lr: float = setting(3e-3, 'AdamW peak learning rate', within='(0, inf)',
                      on_resume=MAY_CHANGE)
  warmup_steps: int = setting(20, 'linear warmup steps', within='>= 0',
                              on_resume=MAY_CHANGE)
  min_lr_ratio: float = setting(0.1, 'cosine decay to `lr` × `min_lr_ratio` at `train.steps`',
                                within='[0, 1]',
                                on_resume=MAY_CHANGE)
  b1: float = setting(0.9, 'AdamW β1', within='[0, 1)')
  b2: float = setting(0.95, 'AdamW β2', within='[0, 1)')
  eps: float = setting(1e-8, 'AdamW ε', within='[0, inf)')
  weight_decay: float = setting(0.1, 'decoupled weight decay (matrices only)', within='[0, inf)')
  grad_clip: float = setting(1.0, 'global-norm gradient clip; 0 disables', within='[0, inf)',
                             hint='0 disables clipping')


@dataclass(frozen=True)
class TrainConfig:
  steps: int = setting(200, 'training steps', within='>= 1',
                       on_resume=MAY_GROW)
  samples: int = setting(0, 'end once this many samples of the stream are trained, whatever '
                         'fails (0: at train.steps, which stays the schedule\'s length: set it '
                         'to samples / global batch); under `requeue` slices down take more '
                         'steps', within='>= 0', on_resume=MAY_GROW)
  tokens: int = setting(0, 'train.samples in tokens (samples = ceil(tokens / model.seq_len)); '
                        '0 = none', within='>= 0', on_resume=MAY_GROW)
  micro_batch: int = setting(8, 'sequences per slice per step; global batch = slices × '
                             'micro_batch', within='>= 1')
  # jax.random.PRNGKey takes a signed 64-bit seed.
  seed: int = setting(0, 'seed of the init, the data order and the failure presets',
                      within='[0, 2**63)')
  log_every: int = setting(10, 'steps between metrics rows / log lines (the last step '
                           'trained, a stopped run\'s too, is always logged)', within='>= 1',
                           on_resume=MAY_CHANGE)
  out_dir: str = setting(DEFAULT_OUT, 'run directory (`--out`); a new run here replaces a '
                         'finished one (README: Snapshots)',
                         on_resume=MAY_CHANGE)
  data: str = setting('synthetic', 'synthetic | tokens:DIR (prepared) | text:PATH | pydoc | '
                      'tokens:FILE.npy | tokens:FILE?dtype=uint16 | hf:NAME (`--data`; checked '
                      'by data/sources.py)')
  eval_every: int = setting(100, 'held-out eval every N steps and at the end; 0 = only at the '
                            'end', within='>= 0',
                            on_resume=MAY_CHANGE)
  eval_batches: int = setting(4, 'batches per eval, each live slices × `micro_batch` sequences',
                              within='>= 1',
                              on_resume=MAY_CHANGE)
  plot: bool = setting(True, 'write `training.png` at the end of the run (python -m '
                       'mecefo_jax.run.plot)',
                       on_resume=MAY_CHANGE)
  compile_cache: str = setting(
      '~/.cache/mecefo-jax/xla', 'directory of the program store of `train.py` (step/program_store.py; '
      '`programs/` in it; \'\' = off; `JAX_COMPILATION_CACHE_DIR` takes precedence): restarts '
      'and new runs load their programs instead of compiling them',
      on_resume=MAY_CHANGE)
  program_store_mb: int = setting(4096, 'size limit of the program store (least recently used '
                                  'evicted first)',
                                  on_resume=MAY_CHANGE)
  move_programs: str = setting(
      'auto', 'a program compiled for one set of slices is moved onto other sets of the same '
      'shape instead of compiled again (step/retarget.py): auto = on where its start-up probe '
      'passes, off on TPU; never compiles per set, always moves on TPU too', choices=AUTO_MODES,
      on_resume=MAY_CHANGE)


@dataclass(frozen=True)
class FaultConfig:
  failures: str = setting('none', 'failure presets (docs/algorithm.md §5) or a trace file: '
                          '`step slice fail|repair` lines or a JSON node fault log (`--failures`; '
                          'docs/failures.md)', choices=('none', *PRESETS),
                          forms=('trace:PATH',))
  rate: str = setting('per_device', 'per_device: a preset\'s interval is per device of the '
                      'paper\'s 32-device cluster, so the expected fraction of slices down is the '
                      'paper\'s at any slice count; cluster: for the whole cluster',
                      choices=RATES)
  # requeue: the pick of docs/failures.md's rule ("How the default is chosen") on the shared
  # fault log (docs/results/default_pick_infinitehbd.json; tests/test_plan.py holds it there).
  takeover: str = setting('requeue', 'who processes a failed slice\'s micro-batch: requeue '
                          '(default: no row degraded or dropped, a failed slice\'s samples train '
                          'in later steps) | neighbor (paper) | spread, exact, budget (ours) | '
                          'drop | naive (baselines) (`--takeover`)', choices=POLICIES)
  time_budget: float = setting(
      1.0, '`budget`: each live slice\'s step cost stays within this multiple of the fault-free '
      'step\'s (exact row 1, degraded row `degraded_cost`) with the fewest degraded rows; inf = '
      'all rows exact', within='[1, inf]',
      hint='a multiple of the fault-free step time; inf = never degrade')
  cluster_step_s: float = setting(60.0, 'simulated cluster seconds per step, so that short runs '
                                  'cover hours of the presets', within='(0, inf)')
  trace_nodes: int = setting(0, 'a JSON node fault log: the cluster\'s size (a log lists only the '
                             'nodes that failed); each slice replays one of its nodes, drawn with '
                             '`train.seed`; 0 = the nodes in the log', within='>= 0')
  trace_classes: str = setting('all', 'a JSON node fault log: the fault classes that count, '
                               'comma-separated Level or Class names, `-NAME` to leave one out '
                               '(e.g. `-Stress Test Failure`)')
  trace_start_day: float = setting(0.0, 'a JSON node fault log: the day of the log step 0 is; a '
                                   'fault open then is down from step 0', within='[0, inf)')
  trace_compress: float = setting(1.0, 'a JSON node fault log: log seconds per simulated second '
                                  '(step = log seconds / (compress × `cluster_step_s`)), so that '
                                  'short runs cover days of the log', within='(0, inf)')
  max_degraded_rows: int = setting(0, 'most rows one degraded pass holds; 0 = 2 × '
                                   '`train.micro_batch`', within='>= 0')
  degraded_cost: float = setting(DEGRADED_COST, '`budget`: cost of a degraded row relative to an '
                                 'exact one (FLOP ratio on llama_60m)', within='(0, 1)')
  precompile: str = setting(
      'auto', 'build the programs of live sets one failure or repair away in a background thread, '
      'likeliest first (compile new shapes, move the others): auto = on for GPU/TPU, off on CPU '
      '(it would take the step\'s cores) but for a job of several processes; with several '
      'processes: compiles into the program store, after the first step, the programs of the '
      'job that restarts after each host\'s death (once per shape)', choices=AUTO_MODES,
      on_resume=MAY_CHANGE)
  precompile_max: int = setting(64, 'most programs kept built ahead of need; 0 = no limit',
                                within='>= 0',
                                on_resume=MAY_CHANGE)


@dataclass(frozen=True)
class SnapshotConfig:
  enabled: bool = setting(True, 'in-memory snapshots and durable checkpoints (`--no-snapshots`)',
                          on_resume=MAY_CHANGE)
  dir: str = setting('', 'in-memory tier; \'\' = `/dev/shm/mecefo/<run name>` (tmpfs: '
                     'outlives the trainer)',
                     on_resume=MAY_CHANGE)
  every: int | str = setting(
      1, 'steps between in-memory snapshots, or auto: the smallest interval whose measured cost '
      'stays within `overhead_budget` of the step time (snapshot/interval.py), at most '
      '`max_every`', within='>= 1', also=('auto',),
      on_resume=MAY_CHANGE)
  overhead_budget: float = setting(0.01, '`every=auto`: the share of step time snapshots may '
                                   'take', within='(0, 1)',
                                   on_resume=MAY_CHANGE)
  max_every: int = setting(100, '`every=auto`: the largest interval (the steps a crash may '
                           'cost)', within='>= 1',
                           on_resume=MAY_CHANGE)
  keep: int = setting(2, 'in-memory snapshots kept (in a job of several processes at least 3 per host: their saves finish out of step)', within='>= 1',
                      on_resume=MAY_CHANGE)
  durable_dir: str = setting('', 'durable Orbax tier (local dir or bucket); \'\' = '
                             '`<out_dir>/checkpoints`',
                             on_resume=MAY_CHANGE)
  durable_every: int = setting(100, 'steps between durable checkpoints; 0 = none', within='>= 0',
                               on_resume=MAY_CHANGE)
  durable_keep: int = setting(3, 'durable checkpoints kept', within='>= 1',
                              on_resume=MAY_CHANGE)
  keep_when_finished: bool = setting(False, 'keep the in-memory tier after a finished run (else '
                                     'removed, freeing /dev/shm)',
                                     on_resume=MAY_CHANGE)


@dataclass(frozen=True)
class Config:
  model: ModelConfig = field(default_factory=ModelConfig)
  mesh: MeshConfig = field(default_factory=MeshConfig)
  mecefo: MeCeFOConfig = field(default_factory=MeCeFOConfig)
  optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
  train: TrainConfig = field(default_factory=TrainConfig)
  faults: FaultConfig = field(default_factory=FaultConfig)
  snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)


def _across_fields(cfg: Config) -> typing.Iterator[str]:
  """The refusals of the rules between fields (each rule of one field is declared on it)."""
  m, most = cfg.model, min(cfg.model.d_model, cfg.model.ffn_dim)
  if m.kind not in MODELS and not _module_factory(m.kind):
    yield f"model.kind must be one of {', '.join(MODELS)} or MODULE:FACTORY, got {m.kind!r}"
  if m.d_model % m.n_heads:
    yield f'model.n_heads={m.n_heads} must divide model.d_model={m.d_model}'
  elif m.head_dim % 2 and m.kind == 'llama':
    yield f'model.d_model / model.n_heads = {m.head_dim} must be even for RoPE'
  if cfg.train.micro_batch % cfg.mesh.fsdp:
    yield (f'train.micro_batch={cfg.train.micro_batch} must be divisible by '
           f'mesh.fsdp={cfg.mesh.fsdp}')
  if cfg.train.samples and cfg.train.tokens:
    yield (f'train.samples={cfg.train.samples} and train.tokens={cfg.train.tokens}: give one '
           'budget (tokens are samples x model.seq_len)')
  if cfg.mecefo.rank > most:
    yield f'mecefo.rank must be in [0, {most}] (0 = auto), got {cfg.mecefo.rank}'


def sample_budget(cfg: Config) -> int:
  """The samples a run trains to: train.samples, or train.tokens in whole samples (0: none, the
  run ends at train.steps)."""
  return cfg.train.samples or -(-cfg.train.tokens // cfg.model.seq_len)


def end_setting(cfg: Config) -> tuple[str, int, str]:
  """(key, value, unit) of the setting a run ends at: train.tokens, train.samples or
  train.steps."""
  t = cfg.train
  return (('train.tokens', t.tokens, 'tokens') if t.tokens else
          ('train.samples', t.samples, 'samples') if t.samples else
          ('train.steps', t.steps, 'steps'))


def trained_to_end(cfg: Config, steps_done: int, samples_done: int) -> bool:
  """Whether a run with `steps_done` steps and `samples_done` samples of the stream (trained,
  or under a step-indexed policy counted) has reached its end: the sample budget, else
  train.steps."""
  budget = sample_budget(cfg)
  return samples_done >= budget if budget else steps_done >= cfg.train.steps


def _module_factory(kind: str) -> bool:
  module, _, factory = kind.partition(':')
  return bool(module) and bool(factory)


def validate(cfg: Config) -> Config:
  """Every field's declared rule, then the rules between fields (which may assume the former);
  the first refusal is raised. Mesh-vs-devices is checked when the mesh is built."""
  refusals = (rule.refusal(key, value) for key, value, _, rule in leaves(cfg))
  problem = next((p for p in itertools.chain(refusals, _across_fields(cfg)) if p), None)
  if problem:
    raise ConfigError(problem)
  return cfg


@functools.cache
def _rules() -> dict[str, Rule]:
  return {key: rule for key, _, _, rule in leaves(Config())}  # leaves() takes ~2 ms


def rule_of(key: str) -> Rule:
  """The declared rule of the config key `key`, e.g. 'faults.failures'."""
  return _rules()[key]


def resume_may_change(key: str, before, after) -> bool:
  """Whether a --resume may change config key `key` from `before` to `after`, as its setting
  declares (`on_resume`); a key this version does not know may not change."""
  rule = _rules().get(key)
  on_resume = rule.on_resume if rule else KEPT
  if on_resume == MAY_GROW:
    return before is None or (after is not None and after >= before)
  return on_resume == MAY_CHANGE


def check_setting(key: str, value, error: type[ValueError] = ConfigError) -> None:
  """Raises `error` where `value` breaks the declared rule of config key `key`: for code that
  takes a setting as an argument (takeover.plan's degraded_cost, SnapshotManager's counts)."""
  problem = rule_of(key).refusal(key, value)
  if problem:
    raise error(problem)


CONFIGS = Path(__file__).parent / 'configs'  # the built-in configs, shipped in the package


def builtin_configs() -> list[str]:
  return sorted(p.stem for p in CONFIGS.glob('*.yaml'))


def config_file(given: str | Path) -> Path:
  """--config: a YAML file, or the name of a built-in one (`tiny` or `tiny.yaml`: CONFIGS), so
  that an installed package finds its configs from any directory."""
  path = Path(given)
  if path.exists() or len(path.parts) > 1:
    return path
  builtin = CONFIGS / (path.name if path.suffix == '.yaml' else f'{path.name}.yaml')
  if builtin.is_file():
    return builtin
  raise ConfigError(f'config {str(given)!r} is neither a file nor a built-in config (one of '
                    f'{", ".join(builtin_configs())})')


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = (),
                base: dict | None = None) -> Config:
  """Defaults (or `base`: a recorded config, e.g. of a run to resume), then the YAML file at
  `path`, then dotted overrides; validated."""
  cfg = apply_updates(Config(), base) if base else Config()
  if path is not None:
    path = Path(path)
    where = f'config file {str(path)!r}'
    data = read_yaml(read_user_text(path, 'config file', ConfigError), where, ConfigError)
    if data is None or data == {}:  # an empty file would silently train Config()'s defaults
      raise ConfigError(f'{where} holds no settings (empty); leave out --config for the '
                        f'built-in defaults, or give a built-in config (--config tiny)')
    if not isinstance(data, dict):
      raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
    cfg = apply_updates(cfg, data)
  for text in overrides:
    cfg = apply_updates(cfg, parse_override(text))
  return validate(cfg)


def to_dict(cfg: Config) -> dict:
  return dataclasses.asdict(cfg)


def markdown() -> str:
  """The table of docs/config.md (python -m mecefo_jax.config prints it)."""
  return settings_markdown(Config())


if __name__ == '__main__':
  print(markdown())
