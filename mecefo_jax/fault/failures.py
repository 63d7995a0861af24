"""Where FailureSchedule was imported from before core/ existed: kept for user code."""
from mecefo_jax.core.failures import (PRESETS, FailureEvent, FailureSchedule,  # noqa: F401
                                      poisson_events, write_trace)
