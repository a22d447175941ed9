"""GLM-4.5 MoE (GLM-4.5, -Air, GLM-4.6): Q/K/V bias, RoPE on part of each head, dense first layers, then a
sigmoid router with the selection bias over expert groups, a routed scaling factor and ungated shared
experts. Its checkpoints use plain RoPE.

HF <-> Megatron conversion. GLM-4.5 MoE (GLM-4.5, GLM-4.5-Air, GLM-4.6): grouped-query attention with Q/K/V bias,
RoPE on the first `partial_rotary_factor` of each head (0.5 in the released models), optional QK-norm
(`use_qk_norm`); the first `first_k_dense_replace` layers dense, the others a mixture of SwiGLU experts plus
`n_shared_experts` shared experts without a gate.

HF on disk: the routed experts as in `SparseMoeLayout` (`moe.py`: router `mlp.gate.weight`,
`mlp.experts.{e}.{gate,up,down}_proj.weight`), the router's per-expert selection bias
`mlp.gate.e_score_correction_bias` [E] (a buffer in transformers), the shared experts as one SwiGLU
MLP `mlp.shared_experts.{gate,up,down}_proj.weight` of width n_shared_experts x
moe_intermediate_size. Megatron: `mlp.router.expert_bias` (a buffer too; `weight_sync.sharding`
carries it with the parameters) and `SharedExpertMLP` without a gate
(`mlp.shared_experts.linear_fc1` = [gate; up], `linear_fc2` = down).

Routing (sigmoid scores; experts chosen by score + bias, from the `topk_group` best of `n_group`
groups; weights the chosen unbiased scores renormalised, times `routed_scaling_factor`) is
Megatron's sigmoid router; see `models/gpt.py:_moe_fields` and `families/glm4_moe.py` for the
settings both sides express alike. Multi-token-prediction layers (`num_nextn_predict_layers`; on disk the layers
after the decoder's) are not read: transformers does not run them either, and an export writes none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from megatron_rl.checks import invalid
from megatron_rl.families.common import partial_rope, router_groups, sigmoid_router
from megatron_rl.families.convert.dense import DenseDecoderConverter
from megatron_rl.families.convert.moe import MOE_LOSS_FIELDS, SparseMoeLayout, prediction_layer_tensor
from megatron_rl.families.spec import FamilySpec


# GLM-4.5's and DeepSeek's expert keys, which their `arch_from_config` reads
GROUPED_MOE_FIELDS = dict(
    mapped=("n_routed_experts", "num_local_experts", "n_shared_experts", "first_k_dense_replace",
            "moe_intermediate_size", "num_experts_per_tok", "norm_topk_prob", "routed_scaling_factor", "n_group",
            "topk_group"),
    ignored={**MOE_LOSS_FIELDS, "num_nextn_predict_layers": "multi-token-prediction layers, which transformers "
                                                            "does not run (their tensors are ignored)"})


class Glm4MoeConverter(SparseMoeLayout, DenseDecoderConverter):
    family = "glm4_moe"
    model_type = "glm4_moe"
    architecture = "Glm4MoeForCausalLM"
    hf_fields = DenseDecoderConverter.hf_fields.but(**GROUPED_MOE_FIELDS).but(
        mapped=("attention_bias", "use_qk_norm", "partial_rotary_factor"))

    def config_dict(self, arch: Any, eos_token_id: int = 0) -> dict[str, Any]:
        cfg = super().config_dict(arch, eos_token_id)
        theta = cfg.pop("rope_theta")
        cfg.update(
            attention_bias=arch.resolved_qkv_bias, use_qk_norm=arch.resolved_qk_layernorm,
            rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": arch.rotary_percent},
            n_routed_experts=arch.num_experts, num_experts_per_tok=arch.moe_router_topk,
            moe_intermediate_size=arch.moe_ffn_hidden_size,
            n_shared_experts=arch.moe_shared_expert_intermediate_size // arch.moe_ffn_hidden_size,
            first_k_dense_replace=len(arch.moe_dense_layers), norm_topk_prob=arch.moe_norm_topk_prob,
            routed_scaling_factor=arch.moe_routed_scaling_factor, n_group=arch.moe_router_num_groups,
            topk_group=arch.moe_router_group_topk, num_nextn_predict_layers=0, output_router_logits=False)
        return cfg

    def arch_from_config(self, hf: dict[str, Any], where: Path) -> dict[str, Any]:
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"{where}: rope_parameters={rope} is not supported (only default RoPE)")
        experts = hf.get("n_routed_experts", hf.get("num_local_experts"))
        if not experts:
            raise ValueError(f"{where}: n_routed_experts={experts!r}: a glm4_moe checkpoint needs experts")
        shared = hf.get("n_shared_experts", 1)
        if not shared:
            raise ValueError(f"{where}: n_shared_experts={shared!r}: GLM-4.5 MoE layers have shared experts")
        layers, first_dense = hf["num_hidden_layers"], hf.get("first_k_dense_replace", 1)
        if not 0 <= first_dense < layers:
            raise ValueError(f"{where}: first_k_dense_replace={first_dense} leaves no layer with experts "
                             f"(num_hidden_layers={layers})")
        arch = super().arch_from_config(hf, where)
        width = hf["moe_intermediate_size"]
        arch.update(
            qkv_bias=bool(hf.get("attention_bias", False)), qk_layernorm=bool(hf.get("use_qk_norm", False)),
            rotary_percent=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))),
            num_experts=experts, moe_ffn_hidden_size=width, moe_router_topk=hf["num_experts_per_tok"],
            moe_shared_expert_intermediate_size=shared * width, moe_dense_layers=list(range(first_dense)),
            moe_norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            moe_routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            moe_router_num_groups=hf.get("n_group") or 1, moe_router_group_topk=hf.get("topk_group") or 1)
        return arch

    def ignored_hf_tensor(self, name: str, arch: Any) -> Optional[str]:
        return super().ignored_hf_tensor(name, arch) or prediction_layer_tensor(name, arch)

    # -- a sparse layer's MLP: routed and shared experts (SparseMoeLayout), the router's bias -------
    hf_shared_expert = "mlp.shared_experts."
    sparse_layer_extras = (("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias",
                            lambda arch: (arch.num_experts,)),)


def _check_moe(m: Any) -> None:
    if m.rope_scaling_factor is not None:
        raise invalid("model.rope_scaling_factor", m.rope_scaling_factor,
                      "GLM-4.5 MoE checkpoints use plain RoPE (on part of each head); set it to null")
    sigmoid_router(m, "GLM-4.5 MoE")
    partial_rope(m)
    router_groups(m)


SPECS = (FamilySpec("glm4_moe", "GLM-4.5 MoE", Glm4MoeConverter, moe=True, shared_experts=True,
                    router="sigmoid", grouped_router=True, rope_scalings=(), partial_rotary=True, qkv_bias=True,
                    check_moe=_check_moe),)
