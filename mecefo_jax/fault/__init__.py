"""Failure handling on devices: the controller, which runs the decider's plans (core/decider.py)."""
