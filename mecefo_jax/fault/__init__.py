"""Failure handling: failure schedules, the host controller, the goodput ledger."""
