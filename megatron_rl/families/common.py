"""Checks that several families share: a mixture of experts whose router always renormalises its top k
(Mixtral, gpt-oss), GLM-4.5's and DeepSeek's shared experts with dense first layers, grouped routers,
the sigmoid router with the selection bias, partial RoPE. Each takes the ModelConfig being checked."""

from __future__ import annotations

from typing import Any

from megatron_rl.checks import check_min, divisors_str, invalid


def renormalising_router(m: Any, name: str) -> None:
    """What MixtralForCausalLM and GptOssForCausalLM cannot express: their routers softmax the top k
    (always renormalised), HF's intermediate_size is the expert width; neither has QK-norm."""
    if m.qk_layernorm:
        raise invalid("model.qk_layernorm", True, f"{name} attention has no qk layernorm; "
                      "set model.qk_layernorm=false or null")
    if not m.moe_norm_topk_prob:
        raise invalid("model.moe_norm_topk_prob", False, f"{name} always renormalises the top-k routing "
                      "weights; set model.moe_norm_topk_prob=true")
    if m.ffn_hidden_size != m.moe_ffn_hidden_size:
        raise invalid("model.ffn_hidden_size", m.ffn_hidden_size,
                      f"{name} has no dense MLP and one intermediate_size, the expert width: set "
                      f"model.ffn_hidden_size={m.moe_ffn_hidden_size} (= model.moe_ffn_hidden_size)")


def shared_experts_and_dense_first(m: Any, name: str) -> None:
    """GLM-4.5's and DeepSeek's layout: n_shared_experts >= 1 ungated shared experts of the expert
    width, and the first first_k_dense_replace layers dense."""
    shared, width = m.moe_shared_expert_intermediate_size, m.moe_ffn_hidden_size
    if shared is None or shared < width or shared % width:
        raise invalid("model.moe_shared_expert_intermediate_size", shared,
                      f"{name} layers have n_shared_experts >= 1 shared experts of the expert width: set "
                      f"it to a multiple of model.moe_ffn_hidden_size={width}")
    dense = sorted(m.moe_dense_layers)
    if dense != list(range(len(dense))):
        raise invalid("model.moe_dense_layers", list(m.moe_dense_layers),
                      f"{name} has its dense layers first (HF first_k_dense_replace): use [0, ..., k-1]")


def sigmoid_router(m: Any, name: str) -> None:
    """What Glm4MoeForCausalLM / DeepseekV3ForCausalLM and Megatron's sigmoid router express alike: shared
    experts of n_shared_experts x the expert width, dense layers first, renormalised top-k weights
    (Megatron's sigmoid router always renormalises), groups ranked by their top-2 scores."""
    shared_experts_and_dense_first(m, name)
    if not m.moe_norm_topk_prob or m.moe_router_topk < 2:
        raise invalid("model.moe_norm_topk_prob" if not m.moe_norm_topk_prob else "model.moe_router_topk",
                      m.moe_norm_topk_prob if not m.moe_norm_topk_prob else m.moe_router_topk,
                      "Megatron-core's sigmoid router renormalises the top-k weights, which needs "
                      "model.moe_norm_topk_prob=true and model.moe_router_topk >= 2")


def router_groups(m: Any, per_group: int = 2) -> None:
    """Expert groups and the routed scaling factor; HF ranks groups by the sum of their best `per_group`
    scores (GLM-4.5, DeepSeek-V3: 2; DeepSeek-V2: 1, its best expert), Megatron-core by their best
    moe_router_topk // moe_router_group_topk."""
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    check_min("model.moe_router_num_groups", groups, 1)
    if m.num_experts % groups:
        raise invalid("model.moe_router_num_groups", groups,
                      f"must divide model.num_experts={m.num_experts}; valid values are {divisors_str(m.num_experts)}")
    if not 1 <= group_topk <= groups:
        raise invalid("model.moe_router_group_topk", group_topk,
                      f"must lie in [1, model.moe_router_num_groups={groups}]")
    if groups > 1 and m.moe_router_topk // group_topk != per_group:
        raise invalid("model.moe_router_group_topk", group_topk,
                      f"HF ranks expert groups by the sum of their top {per_group} scores, Megatron-core by "
                      f"their top moe_router_topk // moe_router_group_topk = {m.moe_router_topk // group_topk}"
                      f": they agree only when that is {per_group}")
    if m.moe_router_topk > group_topk * (m.num_experts // groups):
        raise invalid("model.moe_router_topk", m.moe_router_topk,
                      f"exceeds the {group_topk * (m.num_experts // groups)} experts of the chosen groups")
    check_min("model.moe_routed_scaling_factor", m.moe_routed_scaling_factor, 0, strict=True)


def partial_rope(m: Any) -> None:
    rotated = m.resolved_head_dim * m.rotary_percent
    if rotated != int(rotated) or int(rotated) % 2:
        raise invalid("model.rotary_percent", m.rotary_percent,
                      f"must rotate an even number of each head's {m.resolved_head_dim} dimensions "
                      f"(here {rotated:g}): RoPE turns them in pairs")
