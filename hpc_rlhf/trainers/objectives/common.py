"""What the offline objectives share: the unit interface, step views, log-probs of sequences and the reference.

A unit (one per objective, registered by name) builds the trained model, prepares what it needs
before training (the reference model, precomputed reference log-probs), splits a rank's items into
micro-batches, computes the loss of one micro-batch and exports the result.  The trainer in
`trainers/offline.py` only calls these methods.
"""
from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ...algorithms.preference import sequence_logprobs
from ...algorithms.registry import Registry
from ...checkpoint.hf_export import save_hf
from ...data.batching import chunks
from ...data.packing import Batch, collate_padded
from ...distributed.collectives import max_over_ranks, sum_over_ranks
from ...models.loading import load_causal_lm

OFFLINE_OBJECTIVES: Registry = Registry("offline objective")


# ---------------------------------------------------------------------------------------------------
# collectives and micro-batches


def balanced(groups: list[list], filler: Sequence) -> list[tuple[list, bool]]:
    """``groups``, then as many repeats of a filler group as make every rank's count equal: a repeat is
    flagged False (its result is discarded).  ZeRO-3 gathers parameters inside every forward, so every
    rank runs as many; the filler is the last group, or ``filler`` on a rank with none."""
    fill = list(groups[-1]) if groups else list(filler)
    return [(g, True) for g in groups] + [(fill, False)] * (max_over_ranks(len(groups)) - len(groups))


def balanced_chunks(items: Sequence, size: int, filler: Sequence) -> list[tuple[list, bool]]:
    """Micro-batches of ``size`` items, as many on every rank (`balanced`)."""
    return balanced(chunks(items, size), filler[:size])


@dataclass
class StepView:
    """The items of one step (or of the eval set) over all ranks, in order; this rank takes every
    ``world``-th one starting at ``rank``."""
    items: list
    rank: int
    world: int

    @property
    def mine(self) -> list:
        return self.items[self.rank::self.world]

    @property
    def my_positions(self) -> range:
        return range(self.rank, len(self.items), self.world)


class Stats:
    """(sum, count) per metric over micro-batches; ``means()`` reduces over ranks (same key order everywhere)."""

    def __init__(self) -> None:
        self._acc: dict[str, list[float]] = {}

    def add(self, name: str, total: float, count: float) -> None:
        acc = self._acc.setdefault(name, [0.0, 0.0])
        acc[0] += float(total)
        acc[1] += float(count)

    def update(self, stats: dict[str, tuple[float, float]]) -> None:
        for k, (s, n) in stats.items():
            self.add(k, s, n)

    def means(self) -> dict[str, float]:
        names = sorted(self._acc)
        t = sum_over_ranks(torch.tensor([v for k in names for v in self._acc[k]], dtype=torch.float64))
        out = {}
        for i, k in enumerate(names):
            s, n = float(t[2 * i]), float(t[2 * i + 1])
            out[k] = s / n if n else float("nan")
        return out


@dataclass
class LossOut:
    """A micro-batch's loss, the MEAN over its ``count`` items (pairs or rows), and its metrics as
    (sum, count) so they average over the whole step."""
    loss: torch.Tensor
    count: int
    stats: dict[str, tuple[float, float]]


def mean_stat(values: torch.Tensor) -> tuple[float, float]:
    """(sum, count) of a [B] tensor."""
    return float(values.detach().float().sum()), float(values.numel())


def scalar_stat(mean: torch.Tensor, count: int) -> tuple[float, float]:
    """(sum, count) of a metric given as the mean over ``count`` items."""
    return float(mean.detach().float()) * count, float(count)


def pair_stats(metrics: dict[str, torch.Tensor], count: int) -> dict[str, tuple[float, float]]:
    """The pairwise losses' metrics (per-pair rewards and margins, 0-dim accuracy) as (sum, count)."""
    return {"chosen_reward": mean_stat(metrics["chosen_rewards"]),
            "rejected_reward": mean_stat(metrics["rejected_rewards"]),
            "margin": mean_stat(metrics["margins"]),
            "accuracy": scalar_stat(metrics["accuracy"], count)}


