"""One trainer for every offline objective (sft, rm, dpo, kto, simpo, orpo, prm, kd); the objective is a
registered unit (`trainers/objectives`), the outer loop is `trainers.loop.run_steps`.

The same code runs as one process, N local ranks or N SLURM tasks.  Each optimizer step takes
``train_batch_size`` items (samples, pairs, or labelled rows) in the sampler's global order; rank r takes
every W-th one from r and splits its share into the unit's micro-batches (``micro_train_batch_size`` items,
or SFT's token budget).  A unit's loss is the mean over the items of its micro-batch; the micro-batch
back-propagates ``loss · n_micro · W / train_batch_size``, so after data-parallel averaging the step's
gradient is that of the mean over every item of the step, whatever the rank count and the micro-batch size
(a unit whose loss is a mean over tokens or steps rescales its value: `objectives/per_unit_mean.py`).
"""
from __future__ import annotations

import logging
import math
import time

import torch

from ..checkpoint.rng import seed_everything
from ..checkpoint.store import save_checkpoint
from ..config import SFTConfig, dump_yaml
from ..data.batching import EpochSampler
from ..distributed.collectives import barrier, max_over_ranks
from ..distributed.env import DistEnv
from ..distributed.process_group import device_for
from ..distributed.preemption import StopRequest
from ..engines.deepspeed_strategy import build_engine, optimizer_step
from ..models.loading import load_tokenizer
from ..models.paths import resolve_pretrained
from .lifecycle import resume, run_in_world
from .loop import StepBoundary, run_steps
from .objectives import OFFLINE_OBJECTIVES, Objective
from .objectives.common import Stats, StepView, balanced

log = logging.getLogger("hpc_rlhf.offline")


def train_step(engine, unit: Objective, view: StepView) -> dict[str, float]:
    """One optimizer step over the step's items; metrics are means over every item of every rank."""
    ctx = unit.step_context(engine, view)
    scale = view.world / len(view.items)
    stats = Stats()
    groups = unit.micro_batches(view.mine)  # as many on every rank
    for group in groups:
        out = unit.loss(engine, group, ctx)
        engine.backward(out.loss * (out.count * scale), scale_wrt_gas=False)
        stats.add("loss", float(out.loss.detach()) * out.count, out.count)
        stats.update(out.stats)
    grad_norm = optimizer_step(engine)
    metrics = stats.means()
    metrics.update(unit.step_metrics(ctx), grad_norm=grad_norm, micro_batches=len(groups))
    return metrics


@torch.no_grad()
def evaluate(engine, unit: Objective, items: list, de: DistEnv) -> dict[str, float]:
    """The unit's loss and metrics over ``items`` (sharded over the ranks), prefixed with ``eval_``."""
    engine.eval()
    view = StepView(items, de.rank, de.world_size)
    ctx = unit.step_context(engine, view)
    stats = Stats()
    for group, keep in balanced(unit.micro_batches(view.mine), items[:1]):
        out = unit.loss(engine, group, ctx)
        # a filler run (a rank with fewer eval items) adds its keys with zero weight: every rank then
        # reduces the same metrics, even one that holds no eval item at all
        w = 1.0 if keep else 0.0
        stats.add("loss", w * float(out.loss) * out.count, w * out.count)
        stats.update({k: (w * s, w * n) for k, (s, n) in out.stats.items()})
    engine.train()
    return {f"eval_{k}": v for k, v in stats.means().items()}


def run_offline(cfg, objective: str | None = None) -> dict[str, float]:
    """Train ``objective`` (default: the one ``cfg.objective`` names); returns the last logged metrics (on
    every rank)."""
    name = objective or cfg.objective.unit
    return run_in_world(cfg, lambda cfg, de, stop: _run(cfg, name, de, stop))


def run_sft(cfg: SFTConfig) -> dict[str, float]:
    """`hpc-rlhf train sft`: the sft objective (its config has no objective section)."""
    return run_offline(cfg, "sft")


