"""The distillation teacher's model config (algorithm.distill.teacher): its architecture from its HF checkpoint's
config.json, on the student's tokenizer and kernels. Shared by the config checks and the run that builds it."""

from __future__ import annotations

from pathlib import Path

from megatron_rl.config.model import ModelConfig


def teacher_model_config(student: ModelConfig, path: str) -> ModelConfig:
    """The teacher's `ModelConfig`: the architecture its config.json gives (any family and size), on the
    student's tokenizer, dtype, attention implementation and log-prob path; no LoRA, no recomputation (it
    only runs forwards). Raises ValueError for a config.json this build cannot run."""
    from megatron_rl.checkpoint.hf import arch_from_hf_config

    arch = arch_from_hf_config(path)
    return ModelConfig(name=f"teacher:{Path(path).name}", path=str(path), tokenizer=student.tokenizer,
                       trust_remote_code=student.trust_remote_code, dtype=student.dtype,
                       transformer_impl=student.transformer_impl, fused_logprobs=student.fused_logprobs,
                       **arch)
