"""The LLaMA-style NNX model (thin modules, logical axes on params) and its train state."""
