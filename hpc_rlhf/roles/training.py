"""What the trainable roles (actor, critic) share: an engine config, mini-batches, one optimizer step."""
from __future__ import annotations

import random
import time
from typing import Callable

import torch

from ..algorithms.aggregation import StepNorm
from ..data.batching import chunks, cut_longest_first
from ..distributed.collectives import max_over_ranks, sum_over_ranks
from ..engines.deepspeed_strategy import optimizer_step
from .experience import Experience, RLBatch, collate, unpadded


def padded_length(s: Experience, responses_only: bool = False) -> int:
    """The positions a sample takes in a padded batch: prompt and response, or the response alone where the
    prompts run apart (``SharedPrompts``)."""
    return len(s.response_ids) if responses_only else s.length


def by_length(samples: list[Experience], responses_only: bool = False) -> list[Experience]:
    """The samples longest first (``padded_length``), so that each micro-batch cut from them pads little."""
    return sorted(samples, key=lambda s: -padded_length(s, responses_only))


@torch.no_grad()
def per_sample(module: torch.nn.Module, samples: list[Experience], micro: int, pad_id: int, device,
               fn: Callable[[list[Experience], RLBatch], torch.Tensor],
               responses_only: bool = False, lockstep: bool = False) -> list[list[float]]:
    """``fn(part, batch)`` -> [B, R] over micro-batches of similar lengths (``by_length``) in eval mode,
    returned per sample (in the order given) without padding.  ``lockstep`` (a ZeRO-3 module, whose forwards
    gather its parameters over the world): every rank of the world runs as many forwards as the one with the most
    micro-batches, the extra ones on a one-token sample whose outputs are dropped."""
    was_training = module.training
    module.eval()
    out: list[list[float]] = [[] for _ in samples]
    order = sorted(range(len(samples)), key=lambda i: -padded_length(samples[i], responses_only))
    parts = chunks(order, micro)
    extra = max_over_ranks(len(parts)) - len(parts) if lockstep else 0  # agreed before any forward
    for idx in parts:
        part = [samples[i] for i in idx]
        for i, row in zip(idx, unpadded(fn(part, collate(part, pad_id, device)), part)):
            out[i] = row
    blank = [Experience(0, 0, [pad_id], [pad_id], [], "length", "", "", None)]
    for _ in range(extra):
        fn(blank, collate(blank, pad_id, device))
    module.train(was_training)
    return out


def positions_trained(samples: list[Experience], shared_prompts: bool = False) -> int:
    """The token positions one forward and backward pass over ``samples`` runs, padding left out (pure): every
    sample's prompt and response, or, where each distinct prompt runs once for all its samples
    (``SharedPrompts``), those prompts once and every response."""
    if not shared_prompts:
        return sum(s.length for s in samples)
    return sum(len(s.response_ids) for s in samples) + sum(len(p) for p in {tuple(s.prompt_ids) for s in samples})


def summed_positions(positions: int) -> float:
    """``positions`` summed over the role's ranks (each trains its shard): the role's ``positions_trained``."""
    return float(sum_over_ranks(torch.tensor([positions], dtype=torch.float64))[0])


def optimizer_steps(samples: list[Experience], per_rank_batch: int, micro: int, epochs: int, seed: int,
                    pad_id: int, device, overhead: int = 0,
                    responses_only: bool = False) -> list[list[tuple[list[Experience], RLBatch]]]:
    """The step's samples shuffled per epoch (seeded), cut into optimizer steps; each optimizer step's samples
    are cut into micro-batches longest first (``micro_batches``).  The micro-batches of one optimizer step add
    up to one gradient, so how they are cut changes nothing but the padding: in a GRPO step of SmolLM2-135M on
    ASDiv (64 samples, micro-batches of 16), shuffled micro-batches held twice the real tokens, sorted ones
    1.16 times.  ``responses_only``: the lengths that count are the responses' (the prompts run apart)."""
    out = []
    for epoch in range(epochs):
        order = list(samples)
        random.Random(seed * 1000 + epoch).shuffle(order)
        for mb in chunks(order, per_rank_batch):
            out.append([(m, collate(m, pad_id, device)) for m in micro_batches(mb, micro, overhead, responses_only)])
    return out


def micro_batches(samples: list[Experience], micro: int, overhead: int,
                  responses_only: bool = False) -> list[list[Experience]]:
    """One optimizer step's samples on this rank, longest first, cut into micro-batches: of ``micro`` rows, or,
    with ``overhead`` > 0, of at most ``micro`` rows at the least padded positions plus ``overhead`` positions
    per micro-batch (``cut_longest_first``), as many as the role's rank that needs the most (every rank makes
    the same number of backward passes: each one reduces the gradient over the ranks)."""
    rows = by_length(samples, responses_only)
    if not overhead:
        return chunks(rows, micro)
    lengths = [padded_length(s, responses_only) for s in rows]
    sizes = cut_longest_first(lengths, micro, overhead)
    runs = max_over_ranks(len(sizes))
    if runs != len(sizes):
        sizes = cut_longest_first(lengths, micro, overhead, runs)
    out = []
    for n in sizes:
        out.append(rows[:n])
        rows = rows[n:]
    return out


def run_optimizer_step(engine, micro_batches: list[tuple[list[Experience], RLBatch]],
                       micro_loss: Callable[[list[Experience], RLBatch, StepNorm], tuple[torch.Tensor, dict]],
                       world_size: int, constant: float | None) -> dict[str, float]:
    """Backward over every micro-batch with the step's global counts, then one optimizer step.

    Returns the step loss (the same on every rank of the role), token-weighted means of the loss function's
    metrics over this rank's tokens, and this rank's seconds in the forward passes with the loss (``forward_s``),
    the backward passes (``backward_s``) and the optimizer step (``optimizer_s``); on a GPU each is timed to
    the end of its kernels.
    """
    norm = StepNorm.from_masks([b.mask for _, b in micro_batches], world_size, sum_over_ranks, constant)
    loss_share, weighted, tokens = 0.0, {}, 0.0
    seconds = {"forward_s": 0.0, "backward_s": 0.0, "optimizer_s": 0.0}
    clock = _Clock(getattr(engine, "device", None))
    for samples, batch in micro_batches:
        loss, metrics = micro_loss(samples, batch, norm)
        seconds["forward_s"] += clock.lap()
        engine.backward(loss, scale_wrt_gas=False)
        seconds["backward_s"] += clock.lap()
        loss_share += float(loss.detach())
        n = float(batch.mask.sum())
        tokens += n
        for k, v in metrics.items():
            weighted[k] = weighted.get(k, 0.0) + float(v) * n
        clock.lap()  # the metrics' host copies count nowhere
    grad_norm = optimizer_step(engine)
    seconds["optimizer_s"] = clock.lap()
    out = {k: v / max(tokens, 1.0) for k, v in weighted.items()}
    out["loss"] = float(sum_over_ranks(torch.tensor([loss_share], dtype=torch.float64))[0]) / world_size
    out["grad_norm"] = grad_norm
    return out | seconds


def combine(history: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of a call's optimizer steps: seconds (``*_s``) summed, everything else averaged."""
    return {k: sum(h[k] for h in history) / (1 if k.endswith("_s") else len(history)) for k in history[0]}


class _Clock:
    """Seconds since the last lap; on a CUDA device, after its queued kernels finish."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda" if device is not None else False
        self.t = time.perf_counter()

    def lap(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        out, self.t = now - self.t, now
        return out
