"""GLM-4.5 MoE (GLM-4.5, -Air, GLM-4.6): Q/K/V bias, RoPE on part of each head, dense first layers, then a
sigmoid router with the selection bias over expert groups, a routed scaling factor and ungated shared
experts. Its checkpoints use plain RoPE."""

from typing import Any

from megatron_rl.checks import invalid
from megatron_rl.families.common import partial_rope, router_groups, sigmoid_router
from megatron_rl.families.spec import FamilySpec


def _check_moe(m: Any) -> None:
    if m.rope_scaling_factor is not None:
        raise invalid("model.rope_scaling_factor", m.rope_scaling_factor,
                      "GLM-4.5 MoE checkpoints use plain RoPE (on part of each head); set it to null")
    sigmoid_router(m, "GLM-4.5 MoE")
    partial_rope(m)
    router_groups(m)


SPECS = (FamilySpec("glm4_moe", "GLM-4.5 MoE", "glm4_moe:Glm4MoeConverter", moe=True, shared_experts=True,
                    router="sigmoid", grouped_router=True, rope_scalings=(), partial_rotary=True, qkv_bias=True,
                    check_moe=_check_moe),)