# ---------------------------------------------------------------------------------------------------
# log-probs


def collate_pairs(pairs: Sequence, pad_id: int, device) -> Batch:
    """Chosen rows then rejected rows of the pairs, right-padded into one batch (one forward)."""
    return collate_padded([p.chosen for p in pairs] + [p.rejected for p in pairs], pad_id).to(device)


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(label_t | tokens < t) [B, T-1] and the mask of targets (labels are unshifted, -100 elsewhere)."""
    tgt = labels[:, 1:]
    mask = tgt != -100
    z = logits[:, :-1].float()
    picked = z.gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1), mask


def sequence_logps(model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response log-probs [B] and response lengths [B] of every row of ``batch``."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids, use_cache=False).logits
    lp, mask = token_logps(logits, batch.labels)
    return sequence_logprobs(lp, mask), mask.sum(-1)


def split_pairs(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = values.shape[0] // 2
    return values[:half], values[half:]


# ---------------------------------------------------------------------------------------------------
# units


class Objective:
    """Base unit; subclasses set ``load_data`` and implement ``build_model`` and ``loss``."""

    def __init__(self, cfg, de, device, tokenizer):
        self.cfg, self.de, self.device, self.tokenizer = cfg, de, device, tokenizer
        self.pad_id = tokenizer.pad_token_id
        self.micro = cfg.train.micro_train_batch_size

    def load_data(self) -> tuple[list, list, Any]:
        raise NotImplementedError

    def prepare(self, datasets: Sequence[list]) -> None:
        """Before the trained model is built: load or precompute the reference."""

    def build_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def step_items(self, engine, view: StepView, step: int) -> StepView:
        """The items optimizer step ``step`` (0-based) trains on: the data's (``view``), or items the unit makes from
        them (kd with objective.lmbda: the student's own responses)."""
        return view

    def step_context(self, engine, view: StepView) -> Any:
        """Whatever the step's losses need from the whole step (KTO: the reference point z0)."""
        return None

    def micro_batches(self, items: list) -> list[list]:
        """This rank's ``items`` in micro-batches; every rank that holds as many items gets as many."""
        return chunks(items, self.micro)

    def loss(self, engine, items: list, ctx: Any) -> LossOut:
        raise NotImplementedError

    def step_metrics(self, ctx: Any) -> dict[str, float]:
        """Metrics of the whole step, read from its context (the same on every rank)."""
        return {}

    def export(self, engine, save_path: str, files: dict[str, str], stats_items: list,
               final_eval: dict[str, float]) -> dict[str, float]:
        """Write the HF folder; return metrics worth logging once (e.g. reward statistics).  ``final_eval``: the
        metrics of the eval after the last step (the exported model's), empty when none ran."""
        save_hf(engine, self.tokenizer, save_path, files)
        return {}


class PolicyObjective(Objective):
    """Trains a causal LM on sequence log-probs of responses."""

    def build_model(self) -> torch.nn.Module:
        return load_causal_lm(self.cfg.model)

    def pair_logps(self, engine, pairs: list):
        """Policy log-probs (with gradient) and lengths of chosen and rejected, one forward; and the batch."""
        batch = collate_pairs(pairs, self.pad_id, self.device)
        logps, lengths = sequence_logps(engine, batch)
        (pc, pr), (lc, lr) = split_pairs(logps), split_pairs(lengths)
        return pc, pr, lc, lr, batch


class Reference:
    """The frozen reference model on this rank (a full copy, in eval mode) and the log-probs it gives."""

    def __init__(self, cfg, device, pad_id: int):
        obj = cfg.objective
        model_cfg = dataclasses.replace(cfg.model, pretrain=obj.ref_pretrain or cfg.model.pretrain,
                                        gradient_checkpointing=False)
        self.model = load_causal_lm(model_cfg, trainable=False).to(device)
        self.device, self.pad_id = device, pad_id

    @torch.no_grad()
    def batch_logps(self, batch: Batch) -> torch.Tensor:
        return sequence_logps(self.model, batch)[0]

    def free(self) -> None:
        self.model = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
