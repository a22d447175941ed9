"""Typed configuration schema: one dataclass per config group, registered in Hydra's ConfigStore. The
groups live in one module per area (model.py, parallel.py: parallel and optimizer, rollout.py,
algorithm.py, task.py: task and domains, job.py: sandbox, cluster, logging, checkpoint); this module holds
the top-level `TrainConfig` and the registration.

Each dataclass checks its own fields in ``__post_init__`` (ranges, allowed values, checks
between fields of the same group) and raises ``ConfigError`` with a one-line message that
names the full key (``parallel.tp``), the bad value, what is allowed and how to fix it.
Checks that span groups or need the world size are the checking pass of ``megatron_rl.config.checks``.

Importing this module registers the schemas (``base_config`` and ``<group>/base_<group>``)
so that the YAML files in ``conf/`` can name them in their defaults lists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from megatron_rl.checks import check_choice as _check_choice
from megatron_rl.checks import check_min as _check_min
from megatron_rl.checks import format_value
from megatron_rl.checks import invalid as _invalid
from megatron_rl.config.algorithm import AlgorithmConfig
from megatron_rl.config.common import BUILTIN_TOKENIZERS, CHAR_TOKENIZER_DIR
from megatron_rl.config.job import CheckpointConfig, ClusterConfig, LoggingConfig, SandboxConfig
from megatron_rl.config.model import ModelConfig
from megatron_rl.config.parallel import OptimizerConfig, ParallelConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.task import DomainConfig, TaskConfig

__all__ = ["AlgorithmConfig", "BUILTIN_TOKENIZERS", "CHAR_TOKENIZER_DIR", "CheckpointConfig", "ClusterConfig",
           "DomainConfig", "LoggingConfig", "ModelConfig", "OptimizerConfig", "ParallelConfig", "RolloutConfig",
           "SCHEMAS", "SandboxConfig", "TaskConfig", "TrainConfig", "format_value", "register_schemas"]


@dataclass
class TrainConfig:
    """Top-level configuration of one training run (SFT or RL)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model architecture or checkpoint."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Megatron parallel layout."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation engine and sampling (mode=rl)."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator and policy loss (mode=rl)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Prompts and rewards."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Code-execution sandbox for rewards."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Launcher and device."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Logging and metric sinks."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Training checkpoints, resume and HF exports."""
    run_dir: str = "runs/${now:%Y%m%d-%H%M%S}"
    """Output directory (checkpoints, metrics); created by the trainer after validation, never by Hydra."""
    seed: int = 1234
    """Global seed for data order, sampling and dropout."""
    num_steps: int = 100
    """Optimizer steps to train."""
    global_batch_size: int = 64
    """Sequences per optimizer step, summed over data-parallel ranks."""
    micro_batch_tokens: int = 8192
    """Token budget of one packed micro-batch on one rank (at least the longest prompt plus
    rollout.max_new_tokens)."""
    deterministic: bool = True
    """Use deterministic kernels and fixed reduction order (bitwise reproducible runs)."""
    mode: str = "rl"
    """rl (rollouts + policy-gradient update; an optional supervised warm start, task.sft_warmup_steps)
    or sft (supervised fine-tuning on the task's references alone)."""
    domains: dict[str, DomainConfig] = field(default_factory=dict)
    """Multi-domain joint RL: {name: {task: ..., weight: ...}} with >= 2 entries; prompts of every
    domain are mixed by weight, and `task` only gives the run-level settings. Empty: a single-task
    run on `task`. See docs/rl.md, "Multi-domain joint training"."""

    MODES: ClassVar[tuple[str, ...]] = ("sft", "rl")

    def __post_init__(self) -> None:
        _check_choice("mode", self.mode, self.MODES)
        if not self.run_dir:
            raise _invalid("run_dir", self.run_dir, "must be a non-empty directory path")
        _check_min("seed", self.seed, 0)
        _check_min("num_steps", self.num_steps, 1)
        _check_min("global_batch_size", self.global_batch_size, 1)
        _check_min("micro_batch_tokens", self.micro_batch_tokens, 1)
        self._check_domains()
        # the device-dependent defaults, resolved here so that the run's config.yaml holds the choices
        gpus = self.cluster.device == "cuda" or (self.cluster.device == "auto" and nvidia_gpu_visible())
        if self.rollout.backend == "auto":
            self.rollout.backend = "sglang" if gpus else "hf"
            self.rollout.__post_init__()  # the chosen engine's own checks
        self.parallel.resolve_device_defaults(gpus)
        if self.rollout.weight_sync == "adapters" and not self.model.lora_rank:
            raise _invalid("rollout.weight_sync", self.rollout.weight_sync, "the model trains no LoRA adapters "
                           "(model.lora_rank=0): set model.lora_rank > 0 or rollout.weight_sync=full")
        if self.rollout.weight_sync == "adapters" and self.model.expert_lora_targets:
            raise _invalid("rollout.weight_sync", self.rollout.weight_sync, "engines get adapters on experts "
                           f"merged only (model.lora_targets has {', '.join(self.model.expert_lora_targets)}): "
                           "adapter syncs carry the attention's and dense MLPs' adapters, not yet the experts' "
                           "(transformers fuses a layer's routed experts into one tensor, which per-module PEFT "
                           "adapters do not address); use rollout.weight_sync=full")
        if self.rollout.weight_sync == "adapters" and self.model.moe_router_bias_update_rate:
            raise _invalid("rollout.weight_sync", self.rollout.weight_sync, "adapter syncs send the routers' "
                           "selection bias with the base weights only, but model.moe_router_bias_update_rate="
                           f"{format_value(self.model.moe_router_bias_update_rate)} moves it every step: use "
                           "rollout.weight_sync=full or model.moe_router_bias_update_rate=0")
        if self.algorithm.critic and self.algorithm.critic_warmup_steps >= self.num_steps:
            raise _invalid("algorithm.critic_warmup_steps", self.algorithm.critic_warmup_steps,
                           f"must be < num_steps={self.num_steps}, or the policy never learns")
        ckpt = self.checkpoint
        if ckpt.keep_best and self.mode == "sft" and ckpt.best_metric.startswith("eval"):
            raise _invalid("checkpoint.best_metric", ckpt.best_metric, "SFT logs its held-out loss at the last step "
                           "only: choose by a per-step metric, e.g. checkpoint.best_metric=loss best_mode=min")
        if ckpt.keep_best and self.mode == "rl" and ckpt.best_metric.startswith("eval/") and (
                self.task.eval_every < 1 or ckpt.save_every % self.task.eval_every):
            raise _invalid("checkpoint.save_every", ckpt.save_every, f"with checkpoint.best_metric={ckpt.best_metric} "
                           f"must be a multiple of task.eval_every={self.task.eval_every} (>= 1): a checkpoint "
                           "carries the metrics of the step it is saved after")

    def _check_domains(self) -> None:
        algo = self.algorithm
        if not self.domains:
            for key, value, off in (("domain_calibration", algo.domain_calibration, "none"),
                                    ("domain_pause_window", algo.domain_pause_window, 0)):
                if value != off:
                    raise _invalid(f"algorithm.{key}", value, "needs a multi-domain run: set domains "
                                   f"(e.g. +experiment=joint_countdown_math) or algorithm.{key}={format_value(off)}")
            return
        if len(self.domains) < 2:
            raise _invalid("domains", ",".join(self.domains), "a joint run needs >= 2 domains; for one task "
                           "set task=<task> and domains={}")
        if self.mode != "rl":
            raise _invalid("mode", self.mode, "domains are mixed by the RL loop only; set mode=rl or domains={}")
        for name, domain in self.domains.items():
            if not name.replace("_", "").replace("-", "").isalnum():
                raise _invalid(f"domains.{name}", name, "a domain name (used in metric names) may hold only "
                               "letters, digits, _ and -")
            if not domain.weight > 0:
                raise _invalid(f"domains.{name}.weight", domain.weight, "must be > 0 (drop the domain instead)")
            if algo.domain_pause_window and domain.task.num_eval < 1:
                raise _invalid(f"domains.{name}.task.num_eval", domain.task.num_eval,
                               "pausing (algorithm.domain_pause_window > 0) judges each domain by its held-out "
                               "accuracy: set it >= 1, or algorithm.domain_pause_window=0")
        if algo.domain_pause_window and self.task.eval_every < 1:
            raise _invalid("task.eval_every", self.task.eval_every, "pausing needs evaluations during the run: "
                           "set task.eval_every >= 1 (<= algorithm.domain_pause_window), or "
                           "algorithm.domain_pause_window=0")


