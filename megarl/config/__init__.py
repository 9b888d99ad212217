"""Typed configuration: dataclass schema per component, YAML recipes, dotted overrides."""
from megarl.config.errors import ConfigError
from megarl.config.loader import load_config, save_resolved, to_yaml
from megarl.config.schema import (AlgorithmConfig, CheckpointConfig, DataConfig, LoggingConfig, MegaRLConfig,
                                  ModelConfig, RolloutConfig, TopologyConfig, TrainerConfig)

__all__ = ["ConfigError", "load_config", "save_resolved", "to_yaml", "MegaRLConfig", "TopologyConfig",
           "ModelConfig", "RolloutConfig", "AlgorithmConfig", "DataConfig", "TrainerConfig",
           "CheckpointConfig", "LoggingConfig"]
