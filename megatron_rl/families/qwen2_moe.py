"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (Q/K/V bias, no QK-norm), routed experts and a
shared expert scaled by a sigmoid gate in every layer.

HF <-> Megatron conversion. Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (Q/K/V bias) with, in place of
every MLP, a mixture of SwiGLU experts plus one shared SwiGLU expert that every token passes through, scaled per
token by a sigmoid gate.

HF on disk: the routed experts as in `SparseMoeLayout` (`moe.py`: `mlp.gate.weight`,
`mlp.experts.{e}.{gate,up,down}_proj.weight`); the shared expert as
`mlp.shared_expert.{gate,up,down}_proj.weight` (width `shared_expert_intermediate_size`) and its
gate as `mlp.shared_expert_gate.weight` [1, H] (a Linear without bias). Megatron (`SharedExpertMLP`
with `moe_shared_expert_gate=True`): `mlp.shared_experts.linear_fc1.weight` = [gate; up],
`linear_fc2.weight` = down, `mlp.shared_experts.gate_weight` [1, H]; its output
`sigmoid(x @ gate_weight.T) * shared_mlp(x)` is added to the routed experts' output, as in HF.
The shared expert is a dense MLP split over tensor-parallel ranks and replicated over expert-parallel
ones; the gate is replicated everywhere.

Routing (softmax over all experts, top-k, renormalised only when `norm_topk_prob`, which defaults
to false here) is Megatron's softmax router with `moe_router_pre_softmax=not norm_topk_prob`.
Dense layers among the sparse ones (`mlp_only_layers`, `decoder_sparse_step` > 1) are plain SwiGLU
MLPs of width `intermediate_size`, without a shared expert (`model.moe_dense_layers`).
Refused: sliding-window attention, and `qkv_bias=false` (every released Qwen2-MoE model has the bias).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_rl.checks import check_min, invalid
from megatron_rl.families.convert.moe import QWEN_MOE_FIELDS, SparseMoeLayout, qwen_moe_arch, qwen_moe_config
from megatron_rl.families.qwen2 import Qwen2Converter
from megatron_rl.families.spec import FamilySpec


class Qwen2MoeConverter(SparseMoeLayout, Qwen2Converter):
    family = "qwen2_moe"
    model_type = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"
    hf_fields = Qwen2Converter.hf_fields.but(**QWEN_MOE_FIELDS).but(
        mapped=("qkv_bias", "shared_expert_intermediate_size"))

    def config_dict(self, arch: Any, eos_token_id: int = 0) -> dict[str, Any]:
        cfg = super().config_dict(arch, eos_token_id)
        cfg.update(qwen_moe_config(arch), shared_expert_intermediate_size=arch.moe_shared_expert_intermediate_size,
                   qkv_bias=True)
        return cfg

    def arch_from_config(self, hf: dict[str, Any], where: Path) -> dict[str, Any]:
        experts = qwen_moe_arch(hf, where, self.family)
        if not hf.get("qkv_bias", True):  # transformers < 5 always builds the bias and writes no key
            raise ValueError(f"{where}: qkv_bias=false is not supported; Qwen2-MoE attention has Q/K/V bias")
        shared = hf.get("shared_expert_intermediate_size")
        if not shared:
            raise ValueError(f"{where}: shared_expert_intermediate_size={shared!r}: Qwen2-MoE layers always "
                             "have a shared expert, whose width this must give")
        arch = super().arch_from_config(hf, where)
        arch.update(experts, moe_shared_expert_intermediate_size=shared)
        return arch

    # -- a sparse layer's MLP: routed and shared experts (SparseMoeLayout), the shared expert's gate ----
    hf_shared_expert = "mlp.shared_expert."
    sparse_layer_extras = (("mlp.shared_expert_gate.weight", "mlp.shared_experts.gate_weight",
                            lambda arch: (1, arch.hidden_size)),)


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


SPECS = (FamilySpec("qwen2_moe", "Qwen2-MoE", Qwen2MoeConverter, moe=True, shared_experts=True,
                    qkv_bias=True, check_moe=_check_moe),)
