"""Knowledge distillation: token cross-entropy mixed with the forward KL to a teacher."""
from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def distill_loss(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, mask: Tensor, *,
                 kd_coef: float = 0.5, temperature: float = 1.0,
                 reduction: str = "mean") -> tuple[Tensor, dict[str, Tensor]]:
    """Per valid token t (``student_logits``, ``teacher_logits`` [B, T, V] at the same positions;
    ``labels`` [B, T]: the token predicted AT position t, already shifted; ``mask`` [B, T]):

        CE_t = −log softmax(z_s)[label_t]                               (temperature 1)
        KL_t = τ² Σ_v p_t,v (log p_t,v − log p_s,v),   p = softmax(z/τ)  (KL(teacher ‖ student))
        ℓ_t  = (1 − α) · CE_t + α · KL_t                                 (α = kd_coef)

    α = 0 is plain SFT, α = 1 pure distillation.  The τ² factor (Hinton et al. 2015) keeps the
    gradient scale of the KL independent of τ; with τ = 1 it is the plain KL.  Vocabulary entries
    the teacher gives probability 0 (logit −inf) contribute 0.  The teacher is detached.

    reduction "mean": Σ_t ℓ_t / N, the mean over the N valid tokens of the call;  "none": ℓ as
    [B, T], 0 on padding (to use with ``aggregate``).  Positions with mask 0 are never read.
    Metrics (detached means over the valid tokens): ``ce``, ``kl`` (including τ²), ``tokens``."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student and teacher logits differ in shape: "
                         f"{tuple(student_logits.shape)} vs {tuple(teacher_logits.shape)}")
    if not 0.0 <= kd_coef <= 1.0:
        raise ValueError(f"kd_coef must be in [0, 1], got {kd_coef}")
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
    p_t = logp_t.exp()
    terms = torch.where(p_t > 0, p_t * (logp_t - logp_s_tau), torch.zeros_like(p_t))
    kl = terms.sum(-1) * (tau * tau)
    tok = (1.0 - kd_coef) * ce + kd_coef * kl
    n = tok.shape[0]
    metrics = {"ce": ce.detach().sum() / max(n, 1), "kl": kl.detach().sum() / max(n, 1),
               "tokens": torch.tensor(float(n))}
    if reduction == "none":
        out = torch.zeros(mask.shape, dtype=tok.dtype, device=tok.device)
        out[valid] = tok
        return out, metrics
    return tok.sum() / max(n, 1), metrics
