"""Reward sources and shaping.

* :class:`RewardFunction`: a Python file's ``reward_func`` (batched, per-batch timeout, failure accounting).
* :func:`start_server` / ``hpc-rlhf serve-reward``: serve a reward function over HTTP.
* :class:`RemoteReward`: score on one or more reward servers (concurrent batches, round robin, retries).
* :class:`RewardModelScorer`: a sequence-classification reward model.
* :mod:`.shaping`: combine sources, running normalisation, clipping, DAPO overlong and truncation penalties.

Every source returns a :class:`RewardBatch`; samples whose reward failed have ``valid`` False (reward NaN).
"""
from __future__ import annotations

from .client import RemoteReward
from .function import RewardFunction
from .model import RewardModelScorer
from .reward_file import load_reward_function
from .server import ServerHandle, start_server
from .shaping import (RunningMoments, clip_rewards, combine, normalize_rewards, overlong_penalty,
                      truncation_penalty)
from .types import RewardBatch, RewardError, RewardFileError

__all__ = [
    "RewardBatch", "RewardError", "RewardFileError", "RewardFunction", "load_reward_function", "start_server",
    "ServerHandle", "RemoteReward", "RewardModelScorer", "combine", "RunningMoments", "normalize_rewards",
    "clip_rewards", "overlong_penalty", "truncation_penalty",
]

