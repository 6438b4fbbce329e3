"""Algorithm math: losses, advantage estimators, KL terms, loss aggregation, whitening, and the
rollout/trainer mismatch metrics and importance-sampling corrections.

Also the preference (DPO family, KTO, SimPO, ORPO), reward-model and distillation losses.

Everything here is a pure function of tensors (the KL controllers are the only state), so it can be
tested on CPU without a model or a process group.  See docs/algorithms.md.  Import the modules themselves:
this file imports nothing, so that the config reads the registries (``registry.py``, no torch) without
loading the tensor code.
"""
