"""Decisions without devices: failures, the takeover plan, the programs a step needs, the decider.

Nothing here imports jax, flax, optax or orbax, even indirectly (tests/test_core.py).
"""
