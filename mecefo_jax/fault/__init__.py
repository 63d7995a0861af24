"""Failure handling: failure schedules, the takeover planner, the host controller, the simulator."""
