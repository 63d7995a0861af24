"""Training data: step-indexed sample ids, the built-in synthetic corpus, text/token/HF sources."""
