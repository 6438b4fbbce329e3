"""Per-token KL estimators, the KL reward penalty and the KL coefficient controllers.

The estimators use samples y ~ π (the current/behaviour policy) and
``log_ratio = log π(y_t) − log π_ref(y_t)``; each is an estimator of KL(π ‖ π_ref):

* ``k1``: log_ratio                          (unbiased, can be negative)
* ``k2``: ½ · log_ratio²                    (biased, ≥ 0, its gradient is that of the true KL's
                                              first-order expansion)
* ``k3``: exp(−log_ratio) − 1 + log_ratio   (unbiased, ≥ 0; Schulman's "approximating KL")
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .registry import KL_ESTIMATORS


@KL_ESTIMATORS.register("k1")
def kl_k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


@KL_ESTIMATORS.register("k2")
def kl_k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


@KL_ESTIMATORS.register("k3")
def kl_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.expm1(-log_ratio) + log_ratio


def compute_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "k1",
               mask: Optional[torch.Tensor] = None, clamp: Optional[float] = None) -> torch.Tensor:
    """Per-token KL estimate [B, R] of KL(π ‖ π_ref) with the named estimator (k1, k2, k3).

    ``mask`` (1 on valid tokens) zeroes padded positions; the log ratio is masked *before* the
    estimator so garbage log-probs past the end cannot produce inf/nan.  ``clamp`` optionally
    limits |log_ratio| (changes the value only for ratios beyond e^±clamp).
    """
    fn: Callable[[torch.Tensor], torch.Tensor] = KL_ESTIMATORS.get(estimator)
    log_ratio = log_probs.float() - ref_log_probs.float()
    if mask is not None:
        log_ratio = torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio))
    if clamp is not None:
        log_ratio = log_ratio.clamp(-clamp, clamp)
    kl = fn(log_ratio)
    if mask is not None:
        kl = torch.where(mask.bool(), kl, torch.zeros_like(kl))
    return kl


def kl_penalty_rewards(kl: torch.Tensor, coef: float,
                       mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Token rewards −coef · kl_t [B, R] (the KL-in-reward penalty; 0 where ``mask`` is 0)."""
    out = -float(coef) * kl.float()
    return out if mask is None else torch.where(mask.bool(), out, torch.zeros_like(out))


class FixedKLController:
    """A constant KL coefficient: ``coef`` never changes."""

    def __init__(self, coef: float) -> None:
        self.coef = float(coef)

    @property
    def value(self) -> float:
        return self.coef

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.coef

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = float(state["coef"])


class AdaptiveKLController:
    """Proportional controller of Ziegler et al. 2019 ("Fine-Tuning LMs from Human Preferences").

    After a batch whose measured KL is ``current_kl`` and which consumed ``n_steps`` samples (or
    steps; use the same unit as ``horizon``):

        e    = clip(current_kl / target − 1, −0.2, 0.2)
        coef ← coef · (1 + e · n_steps / horizon)
    """

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        if target <= 0:
            raise ValueError(f"kl_target must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"kl_horizon must be > 0, got {horizon}")
        self.coef = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    @property
    def value(self) -> float:
        return self.coef

    def update(self, current_kl: float, n_steps: int) -> float:
        e = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + e * float(n_steps) / self.horizon
        return self.coef

    def state_dict(self) -> dict:
        return {"coef": self.coef, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.coef = float(state["coef"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))


def make_kl_controller(init_kl_coef: float, kl_target: Optional[float] = None,
                       kl_horizon: float = 10000.0):
    """``AdaptiveKLController`` when ``kl_target`` is set, else ``FixedKLController``."""
    if kl_target is None:
        return FixedKLController(init_kl_coef)
    return AdaptiveKLController(init_kl_coef, kl_target, kl_horizon)
