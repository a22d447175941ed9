"""Qwen3 (dense): RMS-normed queries and keys per head (QK-norm), no bias by default (HF attention_bias: on
q, k, v and o_proj).

HF <-> Megatron conversion. Qwen3 (dense): RMSNorm on each query and key head (`q_norm`, `k_norm`), an explicit
`head_dim` that may differ from hidden / heads, `attention_bias` on the q, k, v and o projections
(ModelConfig qkv_bias, which brings the output projection's along). The MLP has no bias in
transformers' Qwen3 (an `mlp_bias` key is refused, as every key it does not read). Sliding-window
attention is refused as for Qwen2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_rl.families.convert.dense import DenseDecoderConverter
from megatron_rl.families.qwen2 import QWEN_WINDOW_FIELDS
from megatron_rl.families.spec import FamilySpec


class Qwen3Converter(DenseDecoderConverter):
    family = "qwen3"
    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    hf_fields = DenseDecoderConverter.hf_fields.but(**QWEN_WINDOW_FIELDS).but(mapped=("attention_bias",))

    def config_dict(self, arch: Any, eos_token_id: int = 0) -> dict[str, Any]:
        cfg = super().config_dict(arch, eos_token_id)
        cfg["attention_bias"] = arch.resolved_qkv_bias
        return cfg

    def arch_from_config(self, hf: dict[str, Any], where: Path) -> dict[str, Any]:
        if hf.get("use_sliding_window"):
            raise ValueError(f"{where}: use_sliding_window=true is not supported")
        arch = super().arch_from_config(hf, where)
        arch["qk_layernorm"] = True
        return arch


SPECS = (FamilySpec("qwen3", "Qwen3", Qwen3Converter, qk_layernorm=True, attention_bias_all=True,
                    sglang_ties_embeddings=True),)
