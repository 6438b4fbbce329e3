"""SimPO and ORPO: pairwise objectives without a reference model."""
from __future__ import annotations

from ...algorithms.preference import orpo_loss, simpo_loss
from ...data.preference import load_pairs
from .common import OFFLINE_OBJECTIVES, LossOut, PolicyObjective, mean_stat, pair_stats, scalar_stat


class _PairPolicy(PolicyObjective):
    def load_data(self):
        return load_pairs(self.cfg.data, self.tokenizer, self.cfg.train.seed)


@OFFLINE_OBJECTIVES.register("simpo")
class SimPO(_PairPolicy):
    def loss(self, engine, pairs: list, ctx) -> LossOut:
        o = self.cfg.objective
        pc, pr, lc, lr, _ = self.pair_logps(engine, pairs)
        loss, m = simpo_loss(pc, pr, lc, lr, beta=o.beta, gamma=o.gamma, label_smoothing=o.label_smoothing)
        return LossOut(loss, len(pairs), pair_stats(m, len(pairs)))


@OFFLINE_OBJECTIVES.register("orpo")
class ORPO(_PairPolicy):
    def loss(self, engine, pairs: list, ctx) -> LossOut:
        pc, pr, lc, lr, _ = self.pair_logps(engine, pairs)
        loss, m = orpo_loss(pc, pr, lc, lr, lam=self.cfg.objective.orpo_lambda)
        n = len(pairs)
        stats = pair_stats(m, n)
        stats.update(nll=scalar_stat(m["nll"], n), or_loss=scalar_stat(m["or_loss"], n),
                     log_odds_ratio=mean_stat(m["log_odds_ratio"]))
        return LossOut(loss, n, stats)
