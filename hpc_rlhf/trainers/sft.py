"""Supervised fine-tuning: the same code runs as one process, N local ranks, or N SLURM tasks."""
from __future__ import annotations

import logging
import math
import time

import torch

from ..algorithms.sft_loss import step_token_mean, token_nll_sum
from ..checkpoint.hf_export import save_hf
from ..checkpoint.rng import seed_everything
from ..checkpoint.store import save_checkpoint
from ..config import SFTConfig, dump_yaml
from ..data.batching import EpochSampler, split_micro_batches
from ..data.packing import Batch, collate_packed, collate_padded, packed_attention_mask
from ..data.sft import Sample, load_sft_data
from ..distributed.collectives import MAX, barrier, sum_values
from ..distributed.env import DistEnv, device_for
from ..engines.deepspeed_strategy import build_engine
from ..distributed.preemption import StopRequest, step_boundary
from ..logging.metrics import MetricsLogger
from ..logging.progress import Progress
from ..models.loading import check_packing, load_causal_lm, load_tokenizer, resolve_pretrained
from .lifecycle import resume, run_in_world

log = logging.getLogger("hpc_rlhf.sft")


class BatchMaker:
    """Turns one rank's samples of a step into model-ready micro-batches."""

    def __init__(self, cfg: SFTConfig, pad_id: int, dtype: torch.dtype, device: torch.device):
        self.packing = cfg.data.packing_samples
        self.micro_bs = None if cfg.data.micro_batch_tokens else cfg.train.micro_train_batch_size
        self.budget = cfg.data.micro_batch_tokens
        self.flash = cfg.model.attn_implementation == "flash_attention_2"
        self.pad_id, self.dtype, self.device = pad_id, dtype, device

    def groups(self, samples: list[Sample]) -> list[list[Sample]]:
        """Micro-batch groups; every rank ends up with the same count (collectives run per backward)."""
        groups = split_micro_batches(samples, self.micro_bs, self.budget)
        (most,) = sum_values([len(groups)], MAX)
        if len(groups) < most:
            groups = split_micro_batches(samples, self.micro_bs, self.budget, min_count=int(most))
        return groups

    def collate(self, group: list[Sample]) -> Batch:
        if not self.packing:
            return collate_padded(group, self.pad_id).to(self.device)
        batch = collate_packed(group).to(self.device)
        if not self.flash:  # flash-attention reads sample boundaries from the restarted position_ids
            batch.attention_mask = packed_attention_mask(batch.seq_lens, self.dtype).to(self.device)
        return batch


def forward_nll(engine, batch: Batch) -> tuple[torch.Tensor, int]:
    out = engine(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                 position_ids=batch.position_ids, use_cache=False)
    return token_nll_sum(out.logits, batch.labels)


