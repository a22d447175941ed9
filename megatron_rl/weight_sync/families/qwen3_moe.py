"""Qwen3-MoE: Qwen3 attention (per-head q/k RMSNorm, explicit head_dim) with a mixture of SwiGLU
experts in place of every MLP.

HF on disk: `mlp.gate.weight` [E, H] is the router, `mlp.experts.{e}.{gate,up,down}_proj.weight`
the experts; their conversion is the shared `SparseMoeLayout` (`moe.py`).

Routing (softmax over all experts, top-k, renormalised when `norm_topk_prob`) is Megatron's
`moe_router_score_function="softmax"` with `moe_router_pre_softmax=not norm_topk_prob`.
Refused: dense layers among the sparse ones (`mlp_only_layers`, `decoder_sparse_step` != 1)
and shared experts, which Qwen3-MoE checkpoints do not have.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_rl.weight_sync.families import register
from megatron_rl.weight_sync.families.moe import SparseMoeLayout
from megatron_rl.weight_sync.families.qwen3 import Qwen3Converter


@register
class Qwen3MoeConverter(SparseMoeLayout, Qwen3Converter):
    family = "qwen3_moe"
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"

    def config_dict(self, arch: Any, eos_token_id: int = 0) -> dict[str, Any]:
        cfg = super().config_dict(arch, eos_token_id)
        cfg.update(
            num_experts=arch.num_experts,
            num_experts_per_tok=arch.moe_router_topk,
            moe_intermediate_size=arch.moe_ffn_hidden_size,
            norm_topk_prob=arch.moe_norm_topk_prob,
            router_aux_loss_coef=arch.moe_aux_loss_coeff,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            output_router_logits=False,
        )
        return cfg

    def arch_from_config(self, hf: dict[str, Any], where: Path) -> dict[str, Any]:
        if hf.get("mlp_only_layers"):
            raise ValueError(f"{where}: mlp_only_layers={hf['mlp_only_layers']} is not supported "
                             "(dense MLP layers between MoE layers); only mlp_only_layers=[] is")
        if hf.get("decoder_sparse_step", 1) != 1:
            raise ValueError(f"{where}: decoder_sparse_step={hf['decoder_sparse_step']} is not supported "
                             "(dense MLP layers between MoE layers); only decoder_sparse_step=1 is")
        if hf.get("shared_expert_intermediate_size"):
            raise ValueError(f"{where}: shared_expert_intermediate_size={hf['shared_expert_intermediate_size']} "
                             "(shared experts) is not supported")
        # transformers >= 5 writes num_experts under its standard name num_local_experts
        num_experts = hf.get("num_experts", hf.get("num_local_experts"))
        if not num_experts:
            raise ValueError(f"{where}: num_experts={num_experts!r}: a qwen3_moe checkpoint needs experts")
        arch = super().arch_from_config(hf, where)
        arch.update(
            num_experts=num_experts,
            moe_ffn_hidden_size=hf["moe_intermediate_size"],
            moe_router_topk=hf["num_experts_per_tok"],
            moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),  # transformers' default
        )
        return arch
