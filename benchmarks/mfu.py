"""Model FLOPs utilisation (MFU) of the normal step on one device, over a sweep of micro-batch sizes.

Run: python -m benchmarks.mfu --config configs/llama_350m.yaml --micro-batches 8,16,32 --json OUT.json
(model.compute_dtype=auto, the default: bfloat16 on an accelerator)
MFU = model FLOPs per step / step time / the device's peak dense bf16 FLOP/s. Model FLOPs follow
the PaLM convention: 6 × matmul params per token (the untied LM head included, the embedding
lookup not) + 12 × layers × seq_len × d_model per token for attention scores (causal masking not
discounted). XLA's own count of the compiled step (forward, backward, AdamW) is reported beside it
as `xla_tflops_per_s`. The peak comes from a table of known devices (`--peak-tflops` overrides);
on a device not in it (a CPU, say) MFU is null.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import jax

from benchmarks import common
from mecefo_jax import sharding
from mecefo_jax.config import Config, ModelConfig, load_config
from mecefo_jax.model import contract, models, train_state
from mecefo_jax.core.roles import Role
from mecefo_jax.step import train_step

# Dense bf16 peak, TFLOP/s, from the vendors' data sheets (no sparsity), by device_kind substring.
# Order matters: the first substring found in the lower-cased device_kind wins.
PEAK_BF16_TFLOPS = (
    ('h200', 989.0), ('h100 pcie', 756.0), ('h100', 989.0), ('a100', 312.0),
    ('tpu v6', 918.0), ('tpu v5 lite', 197.0), ('tpu v5e', 197.0), ('tpu v5', 459.0),
    ('tpu v4', 275.0),
)


def peak_tflops(device_kind: str) -> float | None:
  """The dense bf16 peak of a known device, else None."""
  kind = device_kind.lower()
  return next((peak for key, peak in PEAK_BF16_TFLOPS if key in kind), None)


def model_flops_per_token(m: ModelConfig) -> dict:
  """Training FLOPs per token (forward + backward), PaLM convention."""
  d, f = m.d_model, m.ffn_dim
  block_params = 4 * d * d + 3 * d * f
  matmul_params = m.n_layers * block_params + d * m.vocab_size
  attention = 12 * m.n_layers * m.seq_len * d
  return {'matmul_params': matmul_params, 'attention': attention,
          'total': 6 * matmul_params + attention}


def measure(cfg: Config, micro_batches: list[int], repeats: int) -> dict:
  """Times the normal step at each micro-batch size, all programs interleaved on one state."""
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  graphdef = models.spec(cfg.model).graphdef
  roles = {b: Role(exact=b) for b in micro_batches}
  compiled = {b: train_step.lower_step(cfg, mesh, r, graphdef).compile() for b, r in roles.items()}
  states = {'shared': train_state.create_sharded(cfg, mesh)}
  runners = common.donating_runners(compiled, states, common.random_tokens(cfg, roles),
                                    train_state.schedule_on(cfg, mesh), state_of=lambda b: 'shared')
  times = common.interleaved_times(runners, repeats)
  return {b: {'time': times[b], 'memory': train_step.memory_summary(compiled[b]),
              'xla_flops': common.unrolled_flops(
                  lambda b=b: train_step.lower_step(cfg, mesh, roles[b], graphdef)) or None}
          for b in roles}


def rows(cfg: Config, measured: dict, peak: float | None) -> list[dict]:
  """One row per micro-batch: step time, tokens/s, model and XLA TFLOP/s, MFU."""
  per_token = model_flops_per_token(cfg.model)['total']
  out = []
  for b, m in measured.items():
    seconds = m['time']['median_s']
    tokens = b * cfg.model.seq_len
    model_tflops = per_token * tokens / seconds / 1e12
    xla = m['xla_flops']
    out.append({
        'micro_batch': b, 'tokens': tokens, 'median_ms': 1e3 * seconds,
        'tokens_per_s': tokens / seconds, 'model_tflops_per_s': model_tflops,
        'model_tflop_per_step': per_token * tokens / 1e12,
        'xla_tflop_per_step': xla / 1e12 if xla else None,  # XLA's count of the compiled step
        'xla_tflops_per_s': xla / seconds / 1e12 if xla else None,
        'mfu': model_tflops / peak if peak else None,
        'temp_MiB': m['memory'].get('temp_bytes', 0) / 2**20,
    })
  return out


def main(argv=None):
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument('--micro-batches', default='',
                 help='comma-separated micro-batch sizes (default: the config\'s train.micro_batch)')
  p.add_argument('--repeats', type=int, default=10)
  p.add_argument('--peak-tflops', type=float, default=None,
                 help='peak dense FLOP/s of the device in TFLOP/s (default: from the known-device table)')
  args = p.parse_args(argv)
  cfg = load_config(args.config, ['mesh.slice=1', 'mesh.fsdp=1', 'mesh.tensor=1', *args.overrides])
  fields = [b for b in args.micro_batches.split(',') if b]
  if not all(b.isdigit() and int(b) > 0 for b in fields):
    p.error(f'--micro-batches must be positive integers, got {args.micro_batches!r}')
  batches = [int(b) for b in fields] or [cfg.train.micro_batch]
  info = common.run_info(__spec__.name, argv)
  device = info['device']
  peak = args.peak_tflops or peak_tflops(device['device_kind'])
  table = rows(cfg, measure(cfg, batches, args.repeats), peak)
  best = max((r['mfu'] for r in table if r['mfu'] is not None), default=None)
  dtype = contract.compute_dtype(cfg.model).name  # `auto` resolved on this backend
  result = {
      **info, 'config': args.config, 'overrides': args.overrides,
      'compute_dtype': dtype, 'peak_tflops': peak,
      'peak_source': 'argument' if args.peak_tflops else ('table' if peak else None),
      'model_flops_per_token': model_flops_per_token(cfg.model), 'rows': table, 'best_mfu': best,
  }
  if peak is None:
    print(f'note: no peak FLOP/s known for {device["device_kind"]!r}; pass --peak-tflops for MFU')
  if dtype != 'bfloat16' and peak is not None:
    print(f'note: MFU is against the bf16 peak, and this run computes in {dtype} '
          '(model.compute_dtype=auto is bfloat16 on accelerators)')
  common.emit(result, common.markdown_table(table, list(table[0])), args.json)
  return result


if __name__ == '__main__':
  main()
