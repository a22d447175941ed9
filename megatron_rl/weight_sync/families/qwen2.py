"""Qwen2 / Qwen2.5: Q, K and V projections always carry a bias; sliding-window attention is
refused (the released dense models do not enable it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_rl.weight_sync.families import register
from megatron_rl.weight_sync.families.dense import DenseDecoderConverter


@register
class Qwen2Converter(DenseDecoderConverter):
    family = "qwen2"
    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"

    def config_dict(self, arch: Any, eos_token_id: int = 0) -> dict[str, Any]:
        cfg = super().config_dict(arch, eos_token_id)
        cfg["use_sliding_window"] = False
        return cfg

    def arch_from_config(self, hf: dict[str, Any], where: Path) -> dict[str, Any]:
        if hf.get("use_sliding_window"):
            raise ValueError(f"{where}: use_sliding_window=true is not supported")
        arch = super().arch_from_config(hf, where)
        arch["qkv_bias"] = True
        return arch
