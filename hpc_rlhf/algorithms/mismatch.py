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
"""
from __future__ import annotations

import torch

from .registry import IS_CORRECTIONS

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
