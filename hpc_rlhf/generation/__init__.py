"""Generation: the rollout engine port (engine.py), its engines (hf.py: plain transformers; lean/: the lean decoder
and its few-row kernel; vllm.py) and the factory that builds the configured one (factory.py)."""
