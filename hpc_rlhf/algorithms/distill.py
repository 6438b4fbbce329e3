"""Knowledge distillation: token cross-entropy mixed with a divergence to a teacher (forward KL, reverse KL, or the
generalized Jensen-Shannon divergence between them)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def _kl(logp: Tensor, logq: Tensor) -> Tensor:
    """Σ_v p_v (log p_v − log q_v) over the last dimension; entries with p_v = 0 contribute 0."""
    p = logp.exp()
    return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)


def distill_loss(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, mask: Tensor, *,
                 kd_coef: float = 0.5, temperature: float = 1.0, beta: float = 0.0, supervised: bool = True,
                 reduction: str = "mean") -> tuple[Tensor, dict[str, Tensor]]:
    """Per valid token t (``student_logits``, ``teacher_logits`` [B, T, V] at the same positions;
    ``labels`` [B, T]: the token predicted AT position t, already shifted; ``mask`` [B, T]):

        CE_t = −log softmax(z_s)[label_t]                          (temperature 1)
        p = softmax(z_teacher / τ),  q = softmax(z_student / τ),  m = β·p + (1 − β)·q
        D_t  = τ² · KL(p ‖ q)                                      β = 0 (forward KL)
        D_t  = τ² · KL(q ‖ p)                                      β = 1 (reverse KL)
        D_t  = τ² · (β·KL(p ‖ m) + (1 − β)·KL(q ‖ m))              0 < β < 1 (generalized JSD)
        ℓ_t  = (1 − α) · CE_t + α · D_t                            (α = kd_coef)

    α = 0 is plain SFT, α = 1 pure distillation.  JSD_β is Agarwal et al. 2024 (GKD), eq. 1, with the
    end points taken as TRL's GKDTrainer takes them (JSD_β/β → forward KL as β → 0, JSD_β/(1 − β) → reverse
    KL as β → 1).  The τ² factor (Hinton et al. 2015) keeps the gradient scale of D independent of τ; with
    τ = 1 it is the plain divergence.  A KL term Σ_v a_v (log a_v − log b_v) skips entries with a_v = 0 (a
    logit −inf).  The teacher is detached.  ``supervised=False``: the labels are the student's own samples
    (on-policy distillation), with no reference response to fit: ℓ_t = α · D_t and no ``ce`` metric.

    reduction "mean": Σ_t ℓ_t / N, the mean over the N valid tokens of the call;  "none": ℓ as
    [B, T], 0 on padding (to use with ``aggregate``).  Positions with mask 0 are never read.
    Metrics (detached means over the valid tokens): ``ce``, ``kl`` (D_t, including τ²), ``tokens``."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student and teacher logits differ in shape: "
                         f"{tuple(student_logits.shape)} vs {tuple(teacher_logits.shape)}")
    if not 0.0 <= kd_coef <= 1.0:
        raise ValueError(f"kd_coef must be in [0, 1], got {kd_coef}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    valid = mask.bool()
    zs = student_logits[valid].float()                  # [N, V]
    zt = teacher_logits.detach()[valid].float()
    y = labels[valid].long()
    logp_s = F.log_softmax(zs, dim=-1)
    ce = -logp_s.gather(-1, y[:, None]).squeeze(-1)
    tau = float(temperature)
    logp_s_tau = logp_s if tau == 1.0 else F.log_softmax(zs / tau, dim=-1)
    logp_t = F.log_softmax(zt / tau, dim=-1)
    if beta == 0.0:
        div = _kl(logp_t, logp_s_tau)
    elif beta == 1.0:
        div = _kl(logp_s_tau, logp_t)
    else:
        log_m = torch.logsumexp(torch.stack([logp_t + math.log(beta), logp_s_tau + math.log1p(-beta)]), dim=0)
        div = beta * _kl(logp_t, log_m) + (1.0 - beta) * _kl(logp_s_tau, log_m)
    kl = div * (tau * tau)
    tok = (1.0 - kd_coef) * ce + kd_coef * kl if supervised else kd_coef * kl
    n = tok.shape[0]
    metrics = {"kl": kl.detach().sum() / max(n, 1), "tokens": torch.tensor(float(n))}
    if supervised:
        metrics["ce"] = ce.detach().sum() / max(n, 1)
    if reduction == "none":
        out = torch.zeros(mask.shape, dtype=tok.dtype, device=tok.device)
        out[valid] = tok
        return out, metrics
    return tok.sum() / max(n, 1), metrics
