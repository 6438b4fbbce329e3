"""Per-token policy losses (before aggregation) and the entropy of the policy.

Every loss registered in ``POLICY_LOSSES`` has the signature

    fn(log_probs, old_log_probs, advantages, mask, *, <options>) -> (loss [B, R], metrics)

where the options are keyword arguments named as the ``algo`` options the loss reads (its line in
``registry.py``; ``RLAlgorithm`` passes those): ``eps_clip=0.2, eps_clip_high=None, dual_clip=None`` for the
clipped losses, ``tau_pos``, ``tau_neg`` for ``sapo``, ``delta_low``, ``delta_high`` for ``dppo_tv`` and ``dppo_kl``.

``log_probs`` [B, R] are the current policy's log-probabilities of the sampled response tokens
(with gradient), ``old_log_probs`` those of the policy that generated them, ``advantages`` [B, R],
``mask`` [B, R].  The loss is 0 on padding; it becomes a scalar through ``aggregation.aggregate``.
``eps_clip_high=None`` means ``eps_clip`` (symmetric clip).  ``metrics`` holds detached 0-dim
tensors, each a mean over this call's valid tokens: ``clip_frac`` (tokens where the clipped term
is the active one; for DPPO the tokens its trust region masks), ``dual_clip_frac``, and ``approx_kl`` =
mean((ρ − 1) − log ρ), the k3 estimate of KL(π_old ‖ π_θ) on the old policy's samples.
"""
from __future__ import annotations

from typing import Optional

import torch

from .registry import POLICY_LOSSES

Tensor = torch.Tensor


def _masked_log_ratio(log_probs: Tensor, old_log_probs: Tensor, mask: Tensor) -> Tensor:
    lr = log_probs.float() - old_log_probs.float().detach()
    return torch.where(mask.bool(), lr, torch.zeros_like(lr))


def _adv(advantages: Tensor, mask: Tensor) -> Tensor:
    a = advantages.detach().float()
    return torch.where(mask.bool(), a, torch.zeros_like(a))


