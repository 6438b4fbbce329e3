"""Preference losses on sequence log-probabilities: DPO (cDPO, IPO), SimPO, ORPO and KTO.

The inputs are sequence log-probs log π(y|x) = Σ_t log π(y_t | x, y_<t), summed over the response
tokens (see ``sequence_logprobs``), one value per pair (or per row for KTO): shape [B].  Policy
log-probs carry the gradient; reference log-probs are detached here.  Lengths |y| are the numbers
of response tokens of each sequence ([B], clamped to ≥ 1).

Every loss returns ``(loss, metrics)``: ``loss`` is a 0-dim tensor, the MEAN over the B pairs
(rows) of the call; ``metrics`` holds detached tensors.  The pairwise losses report per-pair [B]
``chosen_rewards``, ``rejected_rewards`` and ``margins`` (= chosen − rejected) and the 0-dim
``accuracy``, the fraction of pairs whose chosen reward is strictly the larger.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F

from .whiten import AllReduce, masked_mean

Tensor = torch.Tensor


def sequence_logprobs(token_logps: Tensor, mask: Tensor, average: bool = False) -> Tensor:
    """Sequence log-prob of each row: [B, T] → [B].

    average=False:  Σ_t m_t · logp_t                      (sum over the valid tokens)
    average=True:   Σ_t m_t · logp_t / max(Σ_t m_t, 1)     (mean over the valid tokens)

    Padded positions (mask 0) may hold anything (−inf, nan); they get neither value nor gradient."""
    valid = mask.bool()
    lp = token_logps.float()
    s = torch.where(valid, lp, torch.zeros_like(lp)).sum(-1)
    if average:
        s = s / valid.float().sum(-1).clamp(min=1.0)
    return s


def _check(beta: float, label_smoothing: float) -> None:
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing}")


def _smoothed_sigmoid_loss(x: Tensor, eps: float) -> Tensor:
    """−(1 − ε) log σ(x) − ε log σ(−x), per element (ε = 0: the plain −log σ(x))."""
    loss = -F.logsigmoid(x)
    if eps > 0:
        loss = (1.0 - eps) * loss - eps * F.logsigmoid(-x)
    return loss


def _lengths(n: Tensor) -> Tensor:
    return n.detach().float().clamp(min=1.0)


def _pair_metrics(chosen: Tensor, rejected: Tensor) -> dict[str, Tensor]:
    c, r = chosen.detach(), rejected.detach()
    return {"chosen_rewards": c, "rejected_rewards": r, "margins": c - r,
            "accuracy": (c > r).float().mean()}


def dpo_loss(policy_chosen_logps: Tensor, policy_rejected_logps: Tensor,
             ref_chosen_logps: Tensor, ref_rejected_logps: Tensor, *, beta: float = 0.1,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0, nll_coef: float = 0.0,
             chosen_lengths: Optional[Tensor] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO (Rafailov et al. 2023) and its variants, per pair i, then the mean over the B pairs:

        Δ_i = (log π(y_c) − log π_ref(y_c)) − (log π(y_r) − log π_ref(y_r))
        sigmoid (DPO):       ℓ_i = −log σ(β Δ_i)
        sigmoid, ε > 0:      ℓ_i = −(1 − ε) log σ(β Δ_i) − ε log σ(−β Δ_i)   (cDPO, label noise ε)
        ipo (Azar et al.):   ℓ_i = (Δ_i − 1/(2β))²                            (label_smoothing 0)

    With ``nll_coef`` = c > 0 each pair adds c · (−log π(y_c) / |y_c|), the chosen response's NLL
    per token (``chosen_lengths`` |y_c| required): an SFT regulariser on the chosen response, as
    in Pang et al. 2024.
    Metrics: implicit rewards β(log π − log π_ref) of chosen and rejected [B], their margins [B]
    (= βΔ), accuracy (βΔ > 0); ``nll`` (0-dim mean over pairs) when the NLL term is on."""
    _check(beta, label_smoothing)
    pc, pr = policy_chosen_logps.float(), policy_rejected_logps.float()
    chosen_ratio = pc - ref_chosen_logps.detach().float()
    rejected_ratio = pr - ref_rejected_logps.detach().float()
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        per_pair = _smoothed_sigmoid_loss(beta * delta, label_smoothing)
    elif loss_type == "ipo":
        if label_smoothing > 0:
            raise ValueError("label_smoothing is not defined for loss_type 'ipo'")
        per_pair = (delta - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"unknown dpo loss_type {loss_type!r}; known: ipo, sigmoid")
    metrics = _pair_metrics(beta * chosen_ratio, beta * rejected_ratio)
    if nll_coef:
        if chosen_lengths is None:
            raise ValueError("nll_coef needs chosen_lengths (tokens of each chosen response)")
        nll = -pc / _lengths(chosen_lengths)
        per_pair = per_pair + nll_coef * nll
        metrics["nll"] = nll.detach().mean()
    return per_pair.mean(), metrics


