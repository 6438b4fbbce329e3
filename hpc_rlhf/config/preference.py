"""Configs of the preference trainers: `hpc-rlhf train rm|dpo|kto|simpo|orpo|prm|kd`.

Every trainer has the sections of `train sft` (model, train, ckpt, log, launch), a data section for
preference data (pairs, or labelled single completions for KTO) and an `objective` section with the
knobs of its loss only, so an option of another objective is an unknown key.  Each objective class
names the registered trainer unit that implements it (`unit`); `_trainer` makes each trainer's config
class from its objective, data section and help texts.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal

from .base import ConfigError, field, flatten_keys
from .sections import (CheckpointConfig, DataConfig, EngineOptions, LaunchConfig, LogConfig, ModelConfig,
                       RenderedSources, SourcesConfig, TrainConfig)
from .slurm import SlurmConfig


@dataclass
class PreferenceDataConfig(RenderedSources):
    """Mixing, evaluation split and rendering: what pairs and unpaired rows share."""
    prompt_key: str | None = field("prompt", help="column holding the prompt (a string, or a messages list "
                                                  "with apply_chat_template); null: no separate prompt column "
                                                  "(plain: empty prompt; chat: every message before the last "
                                                  "one is the prompt)")
    apply_chat_template: bool = field(False, help="render prompt and responses with the tokenizer's chat "
                                                  "template (responses: a string or a list of messages)")
    max_len: int = field(2048, ge=2, help="maximum tokens of one sequence (prompt + one response)")
    truncate_responses: bool = field(False, help="cut responses so that prompt + response fits max_len (the "
                                                 "prompt is kept whole) instead of treating longer rows as "
                                                 "bad rows")
    max_samples: int | None = field(None, ge=1, help="cap on training rows (pairs) after mixing")


@dataclass
class PairDataConfig(PreferenceDataConfig):
    """A prompt with a chosen and a rejected response per row."""
    chosen_key: str = field("chosen", help="column holding the preferred response (chat: a string or a "
                                           "messages list)")
    rejected_key: str = field("rejected", help="column holding the dispreferred response")


@dataclass
class UnpairedDataConfig(PreferenceDataConfig):
    """KTO: a prompt, one completion and a desirable/undesirable label per row."""
    completion_key: str = field("completion", help="column holding the completion (chat: a string or a "
                                                   "messages list)")
    label_key: str = field("label", help="column holding the label: true (desirable) or false "
                                         "(undesirable); also 1/0 and 'true'/'false'")


class ObjectiveSection:
    """What an objective section declares besides its options: the registered trainer unit that implements it
    (``unit``), and whether that unit replaces the model's LM head by a fresh one-output score head
    (``score_head``: no logits; LoRA and 4-bit not supported yet)."""
    unit: ClassVar[str]
    score_head: ClassVar[bool] = False


@dataclass
class RewardObjective(ObjectiveSection):
    unit: ClassVar[str] = "rm"
    score_head: ClassVar[bool] = True
    loss_type: Literal["sigmoid", "log_exp"] = field(
        "sigmoid", help="pairwise loss: sigmoid -log σ(r_c - r_r - m) or log_exp log(1 + exp(r_r - r_c + m)) "
                        "(equal in value)")
    margin_key: str | None = field(None, help="column holding a per-pair margin m the chosen score must "
                                              "exceed the rejected one by (null: no margin)")


@dataclass
class DPOObjective(ObjectiveSection):
    unit: ClassVar[str] = "dpo"
    beta: float = field(0.1, gt=0, help="strength of the implicit KL to the reference model")
    loss_type: Literal["sigmoid", "ipo"] = field("sigmoid", help="sigmoid: DPO (cDPO with label_smoothing); "
                                                                 "ipo: IPO's squared loss")
    label_smoothing: float = field(0.0, ge=0, le=0.5, help="cDPO: assumed fraction of flipped labels, in [0, 0.5] "
                                                           "(sigmoid only)")
    nll_coef: float = field(0.0, ge=0, help="weight of the chosen response's per-token NLL added to each pair's loss")
    ref_pretrain: str | None = field(None, path="model", help="reference model (default: the model's pretrain)")
    ref_precompute: bool = field(False, help="compute the reference log-probs of every pair once before "
                                             "training and free the reference model (saves its memory "
                                             "during training)")

    def validate(self) -> None:
        if self.loss_type == "ipo" and self.label_smoothing > 0:
            raise ConfigError("objective.label_smoothing is defined for loss_type sigmoid (cDPO), not ipo")


@dataclass
class KTOObjective(ObjectiveSection):
    unit: ClassVar[str] = "kto"
    beta: float = field(0.1, gt=0, help="strength of the implicit KL to the reference model")
    desirable_weight: float = field(1.0, ge=0, help="λ_D, weight of desirable rows (the paper advises "
                                                    "λ_D·n_D / (λ_U·n_U) in [1, 4/3])")
    undesirable_weight: float = field(1.0, ge=0, help="λ_U, weight of undesirable rows")
    ref_pretrain: str | None = field(None, path="model", help="reference model (default: the model's pretrain)")


@dataclass
class SimPOObjective(ObjectiveSection):
    unit: ClassVar[str] = "simpo"
    beta: float = field(2.0, gt=0, help="scale of the length-normalised log-prob rewards")
    gamma: float = field(1.0, ge=0, help="target reward margin γ between chosen and rejected")
    label_smoothing: float = field(0.0, ge=0, le=0.5, help="assumed fraction of flipped labels, in [0, 0.5]")


@dataclass
class ORPOObjective(ObjectiveSection):
    unit: ClassVar[str] = "orpo"
    orpo_lambda: float = field(0.1, ge=0, help="λ, weight of the odds-ratio term added to the chosen response's NLL")


@dataclass(kw_only=True)
class TrainerSections:
    """The sections every preference-family trainer shares (``_trainer`` adds model, data and objective)."""
    train: TrainConfig = field(default_factory=TrainConfig, help="optimisation; train_batch_size and "
                               "micro_train_batch_size count pairs (rm, dpo, simpo, orpo), rows (kto, prm) "
                               "or samples (kd)")
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig, help="saving and resuming")
    log: LogConfig = field(default_factory=LogConfig, help="metrics and evaluation")
    launch: LaunchConfig = field(default_factory=LaunchConfig, help="processes and backend")
    slurm: SlurmConfig = field(default_factory=SlurmConfig, help="SLURM job: resources, preemption, requeue")

    def validate(self) -> None:
        if self.objective.score_head and (self.model.lora_rank > 0 or self.model.load_in_4bit):
            raise ConfigError(f"train {self.objective.unit} trains every weight: LoRA / 4-bit (model.lora_rank, "
                              f"model.load_in_4bit) are not supported for reward models yet")


# ---------------------------------------------------------------------------------------------------
# process reward model (prm) and knowledge distillation (kd)


@dataclass
class ProcessDataConfig(SourcesConfig):
    """PRM rows: a text with a step placeholder after each reasoning step and one label per step."""
    # the shared loop reads the tokenizer override from the data section; PRM data has no chat rendering
    tokenizer_chat_template: ClassVar[None] = None
    input_key: str = field("input", help="column holding the text: the question and its reasoning steps, "
                                         "each step followed by the placeholder")
    label_key: str = field("labels", help="column holding the list of step labels, one per placeholder "
                                          "(hard: '+'/'-', true/false or 1/0; soft_labels: numbers in [0, 1])")
    placeholder: str = field("ки", help="the step placeholder string in the text; it must tokenize to exactly "
                                        "one token (add it to the tokenizer as a token if it does not)")
    soft_labels: bool = field(False, help="labels are probabilities in [0, 1] that the step is correct (soft "
                                          "cross-entropy) instead of hard correct/incorrect labels")
    max_len: int = field(2048, ge=2, help="maximum tokens of one row; a longer row is a bad row")
    max_samples: int | None = field(None, ge=1, help="cap on training rows after mixing")
    bad_rows: Literal["skip", "error"] = field("skip", help="what to do with a bad row (missing key, no "
                                                            "placeholder, label count not the placeholder "
                                                            "count, unknown label, longer than max_len): skip "
                                                            "it and report the counts, or stop with an error")

    def validate(self) -> None:
        super().validate()
        if not self.placeholder:
            raise ConfigError("data.placeholder is empty: name the string that marks the end of each step")


@dataclass
class ProcessRewardObjective(ObjectiveSection):
    unit: ClassVar[str] = "prm"
    positive_token: str = field("+", help="the token the PRM answers for a correct step (one token)")
    negative_token: str = field("-", help="the token the PRM answers for an incorrect step (one token)")

    def validate(self) -> None:
        if not self.positive_token or not self.negative_token:
            raise ConfigError("objective.positive_token and objective.negative_token must not be empty")
        if self.positive_token == self.negative_token:
            raise ConfigError("objective.positive_token and objective.negative_token must differ")


@dataclass
class DistillObjective(ObjectiveSection):
    unit: ClassVar[str] = "kd"
    teacher_pretrain: str | None = field(None, path="model", help="the teacher: HF model folder or hub name (same "
                                                                  "vocabulary as the student); frozen, on the same "
                                                                  "ranks (required)")
    kd_coef: float = field(0.5, ge=0, le=1, help="α in (1 − α)·CE + α·D per token, D the divergence beta chooses "
                                                 "(KL(teacher ‖ student) by default): 0 is plain SFT, 1 pure "
                                                 "distillation")
    temperature: float = field(1.0, gt=0, help="τ: both distributions are softmax(logits / τ) in the divergence, which "
                                               "is multiplied by τ² (the CE stays at τ = 1)")
    beta: float = field(0.0, ge=0, le=1, help="β of the divergence JSD_β(teacher ‖ student) (GKD): 0 the forward KL"
                                              "(teacher ‖ student), 1 the reverse KL(student ‖ teacher), in between "
                                              "the generalized Jensen-Shannon divergence to the mixture β·teacher + "
                                              "(1 − β)·student")
    lmbda: float = field(0.0, ge=0, le=1, help="λ, the fraction of steps trained on responses the student generates "
                                               "(the rollout section's engine) to the data's prompts instead of the "
                                               "data's responses; each step is one or the other, drawn from "
                                               "(train.seed, step); those steps have no CE term")

    def validate(self) -> None:
        if not self.teacher_pretrain:
            raise ConfigError("objective.teacher_pretrain is not set: name the teacher model")
        if self.lmbda > 0 and self.kd_coef == 0:
            raise ConfigError("objective.lmbda > 0 trains on the student's own responses, whose loss is kd_coef × the "
                              "divergence (no CE): set objective.kd_coef > 0")


@dataclass
class DistillRolloutConfig(EngineOptions):
    """How the student generates its responses when objective.lmbda > 0: sampled from its own distribution
    (temperature 1, no top-k or top-p), up to a stop token of the tokenizer or the model's generation config."""
    generate_max_len: int = field(256, ge=1, help="new tokens per response at most (cut further to data.max_len)")
    max_batch_size: int = field(64, ge=1, help="sequences per generation batch on one rank")