def _local_mean(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.float()
    return ((x.detach().float() * m).sum() / m.sum().clamp(min=1.0))


def _eps(eps_clip: float, eps_clip_high: Optional[float]) -> tuple[float, float]:
    lo = float(eps_clip)
    hi = lo if eps_clip_high is None else float(eps_clip_high)
    if lo < 0 or hi < 0:
        raise ValueError(f"eps_clip/eps_clip_high must be >= 0, got {lo}, {hi}")
    return lo, hi


def _clipped_objective(ratio: Tensor, adv: Tensor, lo: float, hi: float,
                       dual_clip: Optional[float]) -> tuple[Tensor, Tensor, Tensor]:
    """min(ρA, clip(ρ, 1−lo, 1+hi)A), with the dual clip max(·, cA) for A < 0.

    Returns (objective, clip_active, dual_clip_active)."""
    surr1 = ratio * adv
    surr2 = ratio.clamp(1.0 - lo, 1.0 + hi) * adv
    obj = torch.minimum(surr1, surr2)
    clipped = surr2 < surr1
    dual = torch.zeros_like(clipped)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        floor = dual_clip * adv
        dual = (adv < 0) & (obj < floor)
        obj = torch.where(adv < 0, torch.maximum(obj, floor), obj)
    return obj, clipped, dual


def _metrics(log_ratio: Tensor, clipped: Tensor, dual: Tensor, mask: Tensor) -> dict[str, Tensor]:
    lr = log_ratio.detach()
    return {
        "clip_frac": _local_mean(clipped.float(), mask),
        "dual_clip_frac": _local_mean(dual.float(), mask),
        "approx_kl": _local_mean(torch.expm1(lr) - lr, mask),
    }


@POLICY_LOSSES.register("ppo")
def ppo_policy_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, *,
                    eps_clip: float = 0.2, eps_clip_high: Optional[float] = None,
                    dual_clip: Optional[float] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate, per token:

        ρ_t = exp(log π_θ − log π_old)
        loss_t = −min(ρ_t A_t, clip(ρ_t, 1 − eps_clip, 1 + eps_clip_high) A_t)

    ``eps_clip_high > eps_clip`` is DAPO's "clip-higher".  With ``dual_clip = c > 1`` (Ye et al.
    2020) the objective for A_t < 0 is max(min(ρA, clip(ρ)A), cA), bounding the loss of tokens
    whose ratio has grown far beyond the clip."""
    lo, hi = _eps(eps_clip, eps_clip_high)
    m = mask.float()
    lr = _masked_log_ratio(log_probs, old_log_probs, mask)
    ratio = torch.exp(lr)
    obj, clipped, dual = _clipped_objective(ratio, _adv(advantages, mask), lo, hi, dual_clip)
    return -obj * m, _metrics(lr, clipped, dual, mask)


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, *,
                     eps_clip: float = 0.2, eps_clip_high: Optional[float] = None,
                     dual_clip: Optional[float] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025), in its token form ("GSPO-token"):

        s_i     = exp( (1/|y_i|) Σ_t (log π_θ − log π_old)_{i,t} )      (valid tokens of sample i)
        s_{i,t} = sg[s_i] · exp(log π_θ(y_{i,t}) − sg[log π_θ(y_{i,t})])
        loss_{i,t} = −min(s_{i,t} A_{i,t}, clip(s_{i,t}, 1 − eps_clip, 1 + eps_clip_high) A_{i,t})

    s_{i,t} equals s_i in value, so the clip decision is per sequence, while the gradient flows
    through every token's log-prob: ∇ = s_i A_i ∇ log π_θ(y_{i,t}) for unclipped sequences.  With a
    sequence-level advantage (A_{i,t} = A_i, as from group estimators) this is exactly GSPO.  The
    paper uses eps_clip=3e-4, eps_clip_high=4e-4 and the seq_mean aggregation."""
    lo, hi = _eps(eps_clip, eps_clip_high)
    m = mask.float()
    valid = mask.bool()
    lr = _masked_log_ratio(log_probs, old_log_probs, mask)
    seq_lr = (lr * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    lp = torch.where(valid, log_probs.float(), torch.zeros_like(lr))
    tok_log_s = seq_lr.detach()[:, None] + lp - lp.detach()
    tok_log_s = torch.where(valid, tok_log_s, torch.zeros_like(tok_log_s))
    ratio = torch.exp(tok_log_s)
    obj, clipped, dual = _clipped_objective(ratio, _adv(advantages, mask), lo, hi, dual_clip)
    metrics = _metrics(lr, clipped, dual, mask)
    has = m.sum(-1) > 0
    metrics["seq_ratio_mean"] = (torch.exp(seq_lr.detach())[has].mean() if bool(has.any())
                                 else torch.ones(()))
    return -obj * m, metrics


@POLICY_LOSSES.register("cispo")
def cispo_policy_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, *,
                      eps_clip: float = 0.2, eps_clip_high: Optional[float] = None,
                      dual_clip: Optional[float] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025): clip and detach the importance-sampling weight, keep every token:

        loss_t = −sg[clip(ρ_t, 1 − eps_clip, 1 + eps_clip_high)] · A_t · log π_θ(y_t)

    The gradient is −clip(ρ_t)·A_t·∇log π_θ(y_t) for every token (none is dropped by the clip).
    The paper effectively has no lower bound (set eps_clip = 1.0) and tunes only eps_clip_high.
    Its value is not a surrogate objective; only its gradient matters.  ``dual_clip`` is not
    defined for CISPO and must be None."""
    if dual_clip is not None:
        raise ValueError("dual_clip is not defined for policy_loss 'cispo'")
    lo, hi = _eps(eps_clip, eps_clip_high)
    m = mask.float()
    valid = mask.bool()
    lr = _masked_log_ratio(log_probs, old_log_probs, mask).detach()
    ratio = torch.exp(lr)
    w = ratio.clamp(1.0 - lo, 1.0 + hi)
    lp = torch.where(valid, log_probs.float(), torch.zeros_like(lr))
    loss = -(w * _adv(advantages, mask)) * lp * m
    clipped = (ratio < 1.0 - lo) | (ratio > 1.0 + hi)
    return loss, _metrics(lr, clipped, torch.zeros_like(clipped), mask)


@POLICY_LOSSES.register("sapo")
def sapo_policy_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, *,
                     tau_pos: float = 1.0, tau_neg: float = 1.05) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Gao et al. 2025, Qwen, arXiv:2511.20347): a soft gate in place of the clip, per token:

        f_τ(ρ) = σ(τ (ρ − 1)) · 4 / τ,      τ = tau_pos where A_t > 0, else tau_neg
        loss_t = −f_τ(ρ_t) A_t

    The gradient is −w_t ρ_t A_t ∇log π_θ(y_t) with w_t = 4 σ(τ(ρ_t − 1)) (1 − σ(τ(ρ_t − 1))): w = 1 at
    ρ = 1 (PPO's gradient there), decaying smoothly as ρ leaves 1, faster for a larger τ; no token is cut
    off at a hard edge.  The log-ratio is capped at 20 so that the gate's vanishing slope never meets an
    infinite ratio (0·inf).  Metrics: ``clip_frac`` and ``dual_clip_frac`` 0, ``approx_kl``, and
    ``sapo_gate_mean``, the mean of w_t."""
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"tau_pos and tau_neg must be > 0, got {tau_pos}, {tau_neg}")
    lr = _masked_log_ratio(log_probs, old_log_probs, mask)
    adv = _adv(advantages, mask)
    tau = torch.full_like(adv, float(tau_neg)).masked_fill(adv > 0, float(tau_pos))
    gate = torch.sigmoid(tau * (torch.exp(lr.clamp(max=20.0)) - 1.0))
    none = torch.zeros_like(mask, dtype=torch.bool)
    metrics = _metrics(lr, none, none, mask)
    metrics["sapo_gate_mean"] = _local_mean(4.0 * gate * (1.0 - gate), mask)
    return -(gate * 4.0 / tau) * adv * mask.float(), metrics