def simpo_loss(policy_chosen_logps: Tensor, policy_rejected_logps: Tensor,
               chosen_lengths: Tensor, rejected_lengths: Tensor, *, beta: float = 2.0,
               gamma: float = 1.0,
               label_smoothing: float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
    """SimPO (Meng et al. 2024): reference-free, length-normalised, with a target margin γ:

        x_i = β · log π(y_c)/|y_c| − β · log π(y_r)/|y_r| − γ
        ℓ_i = −(1 − ε) log σ(x_i) − ε log σ(−x_i)          (ε = label_smoothing, 0 by default)

    mean over the B pairs.  Rewards are β · (mean log-prob per token) of each response; margins
    (chosen − rejected) and accuracy do not include γ."""
    _check(beta, label_smoothing)
    chosen = beta * policy_chosen_logps.float() / _lengths(chosen_lengths)
    rejected = beta * policy_rejected_logps.float() / _lengths(rejected_lengths)
    per_pair = _smoothed_sigmoid_loss(chosen - rejected - gamma, label_smoothing)
    return per_pair.mean(), _pair_metrics(chosen, rejected)


_LOG_HALF = -math.log(2.0)


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 − eˣ) for x < 0: log1p(−eˣ) for x < −ln 2, log(−expm1(x)) closer to 0 (each branch
    is accurate on its side).  Each branch only sees inputs of its own side, so neither can
    produce inf/nan gradients."""
    far = x < _LOG_HALF
    a = torch.log1p(-torch.exp(torch.where(far, x, torch.full_like(x, -1.0))))
    b = torch.log(-torch.expm1(torch.where(far, torch.full_like(x, -0.5), x)))
    return torch.where(far, a, b)


def orpo_loss(policy_chosen_logps: Tensor, policy_rejected_logps: Tensor,
              chosen_lengths: Tensor, rejected_lengths: Tensor, *,
              lam: float = 0.1) -> tuple[Tensor, dict[str, Tensor]]:
    """ORPO (Hong et al. 2024): SFT on the chosen response plus an odds-ratio term, no reference.

        log p(y)    = log π(y) / |y|                        (mean log-prob per token, < 0)
        log odds(y) = log p − log(1 − p)                    (log(1 − p) = log1p(−exp(log p)))
        ℓ_i = −log p(y_c) + λ · (−log σ(log odds(y_c) − log odds(y_r)))

    mean over the B pairs: the NLL is the chosen response's token mean, then the pair mean.
    log p is clamped to ≤ −1e-7 so that p = 1 cannot give an infinite odds.  Metrics:
    ``log_odds_ratio`` [B], ``nll`` and ``or_loss`` (0-dim means), ``accuracy`` (log odds ratio
    > 0); the chosen/rejected rewards are the mean log-probs per token."""
    if lam < 0:
        raise ValueError(f"lam must be >= 0, got {lam}")
    lp_c = (policy_chosen_logps.float() / _lengths(chosen_lengths)).clamp(max=-1e-7)
    lp_r = (policy_rejected_logps.float() / _lengths(rejected_lengths)).clamp(max=-1e-7)
    log_odds = (lp_c - _log1mexp(lp_c)) - (lp_r - _log1mexp(lp_r))
    or_loss = -F.logsigmoid(log_odds)
    nll = -lp_c
    metrics = _pair_metrics(lp_c, lp_r)  # log odds grows with p: accuracy = (log odds ratio > 0)
    metrics.update(log_odds_ratio=log_odds.detach(), nll=nll.detach().mean(),
                   or_loss=or_loss.detach().mean())
    return (nll + lam * or_loss).mean(), metrics


def kto_reference_point(kl_log_ratios: Tensor, all_reduce: AllReduce = None) -> Tensor:
    """KTO's reference point z0 = max(0, mean_j kl_log_ratios_j), detached (0-dim).

    ``kl_log_ratios`` are log π(y_j|x_i) − log π_ref(y_j|x_i) (sequence log-probs) of mismatched
    pairs j ≠ i, built by the caller: an estimate of KL(π ‖ π_ref).  The mean is over every value
    of every rank when ``all_reduce`` (sum over data-parallel ranks) is given."""
    x = kl_log_ratios.detach().float().reshape(-1)
    return masked_mean(x, torch.ones_like(x), all_reduce).clamp(min=0.0)


def kto_loss(policy_logps: Tensor, ref_logps: Tensor, desirable: Tensor,
             z0: Union[Tensor, float], *, beta: float = 0.1, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> tuple[Tensor, dict[str, Tensor]]:
    """KTO (Ethayarajh et al. 2024) on unpaired rows, each labelled desirable or not:

        r_i = log π(y_i|x_i) − log π_ref(y_i|x_i)
        ℓ_i = λ_D (1 − σ(β (r_i − z0)))      desirable rows
        ℓ_i = λ_U (1 − σ(β (z0 − r_i)))      undesirable rows

    i.e. λ_y − v(x, y) of the paper.  The loss is the mean over ALL B rows of the call (both labels
    together, divided by B).  ``z0`` (``kto_reference_point``) is detached.  The paper advises
    λ_D·n_D / (λ_U·n_U) in [1, 4/3] (n = rows of each label).  Metrics: ``rewards`` β·r_i [B],
    ``z0``."""
    _check(beta, 0.0)
    if desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError("desirable_weight and undesirable_weight must be >= 0")
    r = policy_logps.float() - ref_logps.detach().float()
    z = torch.as_tensor(z0, dtype=r.dtype, device=r.device).detach()
    good = desirable.bool()
    per_row = torch.where(good, desirable_weight * (1.0 - torch.sigmoid(beta * (r - z))),
                          undesirable_weight * (1.0 - torch.sigmoid(beta * (z - r))))
    return per_row.mean(), {"rewards": beta * r.detach(), "z0": z}
