"""The collect phase of the RL step: generate and score, with dynamic filtering, the async samples made ahead,
and the eval (n samples per eval prompt, pass@k).  Each generate and each score ends in one exchange, so every
rank holds every sample.

- ``PromptSchedule``: which prompts a step draws (the epoch order; replacements under dynamic filtering);
- ``AheadBuffer``: with ``train.async_train``, the samples a rollout-only rank generated for the next step
  while the actor trained (kept in the checkpoint, so a resumed run uses the very same samples);
- ``Collector``: the phase itself.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from ..algorithms.eval_metrics import EvalSample, eval_report
from ..data.batching import EpochSampler
from ..data.prompts import Prompt
from ..distributed.worlds import RoleContext
from ..roles.experience import Experience, shard_groups


EVAL_STEP = -1  # eval sample j of eval prompt i has the seed sample_seed(train.seed, -1, i, j) at every eval


class PromptSchedule:
    def __init__(self, prompts: list[Prompt], rollout_batch_size: int, seed: int, num_episodes: int,
                 max_steps: int | None, shuffle: bool = True):
        self.prompts, self.batch, self.seed = prompts, rollout_batch_size, seed
        self.sampler = EpochSampler(len(prompts), rollout_batch_size, 1, 0, seed, shuffle)
        self.total_steps = self.sampler.steps_per_epoch * num_episodes
        if max_steps is not None:
            self.total_steps = min(self.total_steps, max_steps)

    def draw(self, step: int, round_: int, count: int) -> list[tuple[int, Prompt]]:
        """Round 0: the step's prompts; later rounds (dynamic filtering): ``count`` replacements, seeded by the
        step.  Each with its index in the step (its group id)."""
        if round_ == 0:
            epoch, in_epoch = divmod(step, self.sampler.steps_per_epoch)
            idx = self.sampler.step_indices(epoch, in_epoch)
        else:
            g = torch.Generator().manual_seed(self.seed * 7919 + step * 104729 + round_)
            idx = torch.randperm(len(self.prompts), generator=g)[:count].tolist()
        return [(round_ * self.batch + j, self.prompts[i]) for j, i in enumerate(idx)]


class AheadBuffer:
    def __init__(self, shard_id: list[int]):
        self.shard_id = shard_id  # [index, count] of this rollout rank: samples made ahead are its share
        self.held: tuple[int, list[Experience], dict[str, int]] | None = None

    def put(self, step: int, made: tuple[list[Experience], dict[str, int]]) -> None:
        """The samples made ahead for ``step`` and the engine's work making them (``Collector._own_samples``)."""
        self.held = (step, *made)

    def take(self, step: int) -> tuple[list[Experience], dict[str, int]] | None:
        if self.held is None or self.held[0] != step:
            return None
        made, self.held = self.held[1:], None
        return made

    def state(self) -> dict | None:
        if self.held is None:
            return None
        return {"ahead_step": self.held[0], "ahead_samples": self.held[1], "ahead_work": self.held[2],
                "ahead_shard": self.shard_id}

    def load(self, state: dict | None) -> None:
        # samples made ahead are this rank's share of the prompts: with another rollout layout, generate afresh
        if state is not None and state["ahead_shard"] == self.shard_id:
            self.held = (state["ahead_step"], state["ahead_samples"], state.get("ahead_work", {}))


