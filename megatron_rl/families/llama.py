"""Llama (Llama 2, 3, 3.1, 3.2): grouped-query attention, SwiGLU MLPs, RoPE with Llama 3.1's scaling or YaRN;
HF attention_bias puts a bias on q, k, v and o_proj, mlp_bias on the MLP's three projections.

HF <-> Megatron conversion. Llama (2, 3, and 3.1 with its rope scaling, read by `dense.py` for every family):
optional biases, `attention_bias` on the q, k, v and o projections, `mlp_bias` on the gate, up and down projections
(each maps to ModelConfig: qkv_bias, which brings the output projection's along, and mlp_bias).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_rl.families.convert.dense import DenseDecoderConverter
from megatron_rl.families.spec import FamilySpec


class LlamaConverter(DenseDecoderConverter):
    family = "llama"
    model_type = "llama"
    architecture = "LlamaForCausalLM"
    hf_fields = DenseDecoderConverter.hf_fields.but(mapped=("attention_bias", "mlp_bias"))

    def config_dict(self, arch: Any, eos_token_id: int = 0) -> dict[str, Any]:
        cfg = super().config_dict(arch, eos_token_id)
        cfg.update(attention_bias=arch.resolved_qkv_bias, mlp_bias=arch.mlp_bias)
        return cfg

    def arch_from_config(self, hf: dict[str, Any], where: Path) -> dict[str, Any]:
        arch = super().arch_from_config(hf, where)
        arch["mlp_bias"] = bool(hf.get("mlp_bias", False))
        return arch


SPECS = (FamilySpec("llama", "Llama", LlamaConverter, attention_bias_all=True, mlp_bias=True,
                    sglang_ties_embeddings=True),)
