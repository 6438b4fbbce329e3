from .base import ConfigError, dump_yaml, load_config, to_dict
from .sections import CheckpointConfig, DataConfig, LaunchConfig, LogConfig, ModelConfig, TrainConfig
from .sft import SFTConfig

__all__ = ["ConfigError", "load_config", "dump_yaml", "to_dict", "SFTConfig", "ModelConfig", "DataConfig",
           "TrainConfig", "CheckpointConfig", "LogConfig", "LaunchConfig"]
