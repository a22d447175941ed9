"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (Q/K/V bias, no QK-norm), routed experts and a
shared expert scaled by a sigmoid gate in every layer."""

from typing import Any

from megatron_rl.checks import check_min, invalid
from megatron_rl.families.spec import FamilySpec


def _check_moe(m: Any) -> None:
    """Qwen2-MoE layers as Qwen2MoeForCausalLM builds them: Q/K/V bias, no QK-norm, and a gated
    shared expert beside the routed ones."""
    if m.moe_shared_expert_intermediate_size is None:
        raise invalid("model.moe_shared_expert_intermediate_size", None,
                      "model.family=qwen2_moe has a shared expert in every layer: set it to its width "
                      "(HF shared_expert_intermediate_size)")
    check_min("model.moe_shared_expert_intermediate_size", m.moe_shared_expert_intermediate_size, 1)
    if m.qkv_bias is False:
        raise invalid("model.qkv_bias", False, "Qwen2-MoE attention always has Q/K/V bias; "
                      "set model.qkv_bias=true or null")
    if m.qk_layernorm:
        raise invalid("model.qk_layernorm", True, "Qwen2-MoE attention has no qk layernorm; "
                      "set model.qk_layernorm=false or null")


SPECS = (FamilySpec("qwen2_moe", "Qwen2-MoE", "qwen2_moe:Qwen2MoeConverter", moe=True, shared_experts=True,
                    qkv_bias=True, check_moe=_check_moe),)
