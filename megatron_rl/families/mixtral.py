"""Mixtral: experts in every layer, the router's top-k softmax always renormalised, no attention bias.

HF <-> Megatron conversion. Mixtral: Llama attention (no Q/K/V bias, no QK-norm) with a mixture of SwiGLU experts
in place of every MLP.

HF on disk: `block_sparse_moe.gate.weight` [E, H] is the router and
`block_sparse_moe.experts.{e}.w1/w3/w2.weight` each expert's gate, up and down projections;
their conversion is the shared `SparseMoeLayout` (`moe.py`). HF's `intermediate_size` is the
expert width (`moe_ffn_hidden_size`); there is no dense MLP, so `ffn_hidden_size` equals it.

Routing: softmax over all experts, top k, always renormalised, which is Megatron's softmax over
the top-k logits (`moe_norm_topk_prob=true`, hence `moe_router_pre_softmax=False`).
Refused: sliding-window attention (the released Mixtral checkpoints set `sliding_window: null`)
and router jitter noise (a training-time perturbation Megatron's router does not apply).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_rl.checks import invalid
from megatron_rl.families.common import renormalising_router
from megatron_rl.families.convert.dense import DenseDecoderConverter
from megatron_rl.families.convert.moe import MOE_LOSS_FIELDS, SparseMoeLayout
from megatron_rl.families.spec import FamilySpec


class MixtralConverter(SparseMoeLayout, DenseDecoderConverter):
    family = "mixtral"
    model_type = "mixtral"
    architecture = "MixtralForCausalLM"
    hf_moe_block = "block_sparse_moe."
    hf_expert_projections = ("w1", "w3", "w2")
    hf_fields = DenseDecoderConverter.hf_fields.but(
        mapped=("num_local_experts", "num_experts_per_tok", "router_jitter_noise", "sliding_window"),
        ignored=MOE_LOSS_FIELDS)

    def config_dict(self, arch: Any, eos_token_id: int = 0) -> dict[str, Any]:
        cfg = super().config_dict(arch, eos_token_id)
        cfg.update(
            intermediate_size=arch.moe_ffn_hidden_size,
            num_local_experts=arch.num_experts,
            num_experts_per_tok=arch.moe_router_topk,
            router_aux_loss_coef=arch.moe_aux_loss_coeff,
            router_jitter_noise=0.0,
            sliding_window=None,
            output_router_logits=False,
        )
        return cfg

    def arch_from_config(self, hf: dict[str, Any], where: Path) -> dict[str, Any]:
        if hf.get("sliding_window") is not None:
            raise ValueError(f"{where}: sliding_window={hf['sliding_window']} is not supported "
                             "(sliding-window attention); only sliding_window=null is")
        if hf.get("router_jitter_noise", 0.0):
            raise ValueError(f"{where}: router_jitter_noise={hf['router_jitter_noise']} is not supported "
                             "(Megatron's router adds no jitter); only router_jitter_noise=0 is")
        num_experts = hf.get("num_local_experts")
        if not num_experts:
            raise ValueError(f"{where}: num_local_experts={num_experts!r}: a mixtral checkpoint needs experts")
        arch = super().arch_from_config(hf, where)
        arch.update(
            qkv_bias=False,  # MixtralAttention has no bias and no QK-norm, whatever the config says
            num_experts=num_experts,
            moe_ffn_hidden_size=hf["intermediate_size"],
            moe_router_topk=hf["num_experts_per_tok"],
            moe_norm_topk_prob=True,
        )
        return arch


def _check_moe(m: Any) -> None:
    if m.qkv_bias:
        raise invalid("model.qkv_bias", True, "Mixtral attention has no qkv bias; set model.qkv_bias=false or null")
    renormalising_router(m, "Mixtral")


SPECS = (FamilySpec("mixtral", "Mixtral", MixtralConverter, moe=True, experts_in_every_layer=True,
                    renormalised_topk=True, check_moe=_check_moe),)
