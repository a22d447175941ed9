"""Qwen3-MoE: Qwen3's attention, a softmax router over routed SwiGLU experts without shared ones (dense
layers where HF mlp_only_layers says).

HF <-> Megatron conversion. Qwen3-MoE: Qwen3 attention (per-head q/k RMSNorm, explicit head_dim) with a mixture of
SwiGLU experts in place of every MLP.

HF on disk: `mlp.gate.weight` [E, H] is the router, `mlp.experts.{e}.{gate,up,down}_proj.weight`
the experts; their conversion is the shared `SparseMoeLayout` (`moe.py`).

Routing (softmax over all experts, top-k, renormalised when `norm_topk_prob`) is Megatron's
`moe_router_score_function="softmax"` with `moe_router_pre_softmax=not norm_topk_prob`.
Dense layers among the sparse ones (`mlp_only_layers`, `decoder_sparse_step` > 1) are plain SwiGLU
MLPs of width `intermediate_size` (`model.moe_dense_layers`).
Refused: shared experts, which Qwen3-MoE checkpoints do not have. Attention as Qwen3's (`attention_bias`
on the q, k, v and o projections).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_rl.families.convert.moe import QWEN_MOE_FIELDS, SparseMoeLayout, qwen_moe_arch, qwen_moe_config
from megatron_rl.families.qwen3 import Qwen3Converter
from megatron_rl.families.spec import FamilySpec


class Qwen3MoeConverter(SparseMoeLayout, Qwen3Converter):
    family = "qwen3_moe"
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    hf_fields = Qwen3Converter.hf_fields.but(**QWEN_MOE_FIELDS).but(mapped=("shared_expert_intermediate_size",))

    def config_dict(self, arch: Any, eos_token_id: int = 0) -> dict[str, Any]:
        cfg = super().config_dict(arch, eos_token_id)
        cfg.update(qwen_moe_config(arch))
        return cfg

    def arch_from_config(self, hf: dict[str, Any], where: Path) -> dict[str, Any]:
        experts = qwen_moe_arch(hf, where, self.family)
        if hf.get("shared_expert_intermediate_size"):
            raise ValueError(f"{where}: shared_expert_intermediate_size={hf['shared_expert_intermediate_size']} "
                             "(shared experts) is not supported")
        arch = super().arch_from_config(hf, where)
        arch.update(experts)
        return arch


SPECS = (FamilySpec("qwen3_moe", "Qwen3-MoE", Qwen3MoeConverter, moe=True, qk_layernorm=True,
                    attention_bias_all=True),)
