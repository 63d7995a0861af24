"""mecefo-jax: MeCeFO fault-tolerant LLM training in JAX/Flax."""
__version__ = "0.1.0"
