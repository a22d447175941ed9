"""DeepSeek-V2 and DeepSeek-V3 (and V3's architecture: Kimi-K2, Moonlight): multi-latent attention with YaRN,
dense first layers, routed experts over groups with a routed scaling factor and ungated shared experts;
V2's router is a softmax whose top k is not renormalised, V3's the sigmoid router with the selection bias."""

from typing import Any

from megatron_rl.checks import invalid
from megatron_rl.families.common import router_groups, shared_experts_and_dense_first, sigmoid_router
from megatron_rl.families.spec import FamilySpec


def _check_v2_moe(m: Any) -> None:
    """What DeepseekV2ForCausalLM and Megatron's softmax router express alike: softmax over all experts,
    the top k not renormalised (transformers' DeepseekV2 never does), groups ranked by their best expert;
    ungated shared experts of n_shared_experts x the expert width, dense layers first."""
    shared_experts_and_dense_first(m, "DeepSeek-V2")
    if m.moe_norm_topk_prob:
        raise invalid("model.moe_norm_topk_prob", True, "DeepSeek-V2 keeps the top-k softmax weights as they "
                      "are (times moe_routed_scaling_factor); set model.moe_norm_topk_prob=false")
    router_groups(m, per_group=1)


def _check_v3_moe(m: Any) -> None:
    sigmoid_router(m, "DeepSeek-V3")
    router_groups(m)


_COMMON = dict(moe=True, shared_experts=True, grouped_router=True, mla=True, rope_scalings=("yarn",),
               sglang_ties_embeddings=True)
SPECS = (FamilySpec("deepseek_v2", "DeepSeek-V2", "deepseek:DeepseekV2Converter", check_moe=_check_v2_moe,
                    **_COMMON),
         FamilySpec("deepseek_v3", "DeepSeek-V3", "deepseek:DeepseekV3Converter", router="sigmoid",
                    check_moe=_check_v3_moe, **_COMMON))
