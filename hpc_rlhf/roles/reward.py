"""The reward role: a reward model, a reward-function file and/or remote servers, combined and shaped."""
from __future__ import annotations

import os
from functools import partial
from typing import Callable

import torch

from ..config.rl import AgentConfig, RewardConfig
from ..engines.deepspeed_strategy import build_frozen_engine
from ..rewards.client import RemoteReward
from ..rewards.function import RewardFunction
from ..rewards.model import RewardModelScorer
from ..rewards.shaping import clip_rewards, combine, overlong_penalty
from ..rewards.types import RewardBatch
from .experience import Experience


def _on_tokens(scorer) -> Callable[[list[Experience]], RewardBatch]:
    """A reward model reads the token ids (prompt + response), exactly as generated."""
    def score(samples: list[Experience]) -> RewardBatch:
        values = scorer.score_tokens([s.prompt_ids + s.response_ids for s in samples])
        return RewardBatch(values, torch.ones(len(samples), dtype=torch.bool))
    return score


def _on_text(source) -> Callable[[list[Experience]], RewardBatch]:
    """Reward functions and servers read text: query = prompt + response, with the label."""
    def score(samples: list[Experience]) -> RewardBatch:
        return source.score([s.prompt_text + s.response_text for s in samples], [s.prompt_text for s in samples],
                            [s.label or "" for s in samples])
    return score


def _from_environment(samples: list[Experience]) -> RewardBatch:
    """The environment's total reward (agents/): a sample whose environment failed is invalid."""
    valid = [s.env_error is None and s.env_reward is not None for s in samples]
    failures = float(sum(not v for v in valid))
    return RewardBatch([s.env_reward if v else float("nan") for s, v in zip(samples, valid)], valid,
                       extra={"reward/env/failures": failures} if failures else {},
                       errors=[s.env_error for s in samples if s.env_error])


class RewardRole:
    def __init__(self, reward: RewardConfig, agent: AgentConfig, param_dtype: str, generate_max_len: int, device,
                 zero_stage: int = 0, world_size: int = 1):
        """``param_dtype``: a reward model's; ``generate_max_len``: the rollout's (the overlong penalty's end);
        ``zero_stage`` 3: the reward model sharded over the ``world_size`` ranks of its world (``score`` is then
        collective over them)."""
        r = self.reward_cfg = reward
        self.generate_max_len = generate_max_len
        self.sources: list[tuple[str, Callable[[list[Experience]], RewardBatch]]] = []
        self.scorer = None
        if r.reward_pretrain:
            shard = (partial(build_frozen_engine, param_dtype=param_dtype, world_size=world_size, role="reward model")
                     if zero_stage == 3 else None)
            self.scorer = RewardModelScorer(r.reward_pretrain, dtype=param_dtype, device=str(device),
                                           batch_size=r.reward_batch_size, shard=shard)
            self.sources.append(("model", _on_tokens(self.scorer)))
        if r.reward_func:
            self.sources.append(("func", _on_text(RewardFunction(r.reward_func, batch_size=r.reward_batch_size,
                                                                 timeout_s=r.reward_timeout_s))))
        if r.remote_rm_url:
            token = os.environ.get(r.remote_rm_token_env) if r.remote_rm_token_env else None
            self.sources.append(("remote", _on_text(RemoteReward(r.remote_rm_url, token=token,
                                                                 timeout_s=r.reward_timeout_s,
                                                                 batch_size=r.reward_batch_size))))
        if agent.agent_func_path:
            self.sources.append(("environment", _from_environment))
        self.weights = r.reward_weights or [1.0] * len(self.sources)
        if len(self.weights) != len(self.sources):
            raise ValueError(f"reward.reward_weights has {len(self.weights)} values for {len(self.sources)} "
                             f"reward sources ({', '.join(n for n, _ in self.sources)})")

    def score(self, samples: list[Experience]) -> tuple[list[float], list[bool], dict[str, float],
                                                      list[str | None], list[dict[str, float] | None]]:
        """Raw combined rewards of ``samples`` with the length-based shaping applied, their validity, the
        extras, the answers a reward function extracted (``predictions``; None entries where it gave none,
        and always for reward models), and the reward components of each valid sample ({name: value}; None for
        the others, and for all when there is one source returning plain numbers: ``combine``)."""
        if not samples:
            if self.scorer is not None and self.scorer.sharded:
                self.scorer.score_tokens([])  # the world's other ranks may have samples: its forwards are collective
            return [], [], {}, [], []
        batch = combine([score(samples) for _, score in self.sources], self.weights, [n for n, _ in self.sources])
        rewards = batch.rewards.clone()
        r = self.reward_cfg
        if r.overlong_buffer_len:
            lengths = torch.tensor([s.action_length for s in samples])
            rewards = rewards + overlong_penalty(lengths, self.generate_max_len, r.overlong_buffer_len,
                                                 r.overlong_penalty_factor)
        if r.truncated_reward is not None:
            cut = torch.tensor([s.finish_reason == "length" for s in samples])
            rewards = torch.where(cut, torch.full_like(rewards, r.truncated_reward), rewards)
        if r.reward_clip_range is not None:
            rewards = clip_rewards(rewards, *r.reward_clip_range)
        predictions = batch.predictions if batch.predictions is not None else [None] * len(samples)
        components = [None] * len(samples)
        if batch.components is not None:
            components = [dict(zip(batch.component_names, row)) if ok else None
                          for row, ok in zip(batch.components.tolist(), batch.valid.tolist())]
        return rewards.tolist(), batch.valid.tolist(), dict(batch.extra), list(predictions), components

def environment_weight(reward: RewardConfig, agent: AgentConfig) -> float:
    """The weight of the environment's reward in the combined reward (0 without an environment): the last of
    reward.reward_weights when given (the sources' order is model, function, remote, environment), else 1."""
    if not agent.agent_func_path:
        return 0.0
    return float(reward.reward_weights[-1]) if reward.reward_weights else 1.0
