"""The ``algo`` section of `train rl`: the registered units of the algorithm and their options.

The options that name units (``advantage_estimator``, ``policy_loss``, ``is_correction``, ``loss_agg_mode``,
``kl.kl_estimator``) are checked against the declarations in ``algorithms/registry.py``, which also say which
options each unit reads.  The options sit in sections: one per unit for the knobs only it reads (``gae``), one
per family for the knobs several units read (``advantage``, ``clip``, ``critic``, ``is_bounds``), and ``kl``,
which every algorithm reads.  An option set to anything but its default while the selected unit does not read
it is an error naming the units that do.  A unit with knobs of its own adds its section here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..algorithms.registry import (ADVANTAGE_ESTIMATORS, IS_CORRECTIONS, KL_ESTIMATORS, LOSS_AGGREGATIONS,
                                   POLICY_LOSSES, TOKEN_MASKS)
from .base import ConfigError, field


@dataclass
class AdvantageOptions:
    """What several advantage estimators read."""
    gamma: float = field(1.0, ge=0, le=1, help="discount of the token returns (gae and the reinforce family)")
    whiten_advantages: bool | None = field(None, help="whiten the advantages over every valid token of every rank "
                                                      "(estimators that whiten: gae, reinforce and its variants); "
                                                      "null: the estimator's default")
    advantage_eps: float | None = field(None, gt=0, help="eps of the advantage whitening, sqrt(var + eps), of "
                                                         "group_norm's and gdpo's std + eps, or of maxrl's mean + eps; "
                                                         "null: the estimator's default")


@dataclass
class GAEOptions:
    lambd: float = field(0.95, ge=0, le=1, help="GAE lambda")


@dataclass
class CriticOptions:
    """The critic, which the estimators that need one train."""
    value_clip: float | None = field(0.5, gt=0, help="value clip range (null: unclipped)")


@dataclass
class ClipOptions:
    """The ratio clip of the clipped policy losses."""
    eps_clip: float = field(0.2, ge=0, help="ratio clip (low side, and high side unless eps_clip_high is set)")
    eps_clip_high: float | None = field(None, ge=0, help="ratio clip on the high side (clip-higher)")
    dual_clip: float | None = field(None, gt=1, help="dual-clip constant c > 1 for negative advantages (ppo, gspo)")


@dataclass
class OPDOptions:
    """On-policy distillation: the teacher's per-token reverse KL as the advantage (docs/algorithms.md)."""
    teacher_kl_coef: float = field(1.0, gt=0, help="c in A_t = −c·(log π_student(y_t) − log π_teacher(y_t)) + w·(R − "
                                                   "mean_group(R)): the weight of the teacher's term")
    task_reward_weight: float = field(0.0, ge=0, help="w: the weight of the task reward centred on its group (0: "
                                                      "pure distillation; > 0 needs n_samples_per_prompt >= 2)")


@dataclass
class KLOptions:
    """The KL to the reference model: its coefficient, estimator, place and controller."""
    init_kl_coef: float = field(0.0, ge=0, help="KL coefficient (0: no reference model)")
    kl_estimator: str = field("k1", registry=KL_ESTIMATORS, help="KL estimator (k3 is usual in the loss)")
    use_kl_loss: bool | None = field(None, help="KL in the loss (true) or in the reward (false); default: "
                                                "the estimator's choice")
    kl_target: float | None = field(None, gt=0, help="adaptive KL controller target (null: fixed coefficient)")
    kl_horizon: int = field(10000, ge=1, help="adaptive KL controller horizon")


@dataclass
class ISBoundsOptions:
    """The bounds of the importance-sampling ratio of the IS corrections."""
    is_low: float = field(0.5, ge=0, help="lower bound of the IS ratio (icepop, seq_mask_tis; unused by tis)")
    is_high: float = field(2.0, gt=0, help="upper bound of the IS ratio: truncation level (tis, seq_mask_tis) and "
                                           "drop threshold (icepop, seq_mask_tis)")


@dataclass
class SAPOOptions:
    """The temperatures of SAPO's soft gate σ(τ(ρ − 1))·4/τ."""
    tau_pos: float = field(1.0, gt=0, help="gate temperature for tokens with a positive advantage")
    tau_neg: float = field(1.05, gt=0, help="gate temperature for tokens with a zero or negative advantage")


@dataclass
class DPPOTVOptions:
    """DPPO-Binary-TV's trust region on the sampled token's probability change π − μ."""
    delta_low: float = field(0.2, ge=0, le=1, help="a token with A < 0 whose probability fell by more than this "
                                                   "gets no gradient")
    delta_high: float = field(0.2, ge=0, le=1, help="a token with A > 0 whose probability rose by more than this "
                                                    "gets no gradient")


@dataclass
class DPPOKLOptions:
    """DPPO-Binary-KL's trust region on KL(Bern(μ) ‖ Bern(π)) of the sampled token's probability."""
    delta_low: float = field(0.05, ge=0, help="a token with A < 0 whose probability fell with a binary KL above "
                                              "this gets no gradient")
    delta_high: float = field(0.05, ge=0, help="a token with A > 0 whose probability rose with a binary KL above "
                                               "this gets no gradient")


