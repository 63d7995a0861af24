"""Train a MeCeFO LLaMA-style model from the checkout: `python train.py [--config tiny] [key=value ...]`
(installed: `mecefo-train` or `python -m mecefo_jax`, the same command)."""
import time

STARTED = time.time()  # before any other import: the start-up clock's origin where /proc is not

import sys  # noqa: E402

from mecefo_jax.__main__ import main  # noqa: E402

if __name__ == '__main__':
  sys.exit(main(started=STARTED))
