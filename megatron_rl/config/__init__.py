"""Run configuration: typed schema (Hydra ConfigStore) plus compose/validate entry points.

``load_config(overrides, world_size)`` returns a validated ``TrainConfig`` or raises
``ConfigError`` with a one-line message. Importing this package registers the schemas with
Hydra (needed before a ``@hydra.main`` app composes ``conf/config.yaml``) and stays light:
no torch, no megatron.
"""

from megatron_rl.config.loader import CONF_DIR, ConfigError, compose, load_config, to_typed, validate
from megatron_rl.config.schema import (
    AlgorithmConfig,
    ClusterConfig,
    CheckpointConfig,
    DomainConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RolloutConfig,
    SandboxConfig,
    TaskConfig,
    TrainConfig,
)

__all__ = [
    "CONF_DIR",
    "AlgorithmConfig",
    "ClusterConfig",
    "ConfigError",
    "CheckpointConfig",
    "DomainConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "RolloutConfig",
    "SandboxConfig",
    "TaskConfig",
    "TrainConfig",
    "compose",
    "load_config",
    "to_typed",
    "validate",
]