def train_step(engine, maker: BatchMaker, samples: list[Sample], world_size: int) -> dict[str, float]:
    """One optimizer step over this rank's samples; the loss is the token mean over all ranks."""
    groups = maker.groups(samples)
    batches = [maker.collate(g) for g in groups]
    local_tokens = sum(b.num_loss_tokens for b in batches)
    (step_tokens,) = sum_values([local_tokens])
    nll_total = 0.0
    for batch in batches:
        nll_sum, _ = forward_nll(engine, batch)
        engine.backward(step_token_mean(nll_sum, int(step_tokens), world_size), scale_wrt_gas=False)
        nll_total += float(nll_sum.detach())
    engine.step()
    (nll_all,) = sum_values([nll_total])
    grad_norm = engine.get_global_grad_norm()
    return {"loss": nll_all / max(step_tokens, 1), "tokens": step_tokens, "micro_batches": len(batches),
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan")}


@torch.no_grad()
def evaluate(engine, maker: BatchMaker, samples: list[Sample], de: DistEnv) -> float:
    """Token-mean NLL over the eval set, sharded over ranks."""
    engine.eval()
    mine = samples[de.rank::de.world_size]
    groups = split_micro_batches(mine, maker.micro_bs, maker.budget) if mine else []
    # ZeRO-3 gathers parameters inside forward, so every rank runs the same number of forwards;
    # a rank with fewer groups repeats one whose result it discards.
    (most,) = sum_values([len(groups)], MAX)
    filler = groups[-1] if groups else samples[:1]
    nll, count = 0.0, 0
    for i in range(int(most)):
        s, n = forward_nll(engine, maker.collate(groups[i] if i < len(groups) else filler))
        if i < len(groups):
            nll, count = nll + float(s), count + n
    engine.train()
    nll, count = sum_values([nll, count])
    return nll / count if count else float("nan")


def run_sft(cfg: SFTConfig) -> dict[str, float]:
    """Train, log, checkpoint and export; returns the last logged metrics (on every rank)."""
    return run_in_world(cfg, _run)


def _run(cfg: SFTConfig, de: DistEnv, stop: StopRequest) -> dict[str, float]:
    t_start = time.time()
    seed_everything(cfg.train.seed)
    if cfg.train.train_batch_size % de.world_size:
        raise ValueError(f"train.train_batch_size={cfg.train.train_batch_size} is not divisible by the "
                         f"{de.world_size} ranks")
    pretrain = resolve_pretrained(cfg.model.pretrain)
    tokenizer = load_tokenizer(pretrain, cfg.data.tokenizer_chat_template)
    train_set, eval_set, bad = load_sft_data(cfg.data, tokenizer, cfg.train.seed)
    if de.is_main:
        log.info("config:\n%s", dump_yaml(cfg))
        log.info("data: %d training samples, %d eval samples", len(train_set), len(eval_set))
        if bad.total:
            log.warning("skipped %d bad rows:\n%s", bad.total, bad.summary())

    model = load_causal_lm(cfg.model)
    if cfg.data.packing_samples:
        check_packing(model)
    dtype = torch.bfloat16 if cfg.model.param_dtype == "bf16" else torch.float32
    sampler = EpochSampler(len(train_set), cfg.train.train_batch_size, de.world_size, de.rank, cfg.train.seed)
    total_steps = sampler.steps_per_epoch * cfg.train.max_epochs
    if cfg.train.max_steps is not None:
        total_steps = min(total_steps, cfg.train.max_steps)
    engine = build_engine(model, cfg.train, cfg.train.learning_rate, cfg.model.param_dtype, total_steps,
                          de.world_size)
    maker = BatchMaker(cfg, tokenizer.pad_token_id, dtype, device_for(de))

    state = resume({"model": engine}, cfg.ckpt, de.is_main)
    start = state["step"] if state else 0
    if de.is_main and sampler.padded_in_last_step:
        log.info("the last step of each epoch repeats %d samples to fill train_batch_size",
                 sampler.padded_in_last_step)

    metrics_log = MetricsLogger(cfg.ckpt.save_path, de.is_main, cfg.log.use_tensorboard, start)
    progress = Progress(total_steps, start, de.is_main, cfg.log.progress_bar, desc="sft")
    metrics: dict[str, float] = {}
    t_last = time.time()
    for step in range(start, total_steps):
        epoch, in_epoch = divmod(step, sampler.steps_per_epoch)
        samples = [train_set[i] for i in sampler.step_indices(epoch, in_epoch)]
        lr = engine.get_lr()[0]
        metrics = train_step(engine, maker, samples, de.world_size)
        done = step + 1
        now = time.time()
        metrics.update(lr=lr, epoch=epoch, step_time_s=now - t_last)
        t_last = now
        if eval_set and cfg.log.eval_steps > 0 and done % cfg.log.eval_steps == 0:
            metrics["eval_loss"] = evaluate(engine, maker, eval_set, de)
        if done % cfg.log.logging_steps == 0 or done == total_steps:
            metrics_log.log(done, metrics)
        progress.update(done, metrics, done % cfg.log.logging_steps == 0)
        step_boundary(stop, done, total_steps, cfg.ckpt.save_steps,
                      lambda n: save_checkpoint({"model": engine}, cfg.ckpt.ckpt_path, n, {"step": n},
                                                cfg.ckpt.max_ckpt_num),
                      lambda code: sum_values([code], MAX)[0], de.is_main, barrier,
                      lambda: (progress.close(), metrics_log.close()))
    progress.close()
    if eval_set and "eval_loss" not in metrics:
        metrics["eval_loss"] = evaluate(engine, maker, eval_set, de)
        metrics_log.log(total_steps, {"eval_loss": metrics["eval_loss"]})
    metrics_log.close()
    save_hf(engine, tokenizer, cfg.ckpt.save_path, {"hpc_rlhf_config.yaml": dump_yaml(cfg)})
    metrics["train_time_s"] = time.time() - t_start
    if de.is_main:
        log.info("saved the model to %s (%d steps, %.1f s)", cfg.ckpt.save_path, total_steps,
                 metrics["train_time_s"])
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not math.isnan(v)}
