"""Pairwise (Bradley–Terry) reward model: a one-output sequence classifier scored at the last real token."""
from __future__ import annotations

import math

import torch

from ...algorithms.reward_model_loss import pairwise_reward_loss
from ...checkpoint.hf_export import save_hf
from ...data.preference import load_pairs
from ...distributed.collectives import sum_over_ranks
from ...models.reward_model import LastTokenScores, load_reward_model
from .common import (OFFLINE_OBJECTIVES, LossOut, Objective, StepView, balanced_chunks, collate_pairs,
                     pair_stats, split_pairs)


@OFFLINE_OBJECTIVES.register("rm")
class RewardModel(Objective):
    def load_data(self):
        return load_pairs(self.cfg.data, self.tokenizer, self.cfg.train.seed, self.cfg.objective.margin_key)

    def build_model(self) -> torch.nn.Module:
        model = load_reward_model(self.cfg.model, self.pad_id)
        self.scores = LastTokenScores(model)
        return model

    def pair_scores(self, engine, pairs: list) -> torch.Tensor:
        """Scores [2k]: the k chosen rows, then the k rejected rows (one forward)."""
        batch = collate_pairs(pairs, self.pad_id, self.device)
        return self.scores(engine, batch.input_ids, batch.attention_mask, batch.position_ids)

    def loss(self, engine, pairs: list, ctx) -> LossOut:
        scores = self.pair_scores(engine, pairs)
        chosen, rejected = split_pairs(scores)
        margin = None
        if self.cfg.objective.margin_key:
            margin = torch.tensor([p.margin for p in pairs], dtype=torch.float32, device=chosen.device)
        loss, m = pairwise_reward_loss(chosen, rejected, margin, loss_type=self.cfg.objective.loss_type)
        # the mean square of every score: with the chosen and rejected means, the export's statistics
        squares = (float(scores.detach().double().square().sum()), float(scores.numel()))
        return LossOut(loss, len(pairs), pair_stats(m, len(pairs)) | {"reward_sq": squares})

    @torch.no_grad()
    def reward_statistics(self, engine, pairs: list) -> tuple[float, float]:
        """Mean and (population) std of the scores of every chosen and rejected response of ``pairs``."""
        engine.eval()
        view = StepView(pairs, self.de.rank, self.de.world_size)
        acc = torch.zeros(3, dtype=torch.float64, device=self.device)
        for group, keep in balanced_chunks(view.mine, self.micro, pairs[:1]):
            s = self.pair_scores(engine, group).double()
            if keep:
                acc += torch.stack([s.sum(), (s * s).sum(), torch.tensor(float(s.numel()), device=s.device,
                                                                          dtype=torch.float64)])
        engine.train()
        total, squares, n = sum_over_ranks(acc).tolist()
        mean = total / n
        return mean, math.sqrt(max(squares / n - mean * mean, 0.0))

    def export(self, engine, save_path: str, files: dict[str, str], stats_items: list,
               final_eval: dict[str, float]) -> dict[str, float]:
        """Store the score statistics in config.json (read by `rewards.model.RewardModelScorer` to normalise): from
        the eval after the last step, which scored every response of the eval set, else one pass over
        ``stats_items`` (no eval set: the training pairs)."""
        if final_eval:  # as many chosen as rejected scores: their mean is the mean of the two means
            mean = (final_eval["eval_chosen_reward"] + final_eval["eval_rejected_reward"]) / 2
            std = math.sqrt(max(final_eval["eval_reward_sq"] - mean * mean, 0.0))
        else:
            mean, std = self.reward_statistics(engine, stats_items)
        engine.module.config.reward_mean = mean
        engine.module.config.reward_std = std
        save_hf(engine, self.tokenizer, save_path, files)
        return {"reward_mean": mean, "reward_std": std}