class Collector:
    def __init__(self, cfg, ctx: RoleContext, rollout, reward, schedule: PromptSchedule,
                 eval_prompts: list[Prompt]):
        self.r, self.ctx, self.rollout, self.reward = cfg.rollout, ctx, rollout, reward
        self.eval_cfg = cfg.eval
        # the eval samples' file is written by the first rank that holds their scores (a rank besides rollout)
        self.samples_dir = None
        if cfg.eval.save_samples:
            writer = min(r for r in range(ctx.plan.world_size) if ctx.plan.roles_of(r) != ("rollout",))
            if ctx.global_rank == writer:
                self.samples_dir = Path(cfg.ckpt.save_path) / "eval_samples"
        self.schedule, self.eval_prompts = schedule, eval_prompts
        # async_train: the rollout-only ranks generate the next step's samples while the others train
        self.generates_ahead = cfg.train.async_train and ctx.trainers is None
        k, n = ctx.role_rank("rollout"), len(ctx.plan.ranks_of("rollout"))
        self.shard = slice(k, None, n)  # a rollout rank generates prompts[k::n]
        self.ahead = AheadBuffer([k, n])
        self.policy_step = 0  # RL steps of training behind the weights the rollout engine holds now
        self.generate_s = 0.0

    def exchange_trainers(self, mine):
        """Among the ranks with a role besides rollout (rollout-only ranks are elsewhere: [] there)."""
        return self.ctx.trainers.all_gather_object(mine) if self.ctx.trainers is not None else []

    def _own_samples(self, prompts: list[tuple[int, Prompt]], step: int,
                     salt: int) -> tuple[list[Experience], dict[str, int]]:
        """On a rollout rank: the samples of its share of ``prompts``, with the weights it holds now, and the
        engine's work making them (its counters' difference: ``RolloutEngine.work_done``)."""
        t0, before = time.time(), self.rollout.engine.work_done()
        out = self.rollout.generate(prompts[self.shard], step, self.r.n_samples_per_prompt, salt=salt)
        self.generate_s = time.time() - t0
        for s in out:
            s.policy_step = self.policy_step
        return out, {k: v - before.get(k, 0) for k, v in self.rollout.engine.work_done().items()}

    def _generate(self, prompts, step: int, salt: int, ready=None) -> tuple[list[Experience], dict[str, float]]:
        """Every rank: the samples of ``prompts`` from all rollout ranks (``ready``: this rank's, made ahead) and
        the engines' work making them, summed over the rollout ranks as ``rollout/<counter>``."""
        mine, work = [], {}
        if self.rollout is not None:
            mine, work = ready if ready is not None else self._own_samples(prompts, step, salt)
        parts = self.ctx.control.all_gather_object((mine, work))
        samples = sorted((s for part, _ in parts for s in part), key=lambda s: s.uid)
        return samples, _summed({f"rollout/{k}": float(v) for k, v in w.items()} for _, w in parts)

    def _gathered(self, mine: list[Experience]) -> list[Experience]:
        samples = [s for part in self.ctx.control.all_gather_object(mine) for s in part]
        return sorted(samples, key=lambda s: s.uid)

    def _score(self, samples: list[Experience]) -> dict[str, float]:
        """Rewards onto the samples.  Rollout-only ranks take part only under dynamic filtering (they pick
        the replacement prompts); otherwise they get no scores and go on generating."""
        mine, extra = {}, {}
        if self.reward is not None:
            shard = shard_groups(samples, len(self.ctx.plan.ranks_of("reward")), self.ctx.role_rank("reward"))
            rewards, valid, extra, predictions, components = self.reward.score(shard)
            mine = {s.uid: (r, v, p, c) for s, r, v, p, c in zip(shard, rewards, valid, predictions, components)}
        exchange = self.ctx.control.all_gather_object if self.r.dynamic_filtering else self.exchange_trainers
        gathered = exchange((mine, extra))
        if not gathered:
            return {}
        scores = {k: v for part, _ in gathered for k, v in part.items()}
        for s in samples:
            s.reward, s.reward_valid, s.prediction, s.reward_components = scores[s.uid]
        return _summed(e for _, e in gathered)

    def collect(self, step: int) -> tuple[list[Experience], dict[str, float]]:
        """Generate and score; with dynamic filtering, replace groups whose valid rewards are all equal (or
        fewer than two).  Then, on
        rollout-only ranks under async_train, the next step's samples."""
        t0 = time.time()
        samples, metrics = self._rounds(step)
        if self.generates_ahead and step + 1 < self.schedule.total_steps:
            self.ahead.put(step + 1, self._own_samples(self.schedule.draw(step + 1, 0, 0), step + 1, 0))
        if self.rollout is not None and self.ctx.role_rank("rollout") == 0:
            metrics["time/rollout_generate_s"] = self.generate_s  # the last generation of the leader
        metrics["time/generate_score_s"] = time.time() - t0
        return samples, metrics

    def _rounds(self, step: int) -> tuple[list[Experience], dict[str, float]]:
        B, n = self.r.rollout_batch_size, self.r.n_samples_per_prompt
        kept: list[Experience] = []
        dropped: list[Experience] = []
        metrics: dict[str, float] = {}
        for round_ in range(self.r.dynamic_filtering_max_rounds if self.r.dynamic_filtering else 1):
            samples, work = self._generate(self.schedule.draw(step, round_, B - len(kept) // n), step, salt=round_,
                                           ready=self.ahead.take(step) if round_ == 0 else None)
            metrics = _summed([metrics, work, self._score(samples)])
            if not self.r.dynamic_filtering:
                return samples, metrics
            for g in sorted({s.prompt_index for s in samples}):
                group = [s for s in samples if s.prompt_index == g]
                # the environment's scores where it gives them (agents/), else the rewards; fewer than two valid
                # samples: no advantage either
                rewards = [s.reward if s.score is None else s.score for s in group if s.reward_valid]
                (kept if len(rewards) > 1 and max(rewards) - min(rewards) > 1e-6 else dropped).extend(group)
            if len(kept) // n >= B:
                break
        kept = kept[:B * n]
        filled = B - len(kept) // n
        kept += dropped[:filled * n]
        metrics["rollout/filtered_groups"] = len(dropped) // n
        metrics["rollout/filled_groups"] = filled
        return kept, metrics

    def evaluate(self, done: int) -> dict[str, float]:
        """The eval after ``done`` steps: eval.eval_n_samples_per_prompt samples of every eval prompt with the
        eval.* sampling settings, generated by the rollout ranks (each its share, eval_batch_size prompts per
        call) and scored by the reward role; the metrics of algorithms/eval_metrics.py (docs/eval.md), the
        same on every rank.  A sample's seed depends on its prompt and index only: every eval (and `hpc-rlhf
        eval` with the same seed) draws the same randomness, so evals differ by the weights alone."""
        e, t0 = self.eval_cfg, time.time()
        samples = self._gathered(self._eval_samples() if self.rollout is not None else [])
        t1 = time.time()
        extra = self._score(samples)
        report = None
        if self.ctx.trainers is not None:  # these ranks hold the scores (rollout-only ranks may not)
            report = eval_report([EvalSample(s.prompt_index, s.sample_index, s.reward_valid, s.reward,
                                             getattr(s, "prediction", None), self.eval_prompts[s.prompt_index].dataset)
                                  for s in samples], e.eval_n_samples_per_prompt, e.correct_threshold)
            report.update({f"eval/{k}": v for k, v in extra.items()
                           if not k.endswith(("failures", "batches", "time_s"))})
            report.update({f"eval/{k}": v for k, v in agent_metrics(samples).items()})
            report.update({"eval/samples": float(len(samples)), "time/eval_generate_s": t1 - t0,
                           "time/eval_score_s": time.time() - t1})
            if self.samples_dir is not None:
                write_eval_samples(samples, e.correct_threshold, self.samples_dir / f"step_{done}.jsonl")
        report = next(r for r in self.ctx.control.all_gather_object(report) if r is not None)
        return report | {"time/eval_s": time.time() - t0}

    def _eval_samples(self) -> list[Experience]:
        """On a rollout rank: the samples of its share of the eval prompts."""
        e, params = self.eval_cfg, self.rollout.params
        params = dataclasses.replace(params, temperature=e.eval_temperature, top_p=e.eval_top_p, top_k=0,
                                     max_new_tokens=e.eval_max_new_tokens or params.max_new_tokens)
        share = list(enumerate(self.eval_prompts))[self.shard]
        per_call = e.eval_batch_size or max(len(share), 1)
        out = []
        for i in range(0, len(share), per_call):
            out += self.rollout.generate(share[i:i + per_call], EVAL_STEP, e.eval_n_samples_per_prompt, params=params)
        for s in out:
            s.policy_step = self.policy_step
        return out


def write_eval_samples(samples: list[Experience], threshold: float, path: Path) -> None:
    """One JSON row per eval sample, in prompt and sample order (``eval.save_samples``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for s in sorted(samples, key=lambda s: (s.prompt_index, s.sample_index)):
            f.write(json.dumps({"prompt_id": s.prompt_index, "sample": s.sample_index, "prompt": s.prompt_text,
                                "response": s.response_text, "label": s.label, "valid": s.reward_valid,
                                "reward": s.reward if s.reward_valid else None,
                                "correct": bool(s.reward_valid and s.reward >= threshold),
                                "prediction": getattr(s, "prediction", None)}, ensure_ascii=False) + "\n")
    tmp.replace(path)


def agent_metrics(samples: list[Experience]) -> dict[str, float]:
    """Multi-turn samples (agents/): ``rollout/truncated`` (the fraction a limit cut), ``rollout/turns``
    (mean turns), ``rollout/env_failures`` and the means of the environment's ``extra_logs`` as
    ``agent/KEY``; nothing for single-turn samples."""
    if not samples or all(s.action_mask is None for s in samples):
        return {}
    out = {"rollout/truncated": sum(s.finish_reason == "length" for s in samples) / len(samples),
           "rollout/turns": sum(max(len(s.turn_ends), 1) for s in samples) / len(samples),
           "rollout/env_failures": float(sum(s.env_error is not None for s in samples))}
    keys = sorted({k for s in samples for k in s.extra_logs})
    for k in keys:
        values = [s.extra_logs[k] for s in samples if k in s.extra_logs]
        out[f"agent/{k}"] = sum(values) / len(values)
    return out


def _summed(parts) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v
    return out
