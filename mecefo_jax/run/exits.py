"""The exit codes of train.py and of the supervisor that runs it (docs/errors.md)."""
import signal

BAD_INPUT = 2  # config, flags, data or run directory: one `error: ...` line
ALL_DOWN = 3  # every slice down: stopped, resumable once slices are back
DIVERGED = 4  # a non-finite training loss
CHECKPOINTS_FAILING = 5  # durable saves kept failing: stopped, resumable from in-memory snapshots
OUTPUTS_FAILING = 6  # a run-directory write failed (a full disk): stopped after its step, resumable
PEER_LOST = 7  # a collective failed: a peer process of the job is gone (one `error:` line)
STOPPED = 128 + signal.SIGTERM  # SIGTERM or Ctrl-C: checkpointed at the end of a step, resumable
INTERRUPTED = 128 + signal.SIGINT  # Ctrl-C without a final snapshot (too early, or twice)
# train.py's own stops: every process of a job exits with them alike, so none is a death.
JOB_EXITS = {BAD_INPUT: 'bad input', ALL_DOWN: 'all slices down', DIVERGED: 'diverged',
             CHECKPOINTS_FAILING: 'durable checkpoints failing',
             OUTPUTS_FAILING: 'run directory not writable'}