def _binary_kl(old_lp: Tensor, lp: Tensor) -> Tensor:
    """KL(Bern(μ) ‖ Bern(π)) of the sampled token's probabilities μ = e^old_lp, π = e^lp: the divergence of
    the two distributions with the vocabulary cut into {the sampled token, every other token}."""
    mu = torch.exp(old_lp)
    rest_mu, rest_pi = -torch.expm1(old_lp), -torch.expm1(lp)  # 1 − μ, 1 − π, exact near μ, π → 0
    return mu * (old_lp - lp) + torch.xlogy(rest_mu, rest_mu) - torch.xlogy(rest_mu, rest_pi)


def _dppo(divergence: str, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
          delta_low: float, delta_high: float) -> tuple[Tensor, dict[str, Tensor]]:
    if delta_low < 0 or delta_high < 0:
        raise ValueError(f"delta_low and delta_high must be >= 0, got {delta_low}, {delta_high}")
    valid = mask.bool()
    lr = _masked_log_ratio(log_probs, old_log_probs, mask)
    adv = _adv(advantages, mask)
    with torch.no_grad():
        old_lp = torch.where(valid, old_log_probs.float(), torch.zeros_like(lr))
        lp = torch.where(valid, log_probs.detach().float(), torch.zeros_like(lr))
        if divergence == "tv":  # |π − μ|, on the side the advantage pushes π to
            diff = torch.exp(lp) - torch.exp(old_lp)
            up, down = diff > delta_high, diff < -delta_low
        else:
            d = _binary_kl(old_lp, lp)
            up, down = (lp > old_lp) & (d > delta_high), (lp < old_lp) & (d > delta_low)
        out = valid & (((adv > 0) & up) | ((adv < 0) & down))
    obj = torch.exp(lr) * adv
    return -torch.where(out, torch.zeros_like(obj), obj) * mask.float(), _metrics(lr, out, torch.zeros_like(out), mask)


@POLICY_LOSSES.register("dppo_tv")
def dppo_tv_policy_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, *,
                        delta_low: float = 0.2, delta_high: float = 0.2) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-TV (Qi et al. 2026, arXiv:2602.04879), per token, with μ = π_old(y_t), π = π_θ(y_t):

        M_t = 0 if (A_t > 0 and π − μ > delta_high) or (A_t < 0 and π − μ < −delta_low), else 1
        loss_t = −M_t ρ_t A_t                                            (M_t detached)

    |π − μ| is the total variation between the two policies with the vocabulary cut into {y_t, the rest}.
    A token leaves the gradient only when its probability has already moved past the region in the
    direction its advantage pushes it; a move back, or any move of an A = 0 token, keeps it.  Tokens at the
    edge (π − μ = ±delta) are kept.  Metrics: ``clip_frac`` (valid tokens with M_t = 0), ``dual_clip_frac``
    0, ``approx_kl``."""
    return _dppo("tv", log_probs, old_log_probs, advantages, mask, delta_low, delta_high)


@POLICY_LOSSES.register("dppo_kl")
def dppo_kl_policy_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, *,
                        delta_low: float = 0.05, delta_high: float = 0.05) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-KL (Qi et al. 2026): as ``dppo_tv`` with the region D_t = KL(Bern(μ) ‖ Bern(π)) =
    μ log(μ/π) + (1 − μ) log((1 − μ)/(1 − π)):

        M_t = 0 if (A_t > 0 and π > μ and D_t > delta_high) or (A_t < 0 and π < μ and D_t > delta_low)
        loss_t = −M_t ρ_t A_t"""
    return _dppo("kl", log_probs, old_log_probs, advantages, mask, delta_low, delta_high)


def policy_loss(name: str, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor,
                mask: Tensor, **kwargs) -> tuple[Tensor, dict[str, Tensor]]:
    """Call the registered policy loss ``name`` (kwargs: its options)."""
    return POLICY_LOSSES.get(name)(log_probs, old_log_probs, advantages, mask, **kwargs)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy H_t = −Σ_v p_v log p_v of the softmax over the last dim: [..., V] → [...].

    Computed in float32 as logsumexp(z) − Σ_v softmax(z)_v z_v; differentiable (for the entropy
    bonus −entropy_loss_coef · H).  Logits of −inf (masked vocabulary) are allowed."""
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1)
    p = torch.softmax(z, dim=-1)
    z_finite = torch.where(torch.isfinite(z), z, torch.zeros_like(z))  # −inf logits: p = 0, no nan
    return lse - (p * z_finite).sum(-1)
