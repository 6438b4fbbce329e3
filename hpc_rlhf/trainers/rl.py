"""The one RL loop, for every advantage estimator and policy loss, without a controller.

Every rank runs this file.  Each step walks the same phases on every rank, and every phase ends in
one exchange over the control bridge, so the collectives line up without any RPC:

  generate   rollout ranks sample n responses per prompt of their shard   -> exchange samples
  score      reward ranks score their shard (dynamic filtering may loop)  -> exchange rewards
  infer      reference log-probs, critic values, actor old log-probs      -> exchange
  advantages on the actor ranks (global statistics over the actor world)  -> exchange returns
  train      actor and critic, each in its own world, in parallel
             (infer, advantages and train are not the business of rollout-only ranks: their exchanges
             leave them out; with train.async_train those ranks generate the next step's samples
             meanwhile, with the weights of this step, and hand them over at the next generate)
  sync       actor leader broadcasts the new weights to the rollout ranks
  commit     metrics and stop flags agreed; checkpoint of every role at the same step
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time

import torch

from ..algorithms.advantages import make_advantage_estimator
from ..algorithms.kl import compute_kl, kl_penalty_rewards, make_kl_controller
from ..algorithms.registry import ADVANTAGE_ESTIMATORS
from ..checkpoint.hf_export import save_hf
from ..checkpoint.rng import seed_everything
from ..checkpoint.store import save_checkpoint
from ..config import ConfigError, dump_yaml
from ..config.rl import RLConfig
from ..data.batching import EpochSampler
from ..data.prompts import Prompt, load_prompts
from ..distributed.collectives import sum_over_ranks
from ..distributed.env import device_for, read_env
from ..distributed.placement import PlacementPlan, make_plan
from ..distributed.weight_sync import actor_buckets, full_items, lora_items, receive_weights, send_weights, unpack
from ..distributed.worlds import RoleContext, join, leave
from ..engines.deepspeed_strategy import configure_deepspeed_env
from ..engines.rollout import combine_checksums, tensor_part_checksum
from ..distributed.preemption import RunStopped, StopRequest, step_boundary
from ..logging.metrics import MetricsLogger
from ..logging.progress import Progress
from .lifecycle import resume
from ..models.loading import load_tokenizer, resolve_pretrained
from ..rewards.shaping import RunningMoments, normalize_rewards
from ..roles.experience import Experience, padded, shard_groups, unpadded

log = logging.getLogger("hpc_rlhf.rl")


def plan_from_config(cfg: RLConfig) -> PlacementPlan:
    est = ADVANTAGE_ESTIMATORS.get(cfg.algo.advantage_estimator)
    p = cfg.placement
    sizes = {"actor": p.actor_num_ranks, "rollout": p.rollout_num_ranks, "reward": p.reward_num_ranks,
             "critic": p.critic_num_ranks if est.needs_critic else 0,
             "reference": p.ref_num_ranks if cfg.algo.init_kl_coef > 0 else 0}
    plan = make_plan(sizes, p.colocate_actor_ref, p.colocate_critic_reward, p.colocate_all,
                     p.colocate_actor_reward)
    for c in plan.components:
        if cfg.rollout.rollout_batch_size % c.size:
            raise ConfigError(f"rollout_batch_size={cfg.rollout.rollout_batch_size} prompts are dealt to the "
                             f"{c.size} ranks of '{c.name}' by whole groups: make it a multiple of {c.size}")
    actors = plan.ranks_of("actor")
    per_rank = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt // len(actors)
    if cfg.train.train_batch_size % len(actors) or per_rank % (cfg.train.train_batch_size // len(actors)):
        raise ConfigError(f"train_batch_size={cfg.train.train_batch_size} must split evenly over the "
                         f"{len(actors)} actor ranks and divide each rank's {per_rank} samples per step")
    return plan


class RLRun:
    def __init__(self, cfg: RLConfig, ctx: RoleContext, stop: StopRequest):
        self.cfg, self.ctx, self.stop = cfg, ctx, stop
        self.is_main = ctx.global_rank == 0
        self._base_sent = False  # LoRA: the frozen base goes to the rollout engines once
        self.last_sync_numel = 0
        self._sent_parts: dict[str, float] = {}  # checksums of every tensor sent so far (log.check_weight_sync)
        seed_everything(cfg.train.seed)
        self.device = device_for(read_env())
        self.tokenizer = load_tokenizer(resolve_pretrained(cfg.model.pretrain))
        self.prompts, self.eval_prompts, bad = load_prompts(cfg.data, self.tokenizer, cfg.train.seed)
        if self.is_main:
            log.info("%s", ctx.plan.describe())
            log.info("%d prompts (%d eval)", len(self.prompts), len(self.eval_prompts))
            if bad.total:
                log.warning("skipped %d bad prompt rows:\n%s", bad.total, bad.summary())
        r = cfg.rollout
        self.sampler = EpochSampler(len(self.prompts), r.rollout_batch_size, 1, 0, cfg.train.seed)
        self.total_steps = self.sampler.steps_per_epoch * cfg.train.num_episodes
        if cfg.train.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.train.max_steps)
        opt_steps = self.total_steps * cfg.train.max_epochs * (r.rollout_batch_size * r.n_samples_per_prompt
                                                               // cfg.train.train_batch_size)
        self.estimator = make_advantage_estimator(cfg.algo.advantage_estimator)
        self.use_kl_loss = (cfg.algo.use_kl_loss if cfg.algo.use_kl_loss is not None
                            else not self.estimator.kl_in_reward)
        self.agg_mode = cfg.algo.loss_agg_mode or self.estimator.default_loss_agg
        self.kl_ctl = make_kl_controller(cfg.algo.init_kl_coef, cfg.algo.kl_target, cfg.algo.kl_horizon)
        # One optimizer step per RL step on fresh samples: the policy that generated them is the one being
        # trained, so the old log-probs equal the training forward's (detached) and need no extra pass,
        # unless the KL penalty goes into the reward (it needs them before the advantages).
        single_update = (cfg.train.max_epochs == 1
                         and r.rollout_batch_size * r.n_samples_per_prompt == cfg.train.train_batch_size)
        self.need_old_logprobs = not single_update or (cfg.algo.init_kl_coef > 0 and not self.use_kl_loss)
        self.reward_moments = RunningMoments()
        self._build_roles(opt_steps)
        self.policy_step = 0  # RL steps of training behind the weights the rollout engine holds now
        self.last_generate_s = 0.0
        self._ahead: tuple[int, list[Experience]] | None = None  # async_train: (step, this rank's samples)

    def _build_roles(self, opt_steps: int) -> None:
        cfg, ctx, pad = self.cfg, self.ctx, self.tokenizer.pad_token_id
        self.actor = self.critic = self.reference = self.reward = self.rollout = None
        if ctx.has("actor"):
            from ..roles.actor import Actor
            self.actor = Actor(cfg, opt_steps, ctx.world_size, pad, self.device)
        if ctx.has("critic"):
            from ..roles.critic import Critic
            self.critic = Critic(cfg, opt_steps, ctx.world_size, pad, self.device)
        if ctx.has("reference"):
            from ..roles.reference import Reference
            self.reference = Reference(cfg, pad, self.device)
        if ctx.has("reward"):
            from ..roles.reward import RewardRole
            self.reward = RewardRole(cfg, self.device)
        if ctx.has("rollout"):
            from ..roles.rollout import Rollout
            self.rollout = Rollout(cfg, self.tokenizer, self.device)

    def engines(self) -> dict:
        return {name: role.engine for name, role in (("actor", self.actor), ("critic", self.critic)) if role}

    # ---- phases -------------------------------------------------------------------------------
    def _exchange(self, mine):
        return self.ctx.control.all_gather_object(mine)

    def _exchange_trainers(self, mine):
        """Among the ranks with a role besides rollout (rollout-only ranks are elsewhere: [] there)."""
        return self.ctx.trainers.all_gather_object(mine) if self.ctx.trainers is not None else []

    def _role_shard(self, role: str, items: list[Experience]) -> list[Experience]:
        return shard_groups(items, len(self.ctx.plan.ranks_of(role)), self.ctx.role_rank(role))

    def _rollout_shard_id(self) -> list[int]:
        """This rollout rank's index and the rollout rank count: it generates prompts[index::count]."""
        return [self.ctx.role_rank("rollout"), len(self.ctx.plan.ranks_of("rollout"))]

    def _own_samples(self, prompts: list[tuple[int, Prompt]], step: int, salt: int, greedy: bool) -> list[Experience]:
        """On a rollout rank: the samples of its share of ``prompts``, with the weights it holds now."""
        k, n_ranks = self._rollout_shard_id()
        n = 1 if greedy else self.cfg.rollout.n_samples_per_prompt
        params = dataclasses.replace(self.rollout.params, temperature=0.0) if greedy else None
        t0 = time.time()
        out = self.rollout.generate(prompts[k::n_ranks], step, n, params=params, salt=salt)
        self.last_generate_s = time.time() - t0
        for s in out:
            s.policy_step = self.policy_step
        return out

    def _generate(self, prompts: list[tuple[int, Prompt]], step: int, salt: int, greedy: bool = False,
                  ready: list[Experience] | None = None) -> list[Experience]:
        """Every rank: the samples of ``prompts`` from all rollout ranks (``ready``: this rank's, made ahead)."""
        mine = []
        if self.rollout is not None:
            mine = ready if ready is not None else self._own_samples(prompts, step, salt, greedy)
        samples = [s for part in self._exchange(mine) for s in part]
        return sorted(samples, key=lambda s: (s.prompt_index, s.sample_index))

    # ---- async_train: the next step's samples, generated while this step trains ----------------------
    def _generate_ahead(self, step: int) -> None:
        """Rollout-only ranks: step ``step``'s samples (round 0), with the weights held now."""
        if self.cfg.train.async_train and self.ctx.trainers is None and step < self.total_steps:
            self._ahead = (step, self._own_samples(self._step_prompts(step, 0, 0), step, 0, False))

    def _take_ahead(self, step: int) -> list[Experience] | None:
        if self._ahead is None or self._ahead[0] != step:
            return None
        samples, self._ahead = self._ahead[1], None
        return samples

    def _score(self, samples: list[Experience]) -> dict[str, float]:
        """Rewards onto the samples.  Rollout-only ranks take part only under dynamic filtering (they pick
        the replacement prompts); otherwise they get no scores and go on generating."""
        mine, extra = {}, {}
        if self.reward is not None:
            shard = self._role_shard("reward", samples)
            rewards, valid, extra = self.reward.score(shard)
            mine = {(s.prompt_index, s.sample_index): (r, v) for s, r, v in zip(shard, rewards, valid)}
        exchange = self._exchange if self.cfg.rollout.dynamic_filtering else self._exchange_trainers
        gathered = exchange((mine, extra))
        if not gathered:
            return {}
        scores = {k: v for part, _ in gathered for k, v in part.items()}
        for s in samples:
            s.reward, s.reward_valid = scores[(s.prompt_index, s.sample_index)]
        merged: dict[str, float] = {}
        for _, e in gathered:
            for k, v in e.items():
                merged[k] = merged.get(k, 0.0) + v
        return merged

    def evaluate(self, step: int) -> dict[str, float]:
        """Greedy responses to the eval prompts, scored by the reward role: eval/reward_mean."""
        samples = self._generate(list(enumerate(self.eval_prompts)), step, salt=0, greedy=True)
        extra = self._score(samples)
        valid = [s.reward for s in samples if s.reward_valid]
        out = {"eval/reward_mean": sum(valid) / max(len(valid), 1), "eval/prompts": float(len(samples))}
        out.update({f"eval/{k}": v for k, v in extra.items() if not k.endswith(("failures", "batches", "time_s"))})
        return out

    def _step_prompts(self, step: int, round_: int, count: int) -> list[tuple[int, Prompt]]:
        """Round 0: the step's prompts; later rounds (dynamic filtering): replacements, seeded by the step."""
        B = self.cfg.rollout.rollout_batch_size
        if round_ == 0:
            epoch, in_epoch = divmod(step, self.sampler.steps_per_epoch)
            idx = self.sampler.step_indices(epoch, in_epoch)
        else:
            g = torch.Generator().manual_seed(self.cfg.train.seed * 7919 + step * 104729 + round_)
            idx = torch.randperm(len(self.prompts), generator=g)[:count].tolist()
        return [(round_ * B + j, self.prompts[i]) for j, i in enumerate(idx)]

    def _collect(self, step: int) -> tuple[list[Experience], dict[str, float]]:
        """Generate and score; with dynamic filtering, replace groups whose rewards are all equal."""
        r = self.cfg.rollout
        B, n = r.rollout_batch_size, r.n_samples_per_prompt
        kept: list[Experience] = []
        dropped: list[Experience] = []
        metrics: dict[str, float] = {}
        rounds = r.dynamic_filtering_max_rounds if r.dynamic_filtering else 1
        for round_ in range(rounds):
            need = B - len(kept) // n
            samples = self._generate(self._step_prompts(step, round_, need), step, salt=round_,
                                     ready=self._take_ahead(step) if round_ == 0 else None)
            for k, v in self._score(samples).items():
                metrics[k] = metrics.get(k, 0.0) + v
            if not r.dynamic_filtering:
                return samples, metrics
            for g in sorted({s.prompt_index for s in samples}):
                group = [s for s in samples if s.prompt_index == g]
                rewards = [s.reward for s in group]
                (kept if max(rewards) - min(rewards) > 1e-6 else dropped).extend(group)
            if len(kept) // n >= B:
                break
        kept = kept[:B * n]
        filled = B - len(kept) // n
        kept += dropped[:filled * n]
        metrics["rollout/filtered_groups"] = len(dropped) // n
        metrics["rollout/filled_groups"] = filled
        return kept, metrics

    def _infer(self, samples: list[Experience]) -> None:
        mine: dict[str, dict] = {"ref": {}, "values": {}, "old": {}}
        for key, role, fn in (("ref", "reference", self.reference and self.reference.logprobs),
                              ("values", "critic", self.critic and self.critic.values),
                              ("old", "actor", self.need_old_logprobs and self.actor and self.actor.logprobs)):
            if fn:
                shard = self._role_shard(role, samples)
                mine[key] = {(s.prompt_index, s.sample_index): v for s, v in zip(shard, fn(shard))}
        merged: dict[str, dict] = {"ref": {}, "values": {}, "old": {}}
        for part in self._exchange_trainers(mine):
            for key in merged:
                merged[key].update(part[key])
        for s in samples:
            uid = (s.prompt_index, s.sample_index)
            s.ref_logprobs = merged["ref"].get(uid)
            s.values = merged["values"].get(uid)
            s.old_logprobs = merged["old"].get(uid)

    def _advantages(self, samples: list[Experience]) -> dict[str, float]:
        """On the actor ranks, for their shard; returns travel to the critic through one exchange."""
        metrics, mine = {}, {}
        if self.actor is not None:
            shard = self._role_shard("actor", samples)
            R = max(len(s.response_ids) for s in shard)
            mask = padded([[1.0] * len(s.response_ids) for s in shard], R)
            valid = torch.tensor([s.reward_valid for s in shard])
            mask = mask * valid[:, None]
            rewards = torch.tensor([s.reward if s.reward_valid else 0.0 for s in shard])
            token_rewards = torch.zeros_like(mask)
            kl = torch.zeros_like(mask)
            if shard[0].ref_logprobs is not None and shard[0].old_logprobs is not None:
                old = padded([s.old_logprobs for s in shard], R)
                ref = padded([s.ref_logprobs for s in shard], R)
                kl = compute_kl(old, ref, self.cfg.algo.kl_estimator, mask)
                if not self.use_kl_loss:
                    token_rewards = kl_penalty_rewards(kl, self.kl_ctl.value, mask)
            values = padded([s.values for s in shard], R) if shard[0].values is not None else None
            group_ids = torch.tensor([s.prompt_index for s in shard])
            adv, ret = self.estimator.compute(rewards, token_rewards, mask, values=values, group_ids=group_ids,
                                              gamma=self.cfg.algo.gamma, lambd=self.cfg.algo.lambd,
                                              all_reduce=sum_over_ranks)
            for s, a in zip(shard, unpadded(adv, shard)):
                s.advantages = a
            if ret is not None:
                mine = {(s.prompt_index, s.sample_index): v for s, v in zip(shard, unpadded(ret, shard))}
            stats = sum_over_ranks(torch.tensor([float((kl * mask).sum()), float(mask.sum()), float((adv * mask).sum())],
                                           dtype=torch.float64))
            metrics = {"kl": stats[0].item() / max(stats[1].item(), 1), "advantages/mean": stats[2].item() / max(stats[1].item(), 1)}
        returns = {}
        for part in self._exchange_trainers(mine):
            returns.update(part)
        for s in samples:
            s.returns = returns.get((s.prompt_index, s.sample_index))
        return metrics

    def _normalise_rewards(self, samples: list[Experience]) -> None:
        if not self.cfg.reward.normalize_reward:
            return
        r = torch.tensor([s.reward for s in samples])
        valid = torch.tensor([s.reward_valid for s in samples])
        r = normalize_rewards(r, self.reward_moments, valid)  # updates the running moments first
        for s, v in zip(samples, r.tolist()):
            s.reward = v

    def sync_weights(self) -> float:
        """Actor -> rollout.  Returns the checksum of what was sent (actor leader) or loaded (rollout)."""
        t0 = time.time()
        ctx = self.ctx
        dtype = torch.bfloat16 if self.cfg.model.param_dtype == "bf16" else torch.float32
        bucket_bytes = 64 << 20
        checksum = float("nan")
        if self.actor is not None:
            zero3 = self.actor.engine.zero_optimization_stage() == 3
            # LoRA: the merged LoRA layers every time, the frozen rest of the base only the first time
            items = (lora_items(self.actor.module, include_frozen=not self._base_sent)
                     if self.cfg.model.lora_rank > 0 else full_items(self.actor.module))
            track = ctx.role_rank("actor") == 0 and self.cfg.log.check_weight_sync

            self.last_sync_numel = sum(it.spec.numel for it in items)

            def tracked(buckets):
                for specs, flat in buckets:
                    if track:
                        self._sent_parts.update((n, tensor_part_checksum(t)) for n, t in unpack(specs, flat))
                    yield specs, flat
            send_weights(ctx.weights, tracked(actor_buckets(items, zero3, dtype, bucket_bytes)),
                         is_leader=ctx.role_rank("actor") == 0,
                         local_engine=self.rollout.engine if self.rollout is not None else None)
            self._base_sent = True
            if track:  # over every tensor the engines hold: the ones sent now and the frozen ones sent before
                checksum = combine_checksums(self._sent_parts)
        elif self.rollout is not None:
            receive_weights(ctx.weights, self.rollout.engine, dtype)
        if self.rollout is not None and self.cfg.log.check_weight_sync:
            checksum = self.rollout.engine.state_checksum()
        self.last_sync_s = time.time() - t0
        return checksum

    # ---- the loop -------------------------------------------------------------------------------
    def run(self) -> dict[str, float]:
        cfg = self.cfg
        start = self._maybe_resume()
        self.sync_weights()
        self.policy_step = start
        metrics_log = MetricsLogger(cfg.ckpt.save_path, self.is_main, cfg.log.use_tensorboard, start)
        progress = Progress(self.total_steps, start, self.is_main, cfg.log.progress_bar, desc="rl")
        last: dict[str, float] = {}
        for step in range(start, self.total_steps):
            last = self.train_step(step)
            done = step + 1
            if self.eval_prompts and (done == self.total_steps or
                                      (cfg.log.eval_steps > 0 and done % cfg.log.eval_steps == 0)):
                last.update(self.evaluate(step))
            if done % cfg.log.logging_steps == 0 or done == self.total_steps:
                metrics_log.log(done, last)
            progress.update(done, {"loss": last.get("actor/loss", float("nan")), "lr": last.get("actor/lr", 0.0)},
                            done % cfg.log.logging_steps == 0)
            step_boundary(self.stop, done, self.total_steps, cfg.ckpt.save_steps, self.save, self.ctx.control.max,
                          self.ctx.global_rank == 0, self.ctx.control.barrier,
                          lambda: (progress.close(), metrics_log.close()))
        progress.close()
        metrics_log.close()
        if self.actor is not None:
            save_hf(self.actor.engine, self.tokenizer, cfg.ckpt.save_path,
                    {"hpc_rlhf_config.yaml": dump_yaml(cfg)})
        return last

    def _learn(self, samples: list[Experience], step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Ranks with a role besides rollout: infer, advantages, train.  Returns the roles' metrics."""
        if self.rollout is not None and self.actor is not None:
            self.rollout.engine.sleep()  # colocated: the actor trains while the engine sleeps; the sync wakes it
        self._normalise_rewards(samples)
        t1 = time.time()
        self._infer(samples)
        metrics.update(self._advantages(samples))
        t2 = time.time()
        role_metrics: dict[str, float] = {}
        if self.actor is not None and step >= self.cfg.train.freezing_actor_steps:
            role_metrics.update(self.actor.train(self._role_shard("actor", samples), step, self.kl_ctl.value,
                                                 self.use_kl_loss, self.agg_mode))
        if self.critic is not None:
            role_metrics.update(self.critic.train(self._role_shard("critic", samples), step))
        metrics.update({"time/infer_advantages_s": t2 - t1, "time/train_s": time.time() - t2})
        return role_metrics

    def train_step(self, step: int) -> dict[str, float]:
        t0 = time.time()
        samples, metrics = self._collect(step)
        self._generate_ahead(step + 1)
        metrics["time/generate_score_s"] = time.time() - t0
        raw = [s.reward for s in samples if s.reward_valid]
        role_metrics = self._learn(samples, step, metrics) if self.ctx.trainers is not None else {}
        checksum = self.sync_weights()
        self.policy_step = step + 1
        if self.rollout is not None and self.ctx.role_rank("rollout") == 0:
            role_metrics["time/rollout_generate_s"] = self.last_generate_s
        if self.cfg.log.check_weight_sync:
            if self.actor is not None and self.ctx.role_rank("actor") == 0:
                role_metrics["sync/checksum_sent"] = checksum
                role_metrics["sync/numel_sent"] = float(self.last_sync_numel)
            if self.rollout is not None:
                role_metrics[f"sync/checksum_loaded/{self.ctx.role_rank('rollout')}"] = checksum
        # commit: every rank's metrics reach every rank (the same values everywhere), then the KL controller
        for part in self._exchange(role_metrics if self.ctx.rank_in_world == 0 or self.cfg.log.check_weight_sync
                                   else {}):
            metrics.update(part)
        # the KL of the samples: measured in the loss when it is there, else before the advantages
        self.kl_ctl.update(metrics.get("actor/kl_loss", metrics.get("kl", 0.0)), len(samples))
        lengths = [len(s.response_ids) for s in samples]
        metrics.update({
            "reward/mean": sum(raw) / max(len(raw), 1),
            "reward/invalid": float(sum(not s.reward_valid for s in samples)),
            "response_length/mean": sum(lengths) / len(lengths),
            "response_length/truncated": sum(s.finish_reason == "length" for s in samples) / len(samples),
            "rollout/policy_lag": sum(step - s.policy_step for s in samples) / len(samples),
            "kl_coef": self.kl_ctl.value, "time/weight_sync_s": self.last_sync_s, "time/step_s": time.time() - t0,
        })
        return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}

    def _trainer_state(self, step: int) -> dict:
        return {"step": step, "kl_ctl": self.kl_ctl.state_dict(), "reward_moments": self.reward_moments.state_dict()}

    def save(self, step: int) -> None:
        ahead = None
        if self._ahead is not None:  # async_train: samples made for a later step belong to the checkpoint
            ahead = {"ahead_step": self._ahead[0], "ahead_samples": self._ahead[1],
                     "ahead_shard": self._rollout_shard_id()}
        save_checkpoint(self.engines(), self.cfg.ckpt.ckpt_path, step, self._trainer_state(step),
                        self.cfg.ckpt.max_ckpt_num, rank=self.ctx.global_rank, barrier=self.ctx.control.barrier,
                        rank_state=ahead)

    def _maybe_resume(self) -> int:
        state = resume(self.engines(), self.cfg.ckpt, self.is_main, rank=self.ctx.global_rank)
        if state is None:
            return 0
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.reward_moments.load_state_dict(state["reward_moments"])
        ahead = state.get("rank_state")
        # samples made ahead are this rank's share of the prompts: with another rollout layout, generate afresh
        if ahead is not None and self.cfg.train.async_train and ahead["ahead_shard"] == self._rollout_shard_id():
            self._ahead = (ahead["ahead_step"], ahead["ahead_samples"])
        return state["step"]


def run_rl(cfg: RLConfig) -> dict[str, float]:
    configure_deepspeed_env()
    plan = plan_from_config(cfg)
    stop = StopRequest.from_config(cfg.slurm)
    try:
        ctx = join(plan, cfg.launch.backend, cfg.placement.collective_timeout_s, cfg.placement.dead_rank_timeout_s,
                   urgent=lambda: stop.received is not None)
        try:
            result = RLRun(cfg, ctx, stop).run()
        except RunStopped:
            leave(ctx)
            raise
        except Exception:
            ctx.watchdog.explain_failure()  # a dead peer is the usual cause: name it rather than gloo's error
            raise
        leave(ctx)
        return result
    finally:
        stop.restore()
