"""Offline objectives as registered units: ``OFFLINE_OBJECTIVES.get(name)`` returns the unit class.

Importing this package registers every unit (sft, rm, dpo, kto, simpo, orpo, prm, kd).  Adding an objective is
one module with one decorated class, plus its objective section and its `_trainer` line in `config/preference.py`
(sft has its own config, `config/sft.py`).
"""
from . import distill, dpo, kto, process_reward, reference_free, reward_model, sft  # noqa: F401  (registration)
from .common import OFFLINE_OBJECTIVES, Objective

__all__ = ["OFFLINE_OBJECTIVES", "Objective"]
