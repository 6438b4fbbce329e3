"""Batch data pipelines: generation, reward scoring, best-of-n / pairs / conditional-SFT builders, iterative DPO."""
