"""A discriminative reward model's decoder as a ModelConfig (task.reward=reward_model): its architecture from its
HF checkpoint's config.json, run as the policy runs. Shared by the config checks and the run that builds it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from megatron_rl.config.model import ModelConfig

# How the policy runs (not what it is): the reward model runs the same way
_RUNTIME_FIELDS = ("tokenizer", "trust_remote_code", "dtype", "transformer_impl", "init_seed")


def reward_model_arch(path: str | Path, policy: Optional[Any] = None) -> ModelConfig:
    """The ModelConfig of the reward model's decoder (untied: its head is `score`, not the embedding), run as
    `policy` (a ModelConfig) runs: its dtype and transformer implementation."""
    from megatron_rl.checkpoint.hf import arch_from_hf_config

    fields = arch_from_hf_config(path)
    fields["tie_word_embeddings"] = False
    runtime = {k: getattr(policy, k) for k in _RUNTIME_FIELDS} if policy is not None else {}
    return ModelConfig(**fields, **runtime, name=f"reward_model:{Path(path).name}", path=str(path))