def _run(cfg, name: str, de: DistEnv, stop: StopRequest) -> dict[str, float]:
    t_start = time.time()
    unit, train_set, eval_set = _set_up(cfg, name, de)
    model = unit.build_model()
    # the global order of every step; rank r takes items r, r + W, ... of it (StepView)
    sampler = EpochSampler(len(train_set), cfg.train.train_batch_size, 1, 0, cfg.train.seed)
    total_steps = sampler.steps_per_epoch * cfg.train.max_epochs
    if cfg.train.max_steps is not None:
        total_steps = min(total_steps, cfg.train.max_steps)
    engine = build_engine(model, cfg.train, cfg.train.learning_rate, cfg.model.param_dtype, total_steps,
                          de.world_size)
    state = resume({"model": engine}, cfg, de.is_main)
    start = state["step"] if state else 0
    if de.is_main and (padded := sampler.padded_steps(start, total_steps)):
        log.info("%d of the steps to run (the last of an epoch) repeat %d samples from the epoch's start to fill "
                 "train_batch_size", padded, sampler.padded_in_last_step)

    def step(i: int) -> dict[str, float]:
        t0 = time.time()
        epoch, in_epoch = divmod(i, sampler.steps_per_epoch)
        view = StepView([train_set[k] for k in sampler.step_indices(epoch, in_epoch)], de.rank, de.world_size)
        view = unit.step_items(engine, view, i)
        lr = engine.get_lr()[0]
        metrics = train_step(engine, unit, view)
        metrics.update(lr=lr, epoch=epoch, step_time_s=time.time() - t0)
        return metrics

    def save(n: int) -> None:
        save_checkpoint({"model": engine}, cfg.ckpt.ckpt_path, n, {"step": n}, cfg.ckpt.max_ckpt_num,
                        run_config=dump_yaml(cfg))

    final_eval: dict[str, float] = {}  # the eval after the last step: the exported model's

    def evaluated(done: int) -> dict[str, float]:
        metrics = evaluate(engine, unit, eval_set, de)
        if done == total_steps:
            final_eval.update(metrics)
        return metrics

    boundary = StepBoundary(stop, cfg.ckpt.save_steps, save, max_over_ranks, barrier, de.is_main)
    metrics = run_steps(cfg, step, start, total_steps, boundary, is_main=de.is_main, desc=name,
                        evaluate=evaluated if eval_set else None,
                        export=lambda: unit.export(engine, cfg.ckpt.save_path, {"hpc_rlhf_config.yaml": dump_yaml(cfg)},
                                                   eval_set or train_set, final_eval))
    metrics["train_time_s"] = time.time() - t_start
    if de.is_main:
        log.info("saved the model to %s (%d steps, %.1f s)", cfg.ckpt.save_path, total_steps,
                 metrics["train_time_s"])
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not math.isnan(v)}


def _set_up(cfg, name: str, de: DistEnv) -> tuple[Objective, list, list]:
    """The objective's unit, its training and eval data, and what it prepares before the model is built."""
    seed_everything(cfg.train.seed)
    if cfg.train.train_batch_size % de.world_size:
        raise ValueError(f"train.train_batch_size={cfg.train.train_batch_size} is not divisible by the "
                         f"{de.world_size} ranks")
    tokenizer = load_tokenizer(resolve_pretrained(cfg.model.pretrain), cfg.data.tokenizer_chat_template)
    unit: Objective = OFFLINE_OBJECTIVES.get(name)(cfg, de, device_for(de), tokenizer)
    train_set, eval_set, bad = unit.load_data()
    if de.is_main:
        log.info("config:\n%s", dump_yaml(cfg))
        log.info("data: %d training samples, %d eval samples", len(train_set), len(eval_set))
        if bad.total:
            log.warning("skipped %d bad rows:\n%s", bad.total, bad.summary())
    unit.prepare([train_set, eval_set])
    return unit, train_set, eval_set
