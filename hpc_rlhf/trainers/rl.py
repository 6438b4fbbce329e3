"""The one RL loop, for every advantage estimator and policy loss, without a controller.

Every rank runs this file.  Each step walks the same phases on every rank (``RLRun.train_step`` is the
list), and every phase ends in one exchange, so the collectives line up without any RPC:

  collect    rollout ranks sample n responses per prompt of their shard, reward ranks score them
             (dynamic filtering may loop)                                  -> exchange samples, rewards
  infer      reference log-probs, critic values, actor old log-probs      -> exchange
  advantages on the actor ranks (global statistics over the actor world)  -> exchange returns
  train      actor and critic, each in its own world, in parallel
             (infer, advantages and train are not the business of rollout-only ranks: their exchanges
             leave them out; with train.async_train those ranks generate the next step's samples
             meanwhile, with the weights of this step, and hand them over at the next collect)
  sync       actor leader broadcasts the new weights to the rollout ranks
  commit     metrics agreed; then the step boundary: stop flags, checkpoint of every role at the same step

The algorithm's decisions live in ``RLAlgorithm`` (algorithms/rl_algorithm.py); this loop reads none of
the ``algo.*`` options.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from pathlib import Path

import torch

from ..algorithms.rl_algorithm import RLAlgorithm
from ..checkpoint.hf_export import save_hf
from ..checkpoint.rng import seed_everything
from ..checkpoint.store import save_checkpoint
from ..config import ConfigError, dump_yaml
from ..config.evaluation import EvalRunConfig
from ..config.rl import RLConfig
from ..data.prompts import load_prompts
from ..distributed.collectives import sum_over_ranks
from ..distributed.env import read_env
from ..distributed.process_group import device_for
from ..distributed.worlds import RoleContext
from ..distributed.preemption import StopRequest
from ..generation.factory import engine_choice
from ..models.loading import load_tokenizer
from ..models.paths import resolve_pretrained
from ..rewards.shaping import RunningMoments, normalize_rewards
from ..roles import build_roles
from ..roles.reward import environment_weight
from ..roles.experience import Experience, padded, reward_component_table, shard_groups, unpadded
from ..roles.sync import WeightSync
from .lifecycle import resume, run_in_roles
from .placement import eval_plan, plan_from_config
from .loop import StepBoundary, run_steps
from .rl_collect import Collector, PromptSchedule, agent_metrics

log = logging.getLogger("hpc_rlhf.rl")


def algorithm_for(cfg: RLConfig) -> RLAlgorithm:
    r = cfg.rollout
    single_update = (cfg.train.max_epochs == 1
                     and r.rollout_batch_size * r.n_samples_per_prompt == cfg.train.train_batch_size)
    return RLAlgorithm(cfg.algo, single_update)


@contextlib.contextmanager
def timed(metrics: dict, key: str):
    t0 = time.time()
    yield
    metrics[key] = time.time() - t0


class RLRun:
    def __init__(self, cfg: RLConfig, ctx: RoleContext, stop: StopRequest):
        self.cfg, self.ctx, self.stop = cfg, ctx, stop
        self.is_main = ctx.global_rank == 0
        seed_everything(cfg.train.seed)
        self.tokenizer = load_tokenizer(resolve_pretrained(cfg.model.pretrain))
        prompts, eval_prompts, bad = load_prompts(cfg.data, self.tokenizer, cfg.train.seed)
        if self.is_main:
            spec, why = engine_choice(cfg.rollout, cfg.model.pretrain, device_for(read_env()))
            log.info("rollout engine: %s (%s)", spec.name, why)
            log.info("%s", ctx.plan.describe())
            log.info("%d prompts (%d eval)", len(prompts), len(eval_prompts))
            if bad.total:
                log.warning("skipped %d bad prompt rows:\n%s", bad.total, bad.summary())
        r, t = cfg.rollout, cfg.train
        self.schedule = PromptSchedule(prompts, r.rollout_batch_size, t.seed, t.num_episodes, t.max_steps,
                                       cfg.data.shuffle_prompts)
        self.algo = algorithm_for(cfg)
        self.reward_moments = RunningMoments()
        opt_steps = (self.schedule.total_steps * t.max_epochs
                     * (r.rollout_batch_size * r.n_samples_per_prompt // t.train_batch_size))
        self.roles = build_roles(cfg, ctx, self.algo, opt_steps, self.tokenizer, device_for(read_env()))
        self.collector = Collector(cfg, ctx, self.roles.rollout, self.roles.reward, self.schedule, eval_prompts)
        self.sync = WeightSync(cfg.model, cfg.log, ctx, self.roles.actor, self.roles.rollout, len(self.tokenizer))
        self.best: dict | None = None  # {"metric", "value", "step"} of the model in save_path/best

    def _shard(self, role: str, samples: list[Experience]) -> list[Experience]:
        return shard_groups(samples, len(self.ctx.plan.ranks_of(role)), self.ctx.role_rank(role))

    def _on_roles(self, jobs: dict, samples: list[Experience]) -> dict[str, dict]:
        """``jobs``: {key: (role, fn or None)}.  The ranks of each role compute ``fn(their shard)`` (one value
        per sample); one exchange among the trainer ranks merges them: {key: {sample uid: value}}."""
        mine: dict[str, dict] = {key: {} for key in jobs}
        for key, (role, fn) in jobs.items():
            if fn:
                shard = self._shard(role, samples)
                mine[key] = dict(zip((s.uid for s in shard), fn(shard)))
        merged: dict[str, dict] = {key: {} for key in jobs}
        for part in self.collector.exchange_trainers(mine):
            for key in merged:
                merged[key].update(part[key])
        return merged

    # ---- the phases -----------------------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, float]:
        t0 = time.time()
        samples, m = self.collector.collect(step)  # generate + score (+ dynamic filtering; async: step+1's too)
        if self.ctx.trainers is not None:  # ranks with a role besides rollout
            with timed(m, "time/infer_advantages_s"):
                self.infer(samples)  # reference log-probs, values, old log-probs: one exchange
                m |= self.advantages(samples)  # actor ranks; the returns reach the critic: one exchange
            m |= self.train(samples, step)  # actor and critic, each in its own world
        m |= self.sync.run()  # actor leader -> rollout ranks
        return self.commit(step, samples, m, t0)  # metrics to every rank, KL controller update

    def infer(self, samples: list[Experience]) -> None:
        roles = self.roles
        if roles.rollout is not None and roles.actor is not None:
            roles.rollout.engine.sleep()  # colocated: the actor works while the engine sleeps; the sync wakes it
        old = self.algo.needs_old_logprobs and roles.actor and roles.actor.logprobs
        got = self._on_roles({"ref": ("reference", roles.reference and roles.reference.logprobs),
                              "values": ("critic", roles.critic and roles.critic.values),
                              "old": ("actor", old)}, samples)
        for s in samples:
            s.ref_logprobs, s.values, s.old_logprobs = (got[k].get(s.uid) for k in ("ref", "values", "old"))

    def advantages(self, samples: list[Experience]) -> dict[str, float]:
        """On the actor ranks, for their shard (rewards normalised over the step first, when asked)."""
        metrics: dict[str, float] = {}
        rewards = torch.tensor([s.reward if s.reward_valid else 0.0 for s in samples])
        if self.cfg.reward.normalize_reward and self.roles.actor is not None:
            valid = torch.tensor([s.reward_valid for s in samples])  # invalid samples: nan, then reward 0
            rewards = normalize_rewards(rewards, self.reward_moments, valid).nan_to_num(0.0)  # moments updated
        reward_of = {s.uid: float(r) for s, r in zip(samples, rewards)}
        # multi-turn: each turn's environment reward on its last action token (the scalar keeps the rest of the
        # total); with normalize_reward the normalised total stays whole on the last token
        turn_weight = 0.0 if self.cfg.reward.normalize_reward else environment_weight(self.cfg.reward, self.cfg.agent)

        def compute(shard: list[Experience]) -> list:
            R = max(len(s.response_ids) for s in shard)
            mask = padded([s.loss_mask for s in shard], R)
            valid = torch.tensor([s.reward_valid for s in shard])
            mask = mask * valid[:, None]
            turn_rewards = padded([[turn_weight * r for r in s.intermediate_rewards()] for s in shard], R) * mask
            scalar = torch.tensor([reward_of[s.uid] for s in shard]) - turn_rewards.sum(1)
            rows = {k: [getattr(s, k) for s in shard]
                    for k in ("old_logprobs", "ref_logprobs", "values", "engine_logprobs")}
            old, ref, values, engine = (padded(v, R) if v[0] is not None else None for v in rows.values())
            table = reward_component_table(shard)
            components = None if table is None else table[1]
            adv, ret, kl = self.algo.advantages(scalar, mask, torch.tensor([s.prompt_index for s in shard]), old,
                                                ref, values, all_reduce=sum_over_ranks, valid=valid,
                                                turn_rewards=turn_rewards, engine=engine, components=components)
            metrics.update(self.algo.token_mask_metrics)
            for s, a in zip(shard, unpadded(adv, shard)):
                s.advantages = a
            stats = sum_over_ranks(torch.tensor([float((kl * mask).sum()), float(mask.sum()),
                                                 float((adv * mask).sum())], dtype=torch.float64)).tolist()
            metrics.update({"kl": stats[0] / max(stats[1], 1), "advantages/mean": stats[2] / max(stats[1], 1)})
            return unpadded(ret, shard) if ret is not None else [None] * len(shard)
        returns = self._on_roles({"returns": ("actor", self.roles.actor and compute)}, samples)["returns"]
        for s in samples:
            s.returns = returns.get(s.uid)
        return metrics

    def train(self, samples: list[Experience], step: int) -> dict[str, float]:
        t0, out, roles = time.time(), {}, self.roles
        if roles.actor is not None and step >= self.cfg.train.freezing_actor_steps:
            out |= roles.actor.train(self._shard("actor", samples), step)
        if roles.critic is not None:
            out |= roles.critic.train(self._shard("critic", samples), step)
        return out | {"time/train_s": time.time() - t0}

    def commit(self, step: int, samples: list[Experience], m: dict, t0: float) -> dict[str, float]:
        """The metrics of every role reach every rank (a rank's own values win), then the KL controller steps."""
        self.collector.policy_step = step + 1
        share = self.ctx.rank_in_world == 0 or self.cfg.log.check_weight_sync
        merged: dict[str, float] = {}
        for part in self.ctx.control.all_gather_object(m if share else {}):
            merged.update(part)
        merged.update(m)
        self.algo.update_kl(merged, len(samples))
        raw = [s.reward for s in samples if s.reward_valid]
        lengths = [s.action_length for s in samples]
        table = reward_component_table(samples)
        if table is not None:  # each component's mean over the valid samples
            means = table[1].sum(0) / max(len(raw), 1)
            merged.update({f"reward/{name}": float(m) for name, m in zip(table[0], means)})
        merged.update({
            "reward/mean": sum(raw) / max(len(raw), 1),
            "reward/invalid": float(sum(not s.reward_valid for s in samples)),
            **invalid_group_counts(samples, self.algo.estimator.uses_groups),
            "response_length/mean": sum(lengths) / len(lengths),
            "response_length/truncated": sum(s.finish_reason == "length" for s in samples) / len(samples),
            **agent_metrics(samples),
            "rollout/policy_lag": sum(step - s.policy_step for s in samples) / len(samples),
            "kl_coef": self.algo.kl_ctl.value, "time/step_s": time.time() - t0,
        })
        return {k: v for k, v in merged.items() if isinstance(v, (int, float)) and math.isfinite(v)}

    # ---- the loop, checkpoints ------------------------------------------------------------------------------
    def run(self) -> dict[str, float]:
        cfg, ctx, e = self.cfg, self.ctx, self.cfg.eval
        start = self._maybe_resume()
        self.sync.run()
        self.collector.policy_step = start
        boundary = StepBoundary(self.stop, cfg.ckpt.save_steps, self.save, ctx.control.max, ctx.control.barrier,
                                self.is_main)
        out = run_steps(cfg, self.train_step, start, self.schedule.total_steps, boundary, is_main=self.is_main,
                        desc="rl", evaluate=self.collector.evaluate if self.collector.eval_prompts else None,
                        export=self.export, shown=lambda m: {k: m.get(f"actor/{k}", 0.0) for k in ("loss", "lr")},
                        eval_at_start=e.eval_at_start, eval_only=e.eval_only,
                        on_eval=self.on_eval if e.best_metric and not e.eval_only else None)
        if e.eval_only and self.is_main:
            path = Path(cfg.ckpt.save_path) / "eval_metrics.json"
            path.write_text(json.dumps({"step": start, "metrics": out}, indent=1) + "\n")
            log.info("eval metrics written to %s", path)
        return out

    def on_eval(self, done: int, metrics: dict[str, float]) -> bool:
        """After an eval (every rank has the same metrics): keep the model in save_path/best when
        eval.best_metric improved; True (stop the run) when it reached eval.early_stop_threshold."""
        e = self.cfg.eval
        if e.best_metric not in metrics:
            raise ConfigError(f"eval.best_metric={e.best_metric!r} is not among the eval metrics: "
                           f"{', '.join(sorted(k for k in metrics if not k.startswith('time/')))}")
        value, sign = metrics[e.best_metric], 1.0 if e.best_mode == "max" else -1.0
        if self.best is None or sign * value > sign * self.best["value"]:
            self.best = {"metric": e.best_metric, "value": value, "mode": e.best_mode, "step": done}
            if self.roles.actor is not None:
                save_hf(self.roles.actor.engine, self.tokenizer, Path(self.cfg.ckpt.save_path) / "best",
                        {"hpc_rlhf_config.yaml": dump_yaml(self.cfg), "best.json": json.dumps(self.best) + "\n"})
            if self.is_main:
                log.info("best %s = %.4g at step %d: model in %s/best", e.best_metric, value, done,
                         self.cfg.ckpt.save_path)
        return e.early_stop_threshold is not None and sign * value >= sign * e.early_stop_threshold

    def export(self) -> dict[str, float]:
        if self.roles.actor is not None:
            save_hf(self.roles.actor.engine, self.tokenizer, self.cfg.ckpt.save_path,
                    {"hpc_rlhf_config.yaml": dump_yaml(self.cfg)})
        return {}

    def save(self, step: int) -> None:
        state = {"step": step, **self.algo.state_dict(), "reward_moments": self.reward_moments.state_dict(),
                 "best": self.best}
        save_checkpoint(self.roles.engines(), self.cfg.ckpt.ckpt_path, step, state, self.cfg.ckpt.max_ckpt_num,
                        run_config=dump_yaml(self.cfg), rank=self.ctx.global_rank, barrier=self.ctx.control.barrier,
                        rank_state=self.collector.ahead.state())

    def _maybe_resume(self) -> int:
        state = resume(self.roles.engines(), self.cfg, self.is_main, rank=self.ctx.global_rank,
                       agree=self.ctx.control.max)
        if state is None:
            return 0
        self.algo.load_state_dict(state)
        self.reward_moments.load_state_dict(state["reward_moments"])
        self.best = state.get("best")
        if self.cfg.train.async_train:
            self.collector.ahead.load(state.get("rank_state"))
        return state["step"]


def invalid_group_counts(samples: list[Experience], uses_groups: bool) -> dict[str, float]:
    """Per-group counts of failed rewards: ``reward/invalid_groups``, the groups (prompts) with an invalid
    sample; for group estimators also ``reward/groups_few_valid``, those with fewer than two valid samples,
    whose advantages are all 0."""
    valid_of: dict[int, list[bool]] = {}
    for s in samples:
        valid_of.setdefault(s.prompt_index, []).append(s.reward_valid)
    out = {"reward/invalid_groups": float(sum(not all(v) for v in valid_of.values()))}
    if uses_groups:
        out["reward/groups_few_valid"] = float(sum(sum(v) < 2 for v in valid_of.values()))
    return out


def run_rl(cfg: RLConfig) -> dict[str, float]:
    return run_in_roles(cfg, plan_from_config(cfg), lambda ctx, stop: RLRun(cfg, ctx, stop).run())


def run_eval(cfg: EvalRunConfig) -> dict[str, float]:
    """`hpc-rlhf eval`: the RL run's eval (eval_only) on a plan of rollout and reward ranks: the metrics."""
    rl = cfg.as_rl_config()
    return run_in_roles(rl, eval_plan(cfg), lambda ctx, stop: RLRun(rl, ctx, stop).run())
