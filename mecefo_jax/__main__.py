"""`python -m mecefo_jax` and `mecefo-train`: train.py's command, from the installed package."""
import time

STARTED = time.time()  # before any other import: the start-up clock's origin where /proc is not

import sys  # noqa: E402

from mecefo_jax.run import startup  # noqa: E402  (standard library only)


def main(argv=None, started: float = STARTED) -> int:
  """`started`: time.time() at the entry's first statement (train.py passes its own)."""
  startup.mark_entry(started)
  from mecefo_jax.run import hints
  from mecefo_jax.run.cli import main as train
  hints.entered(sys.argv[0])
  return train(argv)


if __name__ == '__main__':
  sys.exit(main())
