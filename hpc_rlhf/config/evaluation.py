"""Config of `hpc-rlhf eval`: a model, eval prompts and a reward or verifier -> pass@k and the rest.

The command is the RL run's eval with only the rollout and reward roles (``as_rl_config``), so its numbers are
those `train rl` logs for the same model, data, sampling settings and seed (docs/eval.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from .base import ConfigError, field
from .rl import (AgentConfig, EvalConfig, EvalSamplingConfig, PlacementConfig, PromptDataConfig, PromptFormat,
                 RewardConfig, RLConfig, RLModelConfig, RLTrainConfig, RolloutConfig, require_reward_source)
from .sections import CheckpointConfig, LaunchConfig, LogConfig, ModelConfig
from .slurm import SlurmConfig


@dataclass(kw_only=True)
class EvalDataConfig(PromptFormat):
    eval_prompt_data: list[str] = field(path="data", help="eval prompt sources (json/jsonl/parquet/csv/arrow files, "
                                                          "save_to_disk folders, hub names); metrics per source "
                                                          "are keyed by its file stem")
    max_eval_prompts: int | None = field(None, ge=1, help="cap on eval prompts (a seeded random subset)")

    def validate(self) -> None:
        if not self.eval_prompt_data:
            raise ConfigError("data.eval_prompt_data is empty: name at least one eval prompt source")


@dataclass
class EvalPlacementConfig:
    rollout_num_ranks: int = field(1, ge=1, help="ranks generating (each samples its share of the prompts)")
    reward_num_ranks: int = field(1, ge=1, help="ranks scoring, when the reward has ranks of its own")
    colocate_reward: bool = field(True, help="the reward role on the rollout ranks (a reward function or remote "
                                             "reward needs no rank of its own); false: reward_num_ranks of its own")
    collective_timeout_s: float = field(1800.0, gt=0, help="time limit of any collective")
    dead_rank_timeout_s: float = field(20.0, gt=0, help="a rank silent this long is dead: every rank exits")


@dataclass
class EvalRunConfig:
    model: ModelConfig = field(help="the model evaluated (model.pretrain; model.param_dtype)")
    data: EvalDataConfig = field(help="eval prompts")
    reward: RewardConfig = field(help="the reward or verifier that scores every sample (e.g. reward.reward_func)")
    output_path: str = field(help="folder written by the main rank: eval_metrics.json and metrics.jsonl")
    eval: EvalSamplingConfig = field(default_factory=EvalSamplingConfig, help="samples per prompt, sampling, "
                                                                              "correctness threshold")
    rollout: RolloutConfig = field(default_factory=RolloutConfig,
                                   help="the generation engine (engine, its section, max_batch_size; generate_max_len "
                                        "is the default of eval.eval_max_new_tokens); its sampling options are unused")
    seed: int = field(42, ge=0, le=2**32 - 1, help="sample j of prompt i is drawn with a seed made from (seed, i, "
                                                   "j), as in `train rl` with train.seed")
    placement: EvalPlacementConfig = field(default_factory=EvalPlacementConfig, help="ranks")
    agent: AgentConfig = field(default_factory=AgentConfig, help="a multi-turn environment, evaluated as `train "
                                                                 "rl` runs it (docs/agents.md)")
    launch: LaunchConfig = field(default_factory=LaunchConfig, help="backend; launch.nproc stays 1 (the rank "
                                                                    "count comes from the placement)")

    def validate(self) -> None:
        require_reward_source(self.reward, self.agent)
        if self.launch.nproc != 1:
            raise ConfigError("launch.nproc does not apply to `hpc-rlhf eval`: its rank count follows from "
                              "placement.rollout_num_ranks (and reward_num_ranks with colocate_reward false)")

    def as_rl_config(self) -> RLConfig:
        """The RL run whose eval this command is: eval_only, the eval prompts as its (unused) training prompts,
        no checkpoints and no TensorBoard in output_path."""
        d, p = self.data, self.placement
        fmt = {f.name: getattr(d, f.name) for f in dataclasses.fields(PromptFormat)}
        data = PromptDataConfig(prompt_data=list(d.eval_prompt_data), eval_prompt_data=list(d.eval_prompt_data),
                                max_eval_prompts=d.max_eval_prompts, **fmt)
        sampling = {f.name: getattr(self.eval, f.name) for f in dataclasses.fields(EvalSamplingConfig)}
        placement = PlacementConfig(rollout_num_ranks=p.rollout_num_ranks, reward_num_ranks=p.reward_num_ranks,
                                    colocate_all=p.colocate_reward, collective_timeout_s=p.collective_timeout_s,
                                    dead_rank_timeout_s=p.dead_rank_timeout_s)
        out = Path(self.output_path)
        model = RLModelConfig(**{f.name: getattr(self.model, f.name) for f in dataclasses.fields(ModelConfig)})
        return RLConfig(model=model, data=data, reward=self.reward,
                        rollout=dataclasses.replace(self.rollout, rollout_batch_size=1, n_samples_per_prompt=1),
                        train=RLTrainConfig(seed=self.seed, train_batch_size=1), placement=placement,
                        ckpt=CheckpointConfig(save_path=str(out), ckpt_path=str(out / "checkpoints")),
                        log=LogConfig(use_tensorboard=False, progress_bar="off"),
                        eval=EvalConfig(**sampling, eval_only=True), agent=self.agent, launch=self.launch,
                        slurm=SlurmConfig())
