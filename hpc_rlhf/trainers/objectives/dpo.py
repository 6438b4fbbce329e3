"""DPO, IPO and cDPO against a frozen reference, live on the same ranks or precomputed once."""
from __future__ import annotations

from typing import Sequence

import torch

from ...algorithms.preference import dpo_loss
from ...data.batching import chunks
from ...data.preference import load_pairs
from ...distributed.collectives import sum_over_ranks
from .common import (OFFLINE_OBJECTIVES, LossOut, PolicyObjective, Reference, collate_pairs,
                     pair_stats, scalar_stat, split_pairs)


def precompute_pair_logps(ref: Reference, datasets: Sequence[list], micro: int, rank: int,
                          world: int) -> dict[int, tuple[float, float]]:
    """Reference log-probs (chosen, rejected) of every distinct pair of ``datasets``, keyed by ``id(pair)``.

    The pairs are sharded over the ranks, scored in micro-batches of ``micro`` pairs (chosen and rejected
    in one forward, as in training) and summed over the ranks, so every rank ends up with all of them."""
    pairs = list({id(p): p for data in datasets for p in data}.values())
    table = torch.zeros(len(pairs), 2, dtype=torch.float64)
    mine = list(range(rank, len(pairs), world))
    for group in chunks(mine, micro):
        batch = collate_pairs([pairs[i] for i in group], ref.pad_id, ref.device)
        chosen, rejected = split_pairs(ref.batch_logps(batch))
        table[group] = torch.stack([chosen, rejected], dim=-1).double().cpu()
    table = sum_over_ranks(table)
    return {id(p): (float(table[i, 0]), float(table[i, 1])) for i, p in enumerate(pairs)}


@OFFLINE_OBJECTIVES.register("dpo")
class DPO(PolicyObjective):
    def load_data(self):
        return load_pairs(self.cfg.data, self.tokenizer, self.cfg.train.seed)

    def prepare(self, datasets: Sequence[list]) -> None:
        self.ref = Reference(self.cfg, self.device, self.pad_id)
        self.cached: dict[int, tuple[float, float]] | None = None
        if self.cfg.objective.ref_precompute:
            self.cached = precompute_pair_logps(self.ref, datasets, self.micro, self.de.rank, self.de.world_size)
            self.ref.free()
            self.ref = None

    def ref_logps(self, pairs: list, batch) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cached is None:
            return split_pairs(self.ref.batch_logps(batch))
        values = torch.tensor([self.cached[id(p)] for p in pairs], dtype=torch.float32, device=self.device)
        return values[:, 0], values[:, 1]

    def loss(self, engine, pairs: list, ctx) -> LossOut:
        o = self.cfg.objective
        pc, pr, lc, _, batch = self.pair_logps(engine, pairs)
        rc, rr = self.ref_logps(pairs, batch)
        loss, m = dpo_loss(pc, pr, rc, rr, beta=o.beta, loss_type=o.loss_type, label_smoothing=o.label_smoothing,
                           nll_coef=o.nll_coef, chosen_lengths=lc)
        stats = pair_stats(m, len(pairs))
        if "nll" in m:
            stats["nll"] = scalar_stat(m["nll"], len(pairs))
        return LossOut(loss, len(pairs), stats)