@dataclass
class DistillDataConfig(DataConfig):
    def validate(self) -> None:
        super().validate()
        if self.packing_samples or self.micro_batch_tokens is not None:
            raise ConfigError("train kd uses padded micro-batches of micro_train_batch_size samples: "
                              "data.packing_samples and data.micro_batch_tokens are not supported")


@dataclass(kw_only=True)
class DistillSections(TrainerSections):
    """train kd: the shared sections, and the checks across its objective and data."""

    def validate(self) -> None:
        super().validate()
        if self.objective.lmbda > 0 and self.data.pretrain_mode:
            raise ConfigError("objective.lmbda > 0 needs prompts for the student to answer: data.pretrain_mode has "
                              "none (loss on every token)")
        if self.objective.lmbda == 0:
            default = flatten_keys(dataclasses.asdict(DistillRolloutConfig()))
            for key, value in flatten_keys(dataclasses.asdict(self.rollout)).items():
                if value != default[key]:
                    raise ConfigError(f"rollout.{key} is set but objective.lmbda is 0: the rollout section applies "
                                      f"to the steps on the student's own responses (objective.lmbda > 0)")


def _trainer(name: str, objective: type[ObjectiveSection], data: type, data_help: str, objective_help: str,
             model_help: str = "the model and its adapters", base: type = TrainerSections,
             extra: tuple = ()) -> type:
    """The config class of `hpc-rlhf train UNIT`: the shared sections (``base``), the model, the data, the objective
    and the ``extra`` sections (name, type, help)."""
    return dataclasses.make_dataclass(
        name, [("model", ModelConfig, field(help=model_help)), ("data", data, field(help=data_help)),
               ("objective", objective, field(default_factory=objective, help=objective_help)),
               *((n, t, field(default_factory=t, help=h)) for n, t, h in extra)],
        bases=(base,), kw_only=True,
        namespace={"__module__": __name__, "__doc__": f"Config of `hpc-rlhf train {objective.unit}`."})


