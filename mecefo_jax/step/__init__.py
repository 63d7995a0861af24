"""Train-step programs: the normal and degraded steps, per-slice programs, and their cache."""
