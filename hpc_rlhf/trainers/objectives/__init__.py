"""Preference objectives as registered units: ``PREFERENCE_OBJECTIVES.get(name)`` returns the unit class.

Importing this package registers every unit (rm, dpo, kto, simpo, orpo, prm, kd).  Adding an objective is one
module with one decorated class, plus its config section in `config/preference.py`.
"""
from . import distill, dpo, kto, process_reward, reference_free, reward_model  # noqa: F401  (registration)
from .common import PREFERENCE_OBJECTIVES, Objective

__all__ = ["PREFERENCE_OBJECTIVES", "Objective"]
