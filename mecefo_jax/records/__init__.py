"""Records more than one package reads (the trainer and the supervisor, run/ and snapshot/): each a
dataclass of sections.entry fields with one reader and one writer; and the rest of the job's
protocol between the trainer and its supervisors (job.py, run_dir.py); no jax here."""
