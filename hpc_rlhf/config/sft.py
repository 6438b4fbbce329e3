"""Config of `hpc-rlhf train sft`."""
from __future__ import annotations

from dataclasses import dataclass

from .base import field
from .sections import CheckpointConfig, DataConfig, LaunchConfig, LogConfig, ModelConfig, TrainConfig
from .slurm import SlurmConfig


@dataclass
class SFTConfig:
    model: ModelConfig = field(help="the model and its adapters")
    data: DataConfig = field(help="training and evaluation data")
    train: TrainConfig = field(default_factory=TrainConfig, help="optimisation")
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig, help="saving and resuming")
    log: LogConfig = field(default_factory=LogConfig, help="metrics and evaluation")
    launch: LaunchConfig = field(default_factory=LaunchConfig, help="processes and backend")
    slurm: SlurmConfig = field(default_factory=SlurmConfig, help="SLURM job: resources, preemption, requeue")