PAIRS = "preference pairs"
RMConfig = _trainer("RMConfig", RewardObjective, PairDataConfig, PAIRS, "reward-model loss",
                    model_help="the causal-LM folder the reward model starts from (its LM head is replaced by a fresh "
                               "one-output score head)")
DPOConfig = _trainer("DPOConfig", DPOObjective, PairDataConfig, PAIRS, "DPO / IPO / cDPO loss and the reference")
KTOConfig = _trainer("KTOConfig", KTOObjective, UnpairedDataConfig,
                     "prompts with one completion labelled desirable or not", "KTO loss and the reference")
SimPOConfig = _trainer("SimPOConfig", SimPOObjective, PairDataConfig, PAIRS, "SimPO loss (no reference model)")
ORPOConfig = _trainer("ORPOConfig", ORPOObjective, PairDataConfig, PAIRS, "ORPO loss (no reference model)")
PRMConfig = _trainer("PRMConfig", ProcessRewardObjective, ProcessDataConfig,
                     "texts with step placeholders and step labels", "the reward tokens of the PRM loss",
                     model_help="the causal LM trained as the PRM (it answers the reward tokens at each placeholder)")
KDConfig = _trainer("KDConfig", DistillObjective, DistillDataConfig,
                    "SFT data (prompt/response or chat); the loss covers the response tokens",
                    "the teacher and the KD loss", model_help="the student and its adapters", base=DistillSections,
                    extra=(("rollout", DistillRolloutConfig, "the student's generation engine and sampling "
                                                             "(objective.lmbda > 0)"),))
