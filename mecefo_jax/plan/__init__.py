"""mecefo-plan: a node fault log replayed on a fleet, every fault-tolerance approach charged."""
