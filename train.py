"""Train a MeCeFO LLaMA-style model: `python train.py [--config configs/X.yaml] [key=value ...]`."""
import sys

from mecefo_jax.run.cli import main

if __name__ == '__main__':
  sys.exit(main())