SCHEMAS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "optimizer": OptimizerConfig,
    "rollout": RolloutConfig,
    "algorithm": AlgorithmConfig,
    "task": TaskConfig,
    "sandbox": SandboxConfig,
    "cluster": ClusterConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
}
"""Config group -> schema; each is stored as ``<group>/base_<group>``."""


def nvidia_gpu_visible() -> bool:
    """Whether this machine shows this process an NVIDIA GPU, judged without torch (config checks run before it
    loads): the driver lists a GPU and CUDA_VISIBLE_DEVICES does not hide them all."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def _model_schema_node() -> ModelConfig:
    # OmegaConf's merge never lets ``???`` replace an existing value, so a checkpoint model's
    # ``path: ???`` would silently stay ``None`` (random init) if any layer below it had the
    # Python default. The stored schemas therefore leave model.path missing; every model
    # option must say ``path: null`` (build from fields) or ``path: ???`` (user must give it).
    return ModelConfig(path=MISSING)


def register_schemas() -> None:
    """Store ``base_config`` and one ``base_<group>`` per group in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=TrainConfig(model=_model_schema_node()))
    for group, schema in SCHEMAS.items():
        node = _model_schema_node() if group == "model" else schema
        cs.store(group=group, name=f"base_{group}", node=node)


register_schemas()
