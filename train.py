"""Train a MeCeFO LLaMA-style model: `python train.py [--config configs/X.yaml] [key=value ...]`."""
import time

STARTED = time.time()  # before any other import: the start-up clock's origin where /proc is not

import sys  # noqa: E402

from mecefo_jax.run import startup  # noqa: E402  (standard library only)
from mecefo_jax.run.cli import main  # noqa: E402

if __name__ == '__main__':
  startup.mark_entry(STARTED)
  sys.exit(main())
