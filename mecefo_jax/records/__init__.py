"""Records more than one package reads (the trainer and the supervisor, run/ and snapshot/): each a
dataclass of sections.entry fields with one reader and one writer; no jax here."""