@dataclass
class M2POOptions:
    m2_threshold: float = field(0.04, gt=0, help="M2PO keeps the tokens of smallest squared log-ratio (old "
                                                 "policy to rollout engine) whose mean over the step's batch "
                                                 "stays below this")


def _is_set(section, option: str) -> bool:
    f = next(f for f in dataclasses.fields(section) if f.name == option)
    default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    return getattr(section, option) != default


@dataclass
class AlgoConfig:
    advantage_estimator: str = field("group_norm", registry=ADVANTAGE_ESTIMATORS,
                                     help="advantage estimator (docs/algorithms.md)")
    policy_loss: str = field("ppo", registry=POLICY_LOSSES, help="policy loss (docs/algorithms.md)")
    loss_agg_mode: str | None = field(None, registry=LOSS_AGGREGATIONS, help="how token losses make the step's "
                                                                             "loss (null: the estimator's choice)")
    is_correction: str = field(
        "none", choices=("none",), registry=IS_CORRECTIONS,
        help="importance-sampling correction of the policy loss for the rollout engine's log-probs "
             "differing from the trainer's: tis (truncate token ratios at is_high), icepop (drop tokens "
             "whose ratio is outside [is_low, is_high]), seq_mask_tis (drop sequences whose "
             "geometric-mean ratio is outside, truncate the rest); needs rollout.temperature 1 (or 0) "
             "(docs/algorithms.md)")
    token_mask: str = field(
        "none", choices=("none",), registry=TOKEN_MASKS,
        help="drop tokens from the policy gradient once per step, before its updates: m2po (the tokens with the "
             "largest squared log-ratio of the old policy to the rollout engine, until the mean over the step's "
             "batch on every actor rank is under m2po.m2_threshold; for stale samples, train.async_train); "
             "needs rollout.temperature 1 (or 0) and an old-policy pass (docs/algorithms.md)")
    entropy_loss_coef: float = field(0.0, ge=0, help="entropy bonus coefficient")
    log_entropy: bool = field(False, help="log the policy's entropy on the training samples (actor/entropy) without "
                                          "an entropy bonus too (one more pass over the vocabulary per token)")
    advantage: AdvantageOptions = field(default_factory=AdvantageOptions, help="what several estimators read")
    gae: GAEOptions = field(default_factory=GAEOptions, help="advantage_estimator gae")
    critic: CriticOptions = field(default_factory=CriticOptions, help="the critic (estimators that need one)")
    clip: ClipOptions = field(default_factory=ClipOptions, help="the clipped policy losses")
    kl: KLOptions = field(default_factory=KLOptions, help="the KL to the reference model")
    is_bounds: ISBoundsOptions = field(default_factory=ISBoundsOptions, help="the IS corrections")
    sapo: SAPOOptions = field(default_factory=SAPOOptions, help="policy_loss sapo")
    dppo_tv: DPPOTVOptions = field(default_factory=DPPOTVOptions, help="policy_loss dppo_tv")
    dppo_kl: DPPOKLOptions = field(default_factory=DPPOKLOptions, help="policy_loss dppo_kl")
    m2po: M2POOptions = field(default_factory=M2POOptions, help="token_mask m2po")
    opd: OPDOptions = field(default_factory=OPDOptions, help="advantage_estimator opd")

    def needs_teacher(self) -> bool:
        """The advantage estimator scores the samples against a teacher (it reads the ``opd`` section): the
        reference role runs model.teacher_pretrain."""
        return "opd" in ADVANTAGE_ESTIMATORS.declared.get(self.advantage_estimator, ())

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            registry = f.metadata.get("registry")
            if registry is None:
                continue
            unit = getattr(self, f.name)
            reads = {name: registry.read_paths(name, self) for name in registry.names()}
            for path in dict.fromkeys(p for paths in reads.values() for p in paths):
                section, option = path.split(".")
                if path not in reads.get(unit, ()) and _is_set(getattr(self, section), option):
                    readers = ", ".join(name for name, paths in reads.items() if path in paths)
                    raise ConfigError(f"algo.{path} is set but algo.{f.name} is {unit!r}: it applies to "
                                      f"{f.name} {readers}")
        if self.needs_teacher() and self.kl.init_kl_coef > 0:
            raise ConfigError(f"algo.kl.init_kl_coef={self.kl.init_kl_coef} with advantage_estimator "
                              f"{self.advantage_estimator!r}: its reference role runs the teacher, whose KL is the "
                              f"advantage already (algo.opd.teacher_kl_coef weighs it); set init_kl_coef to 0")
        b = self.is_bounds
        if b.is_low >= b.is_high:
            raise ConfigError(f"algo.is_bounds.is_low and is_high need 0 <= is_low < is_high, got is_low={b.is_low}, "
                              f"is_high={b.is_high}")
