"""Rollout/trainer mismatch: how far the generation engine's log-probs are from the trainer's, and
importance-sampling (IS) weights that correct the policy gradient for the difference.

The samples are drawn by the rollout engine (vLLM, the in-process HF engine...), whose kernels,
precision and batching differ from the trainer's, so the distribution that generated a token,
π_engine, is not exactly the trainer's π_old even with the same weights.  All tensors are [B, R]
(sequences × response positions) with a 0/1 ``mask``; only valid positions (mask 1) are read, so
padding may hold anything (inf, nan), and every result is 0 there.  Both log-probs are those of the
unmodified model distribution (temperature 1, no top-k / top-p) of the sampled response tokens.

Metrics (``mismatch_metrics``), with d_t = log π_trainer(y_t) − log π_engine(y_t) and
r_t = exp(d_t) = π_trainer(y_t) / π_engine(y_t), each a single number over ALL valid tokens of the
call (every sequence's tokens pooled, so long responses weigh more):

* ``mismatch/k1``  = mean_t(−d_t) = mean(log π_engine − log π_trainer): the plain (k1) estimate of
  KL(π_engine ‖ π_trainer) from the engine's own samples; unbiased but can be negative.
* ``mismatch/k3``  = mean_t(r_t − 1 − log r_t): the k3 estimate of the same KL(π_engine ‖ π_trainer),
  also unbiased on engine samples (E_engine[r] = 1), and ≥ 0 token by token.
* ``mismatch/max_abs_diff`` = max_t |d_t|: the worst single token.

With no valid token every metric is 0.

IS corrections (registry ``IS_CORRECTIONS``), each

    fn(old_logp, engine_logp, mask, *, low, high) -> (weights [B, R], metrics)

with the per-token ratio of the trainer's policy at generation time (the "old" policy) to the
engine, w_t = exp(log π_old(y_t) − log π_engine(y_t)).  The weights are detached (they rescale the
per-token policy loss, never receive a gradient) and are 0 on padding.  ``0 <= low < high``.

* ``tis`` — truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you
  off-policy RL training"): weight_t = min(w_t, high).  Every token is kept; ratios above ``high``
  are cut down to ``high``.  ``low`` is not used (small ratios already give small weights).
  Metric ``is/clipped_frac``: fraction of valid tokens with w_t > high.
* ``icepop`` — IcePop (Ling team, 2025): weight_t = w_t when low <= w_t <= high, else 0: a token on
  which the two engines disagree too much (either way) is dropped from the gradient.
  Metric ``is/masked_frac``: fraction of valid tokens with weight 0 because w_t is outside [low, high].
* ``seq_mask_tis`` — sequence-level masking, token-level truncation: the sequence ratio is the
  geometric mean of its token ratios, s_i = exp(mean over the valid tokens of sequence i of
  (log π_old − log π_engine)).  A sequence with s_i outside [low, high] gets weight 0 on every token;
  the tokens of a kept sequence get min(w_t, high) as in ``tis``.
  Metrics: ``is/masked_frac`` (valid tokens of dropped sequences / valid tokens),
  ``is/clipped_frac`` (valid tokens of kept sequences with w_t > high / valid tokens) and
  ``is/seq_masked_frac`` (dropped sequences / sequences with at least one valid token).

Every correction also reports ``is/weight_mean``, the mean of the final weights over the valid
tokens (dropped tokens count as 0).  Like the policy-loss metrics, every metric is a detached 0-dim
tensor.  Dropped tokens still count in the aggregation's normaliser (the step's token or sequence
count): the weights only rescale the per-token loss.

Token masks (registry ``TOKEN_MASKS``) decide once per RL step, before the step's updates, which tokens
enter the policy gradient at all; ``RLAlgorithm.advantages`` sets the advantage of a dropped token to 0.
Each ``fn(old_logp, engine_logp, mask, *, <options>, all_reduce) -> (keep [B, R], metrics)``, keep 1.0 or
0.0 (0 on padding), with metrics that are global over the ranks:

* ``m2po`` — M2PO (Zheng et al. 2025, arXiv:2510.01161), ``m2_threshold`` = τ.  With
  M2_t = (log π_old(y_t) − log π_engine(y_t))² and the valid tokens of the whole batch on every rank
  (``all_reduce`` sums over the data-parallel ranks), the tokens with the largest M2_t are dropped first,
  all tokens of one value together, until the mean M2 of the kept ones is below τ: keep = M2_t <= c for the
  largest c with mean{M2_t : M2_t <= c} < τ.  A nan M2_t counts as +inf (always dropped).  Metrics
  ``m2po/m2`` (mean M2 of all valid tokens), ``m2po/m2_kept`` and ``m2po/masked_frac``.
"""
from __future__ import annotations

import math

import torch

from .registry import IS_CORRECTIONS, TOKEN_MASKS
from .whiten import AllReduce

Tensor = torch.Tensor


def _log_ratio(num: Tensor, den: Tensor, mask: Tensor) -> Tensor:
    """(num − den) in float32 on valid positions, 0 elsewhere (whatever padding holds), detached."""
    d = num.detach().float() - den.detach().float()
    return torch.where(mask.bool(), d, torch.zeros_like(d))


