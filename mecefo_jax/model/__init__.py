"""The models: the contract any model follows (contract.py, models.py), the built-in LLaMA- and
GPT-2-style models, their FFN bases, and the train state."""
