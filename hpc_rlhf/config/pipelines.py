"""Configs of the data pipelines: `hpc-rlhf generate`, `hpc-rlhf score` and `hpc-rlhf iterative-dpo`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .base import ConfigError, field
from .sections import EngineOptions, LaunchConfig, check_template


@dataclass
class GenModelConfig(EngineOptions):
    pretrain: str = field(path="tokenizer", help="HF causal-LM folder (or hub name) that generates the responses")
    param_dtype: Literal["fp32", "bf16", "fp16"] = field("fp32", help="dtype the model runs in (bf16 on GPUs)")
    max_batch_size: int = field(64, ge=1, help="sequences per generation batch on one rank")


@dataclass
class GenDataConfig:
    prompt_data: list[str] = field(path="data", help="prompt sources (json/jsonl/parquet/csv/arrow files, save_to_disk "
                                                     "folders, hub names); their prompts are numbered in order, "
                                                     "source after source, bad rows left out")
    prompt_split: str = field("train", help="split read from sources that have several")
    input_key: str = field("input", help="column holding the prompt (a messages list with apply_chat_template)")
    label_key: str | None = field("label", help="column copied to every output row as `label` when a source "
                                                "has it (null: none)")
    input_template: str | None = field(None, help="format string with one {} for the prompt")
    apply_chat_template: bool = field(False, help="render prompts with the tokenizer's chat template and a "
                                                  "generation prompt")
    tokenizer_chat_template: str | None = field(None, help="override the tokenizer's chat template (Jinja)")
    prompt_prefix: str | None = field(None, help="text put before every rendered prompt (after the template), "
                                                 "e.g. '<rm_score>: 5.0 ' for conditional SFT")
    prompt_max_len: int = field(1024, ge=1, help="prompts longer than this (tokens, prefix included) are bad rows")
    max_samples: int | None = field(None, ge=1, help="use only the first N prompts")
    bad_rows: Literal["skip", "error"] = field("skip", help="skip (and report) or stop on a bad row")

    def validate(self) -> None:
        if not self.prompt_data:
            raise ConfigError("data.prompt_data is empty: name at least one prompt source")
        check_template(self)


@dataclass
class GenSamplingConfig:
    n_samples_per_prompt: int = field(1, ge=1, help="responses per prompt")
    temperature: float = field(1.0, ge=0, help="sampling temperature (0: greedy)")
    top_p: float = field(1.0, gt=0, le=1, help="nucleus sampling mass")
    top_k: int = field(0, ge=0, help="sample from the k most likely tokens (0: all)")
    max_new_tokens: int = field(256, ge=1, help="new tokens per response at most")
    seed: int = field(42, ge=0, le=2**32 - 1, help="sample j of prompt i is drawn with a seed made from (seed, i, j): "
                                                   "the output does not depend on the number of ranks")


@dataclass
class OutputConfig:
    output_path: str = field(help="jsonl file written by rank 0 (ranks write part files next to it first)")


@dataclass
class GenerateConfig:
    model: GenModelConfig = field(help="the generating model")
    data: GenDataConfig = field(help="prompts")
    output: OutputConfig = field(help="where the rows go")
    sampling: GenSamplingConfig = field(default_factory=GenSamplingConfig, help="how responses are sampled")
    launch: LaunchConfig = field(default_factory=LaunchConfig, help="processes and backend")


@dataclass
class RewardModelConfig:
    reward_pretrain: str = field(path="tokenizer", help="reward model folder (AutoModelForSequenceClassification, "
                                                        "one output) and its tokenizer")
    reward_dtype: Literal["fp32", "bf16", "fp16"] = field("bf16", help="dtype the reward model runs in")
    reward_batch_size: int = field(16, ge=1, help="sequences per reward-model forward")
    normalize_reward: bool = field(True, help="apply (r - reward_mean) / reward_std when the model config "
                                              "holds them")
    append_eos: bool = field(True, help="score prompt + response + EOS, the way `train rm` sees responses")


@dataclass
class ScoreDataConfig:
    input_path: str = field(path="file", help="jsonl file of rows to score (e.g. the output of `hpc-rlhf generate`)")
    output_path: str = field(help="jsonl file written by rank 0: the input rows, in order, with the reward")
    prompt_key: str = field("prompt", help="column holding the prompt text")
    response_key: str = field("response", help="column holding the response text")
    reward_key: str = field("reward", help="column the score is written to")


@dataclass
class ScoreConfig:
    reward: RewardModelConfig = field(help="the reward model")
    data: ScoreDataConfig = field(help="rows in and out")
    launch: LaunchConfig = field(default_factory=LaunchConfig, help="processes and backend")


@dataclass
class IterationConfig:
    rounds: int = field(2, ge=1, help="rounds of generate -> score -> pairs -> train dpo")
    output_dir: str = field("./iterative_dpo", help="round_<k>/ folders with every round's data, configs "
                                                    "and model")
    min_margin: float = field(0.0, ge=0, help="keep a prompt's best/worst pair only when the reward gap exceeds this")
    dpo_config: str | None = field(None, path="file", help="YAML config of `train dpo` (objective, train, ...); "
                                                           "model.pretrain, data.dataset and ckpt paths are set by "
                                                           "each round")
    dpo_overrides: list[str] = field(default_factory=list, help="key=value overrides for every round's "
                                                                "`train dpo` (comma-separated)")
    stage_nproc: int = field(1, ge=1, help="local ranks of each stage (generate, score, train dpo)")


@dataclass
class IterativeDPOConfig:
    model: GenModelConfig = field(help="the starting policy (round k starts from round k-1's model)")
    data: GenDataConfig = field(help="prompts, used in every round")
    reward: RewardModelConfig = field(help="the reward model that ranks the responses")
    sampling: GenSamplingConfig = field(default_factory=GenSamplingConfig,
                                        help="sampling (round k uses seed + k); n_samples_per_prompt >= 2")
    iterative: IterationConfig = field(default_factory=IterationConfig, help="rounds and the DPO stage")

    def validate(self) -> None:
        if self.sampling.n_samples_per_prompt < 2:
            raise ConfigError("iterative-dpo needs sampling.n_samples_per_prompt >= 2 (a best and a worst "
                              "response per prompt)")