def _mean(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.float()
    return (torch.where(mask.bool(), x.float(), torch.zeros_like(x, dtype=torch.float32)) * m).sum() \
        / m.sum().clamp(min=1.0)


def _check_bounds(low: float, high: float) -> None:
    if not (0.0 <= low < high):
        raise ValueError(f"IS correction bounds need 0 <= low < high, got low={low}, high={high}")


def mismatch_metrics(trainer_logp: Tensor, engine_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """k1 and k3 estimates of KL(π_engine ‖ π_trainer) and the largest |log-prob difference|."""
    d = _log_ratio(trainer_logp, engine_logp, mask)
    valid = mask.bool()
    max_abs = d.abs().max() if bool(valid.any()) else torch.zeros((), device=d.device)
    return {
        "mismatch/k1": _mean(-d, mask).detach(),
        "mismatch/k3": _mean(torch.expm1(d) - d, mask).detach(),
        "mismatch/max_abs_diff": max_abs.detach(),
    }


@IS_CORRECTIONS.register("tis")
def tis_weights(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, *, low: float,
                high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """weight_t = min(w_t, high); ``low`` unused."""
    _check_bounds(low, high)
    valid = mask.bool()
    w = torch.exp(_log_ratio(old_logp, engine_logp, mask))
    weights = torch.where(valid, w.clamp(max=high), torch.zeros_like(w))
    return weights, {"is/clipped_frac": _mean((w > high).float(), mask), "is/weight_mean": _mean(weights, mask)}


@IS_CORRECTIONS.register("icepop")
def icepop_weights(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, *, low: float,
                   high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """weight_t = w_t if low <= w_t <= high else 0."""
    _check_bounds(low, high)
    valid = mask.bool()
    w = torch.exp(_log_ratio(old_logp, engine_logp, mask))
    keep = (w >= low) & (w <= high)  # nan compares false: dropped
    weights = torch.where(valid & keep, w, torch.zeros_like(w))
    return weights, {"is/masked_frac": _mean((~keep).float(), mask), "is/weight_mean": _mean(weights, mask)}


@IS_CORRECTIONS.register("seq_mask_tis")
def seq_mask_tis_weights(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, *, low: float,
                         high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Drop sequences whose geometric-mean ratio is outside [low, high]; min(w_t, high) in the rest."""
    _check_bounds(low, high)
    valid = mask.bool()
    m = mask.float()
    lr = _log_ratio(old_logp, engine_logp, mask)
    seq_ratio = torch.exp((lr * m).sum(-1) / m.sum(-1).clamp(min=1.0))
    keep_seq = (seq_ratio >= low) & (seq_ratio <= high)
    w = torch.exp(lr)
    kept = valid & keep_seq[:, None]
    weights = torch.where(kept, w.clamp(max=high), torch.zeros_like(w))
    has = m.sum(-1) > 0
    seq_masked = ((~keep_seq) & has).float().sum() / has.float().sum().clamp(min=1.0)
    return weights, {
        "is/masked_frac": _mean((~keep_seq)[:, None].expand_as(w).float(), mask),
        "is/clipped_frac": _mean((kept & (w > high)).float(), mask),
        "is/seq_masked_frac": seq_masked,
        "is/weight_mean": _mean(weights, mask),
    }


def is_weights(name: str, old_logp: Tensor, engine_logp: Tensor, mask: Tensor, *, low: float,
               high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Call the registered IS correction ``name``."""
    return IS_CORRECTIONS.get(name)(old_logp, engine_logp, mask, low=low, high=high)


def _sums(x: Tensor, selections: list[Tensor], all_reduce: AllReduce) -> list[float]:
    """[Σ x, count] of each selection of positions, over every rank (one all-reduce), in float64."""
    t = torch.stack([v for sel in selections
                     for v in (torch.where(sel, x, torch.zeros_like(x)).double().sum(), sel.double().sum())])
    return (t if all_reduce is None else all_reduce(t)).tolist()


_F32_INF_BITS = 0x7F800000  # the bits of float32 +inf; non-negative float32 values order as their bits


def _f32(bits: int) -> float:
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32).item()


@TOKEN_MASKS.register("m2po")
def m2po_mask(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, *, m2_threshold: float,
              all_reduce: AllReduce = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Keep the tokens of smallest squared log-ratio whose mean stays below ``m2_threshold`` (module doc).

    The cut c is found by bisection over the float32 values (their bit patterns), each step one all-reduce
    of two numbers, the same on every rank: mean{M2 <= c} < τ holds for small c and fails beyond the cut,
    since the mean of the values up to c grows with c.  One all-reduce when the whole batch is already below
    τ; at most 31 more otherwise, and one for the metrics."""
    if m2_threshold <= 0:
        raise ValueError(f"m2_threshold must be > 0, got {m2_threshold}")
    valid = mask.bool()
    d = _log_ratio(old_logp, engine_logp, mask)
    m2 = torch.where(valid, torch.nan_to_num(d * d, nan=math.inf), torch.zeros_like(d))

    def below(c: float) -> bool:
        total, n = _sums(m2, [valid & (m2 <= c)], all_reduce)
        return n == 0 or total < m2_threshold * n

    lo, hi = 0, _F32_INF_BITS  # below(0.0) always holds (kept M2 are all 0, or none is kept)
    if below(math.inf):
        lo = hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if below(_f32(mid)) else (lo, mid)
    keep = valid & (m2 <= _f32(lo))
    all_sum, n_all, kept_sum, n_kept = _sums(m2, [valid, keep], all_reduce)
    return keep.float(), {
        "m2po/m2": torch.tensor(all_sum / max(n_all, 1.0)),
        "m2po/m2_kept": torch.tensor(kept_sum / max(n_kept, 1.0)),
        "m2po/masked_frac": torch.tensor((n_all - n_kept) / max(n_all, 1.0)),
    }


def token_mask(name: str, old_logp: Tensor, engine_logp: Tensor, mask: Tensor, *, all_reduce: AllReduce = None,
               **options) -> tuple[Tensor, dict[str, Tensor]]:
    """Call the registered token mask ``name`` (options: what it reads)."""
    return TOKEN_MASKS.get(name)(old_logp, engine_logp, mask, all_reduce=all_reduce, **options)
