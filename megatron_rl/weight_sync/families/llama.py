"""Llama (2, 3, and 3.1 with its rope scaling, read by `dense.py` for every family): optional
attention bias from `attention_bias`; MLP bias is refused (no checkpoint of interest uses it and
Megatron's SwiGLU here has none)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_rl.weight_sync.families import register
from megatron_rl.weight_sync.families.dense import DenseDecoderConverter


@register
class LlamaConverter(DenseDecoderConverter):
    family = "llama"
    model_type = "llama"
    architecture = "LlamaForCausalLM"

    def config_dict(self, arch: Any, eos_token_id: int = 0) -> dict[str, Any]:
        cfg = super().config_dict(arch, eos_token_id)
        cfg.update(attention_bias=arch.resolved_qkv_bias, mlp_bias=False)
        return cfg

    def arch_from_config(self, hf: dict[str, Any], where: Path) -> dict[str, Any]:
        if hf.get("mlp_bias"):
            raise ValueError(f"{where}: mlp_bias=true is not supported")
        return super().arch_from_config(hf, where)
