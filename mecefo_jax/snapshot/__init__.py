"""In-memory (tmpfs) and durable Orbax snapshots, their byte image, checksums, parity and resume."""
