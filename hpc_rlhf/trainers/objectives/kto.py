"""KTO on labelled completions, with the KL reference point z0 from mismatched prompt/completion pairs."""
from __future__ import annotations

from typing import Sequence

import torch

from ...algorithms.preference import kto_loss, kto_reference_point
from ...data.packing import collate_padded
from ...data.preference import load_labelled
from ...distributed.collectives import sum_over_ranks
from .common import (OFFLINE_OBJECTIVES, LossOut, PolicyObjective, Reference, StepView, balanced_chunks,
                     mean_stat, scalar_stat, sequence_logps)


@OFFLINE_OBJECTIVES.register("kto")
class KTO(PolicyObjective):
    def load_data(self):
        return load_labelled(self.cfg.data, self.tokenizer, self.cfg.train.seed)

    def prepare(self, datasets: Sequence[list]) -> None:
        self.ref = Reference(self.cfg, self.device, self.pad_id)

    @torch.no_grad()
    def step_context(self, engine, view: StepView) -> torch.Tensor:
        """z0 = max(0, mean over the step of log π(y_{i+1}|x_i) − log π_ref(y_{i+1}|x_i)).

        Row i of the step (in its global order, over all ranks) is paired with the completion of row
        (i + 1) mod B; each rank scores the mismatches of its own rows and one all-reduce makes the mean,
        so z0 does not depend on the rank count or the micro-batch size.  A mismatched sequence longer
        than max_len has its completion cut."""
        items, n = view.items, len(view.items)
        mismatched = [items[i].sequence(items[(i + 1) % n].completion_ids, self.cfg.data.max_len)
                      for i in view.my_positions]
        values = []
        for group, keep in balanced_chunks(mismatched, self.micro, [items[0].sequence()]):
            batch = collate_padded(group, self.pad_id).to(self.device)
            kl = sequence_logps(engine, batch)[0] - self.ref.batch_logps(batch)
            if keep:
                values.append(kl)
        kl = torch.cat(values) if values else torch.zeros(0, device=self.device)
        return kto_reference_point(kl, all_reduce=sum_over_ranks)

    def loss(self, engine, rows: list, z0: torch.Tensor) -> LossOut:
        o = self.cfg.objective
        batch = collate_padded([r.sequence() for r in rows], self.pad_id).to(self.device)
        policy = sequence_logps(engine, batch)[0]
        desirable = torch.tensor([r.desirable for r in rows], device=policy.device)
        loss, m = kto_loss(policy, self.ref.batch_logps(batch), desirable, z0, beta=o.beta,
                           desirable_weight=o.desirable_weight, undesirable_weight=o.undesirable_weight)
        rewards, n = m["rewards"], len(rows)
        stats = {"kl": scalar_stat(m["z0"], n),
                 "reward_desirable": mean_stat(rewards[desirable]),
                 "reward_undesirable": mean_stat(rewards[~desirable]),
                 # a row is "right" when its reward β·r lies on its label's side of the reference point β·z0
                 "accuracy": mean_stat(((rewards > o.beta * m["z0"]) == desirable).float())}
        return LossOut(loss, n, stats)
