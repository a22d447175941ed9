"""`FamilySpec`: what the generic model config, the model builder and the engines need to know of a family."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    name: str  # model.family
    title: str  # how messages name it ("GLM-4.5 MoE")
    converter: type  # its HF <-> Megatron converter class (defined beside the spec; torch loads lazily)
    moe: bool = False  # its MLPs are mixtures of experts (model.num_experts required)
    shared_experts: bool = False  # experts every token passes through beside the routed ones
    experts_in_every_layer: bool = False  # no dense layers (model.moe_dense_layers=[])
    renormalised_topk: bool = False  # the router always renormalises the top-k weights (no HF norm_topk_prob)
    router: str = "softmax"  # "sigmoid": Megatron's sigmoid router with the per-expert selection bias
    grouped_router: bool = False  # expert groups (HF n_group, topk_group) and a routed scaling factor
    mla: bool = False  # DeepSeek's multi-latent attention
    rope_scalings: tuple[str, ...] = ("llama3", "yarn")  # what its converter reads and writes; the first is
    # the default of model.rope_scaling_type=null; () none
    partial_rotary: bool = False  # RoPE may rotate part of each head (HF partial_rotary_factor)
    qkv_bias: bool = False  # default of model.qkv_bias=null
    qk_layernorm: bool = False  # default of model.qk_layernorm=null
    attention_bias_all: bool = False  # HF attention_bias is a bias on q, k, v and o_proj (qkv_bias sets both)
    linear_bias: bool = False  # every linear layer has a bias (Megatron add_bias_linear)
    mlp_bias: bool = False  # model.mlp_bias may be set (HF mlp_bias)
    attention_sinks: bool = False  # a learned sink logit per head in the softmax
    own_fields: Optional[dict[str, Any]] = None  # fields only this family uses, with everyone else's value
    sglang_ties_embeddings: bool = False  # SGLang ties lm_head to the embedding itself (tie_word_embeddings)
    check: Optional[Callable[[Any], None]] = None  # its own checks of a ModelConfig (after the generic ones)
    check_moe: Optional[Callable[[Any], None]] = None  # its own checks of the experts' settings

    @property
    def default_yarn(self) -> bool:
        """Whether rope_scaling_factor is YaRN's unless model.rope_scaling_type says otherwise."""
        return self.rope_scalings[:1] == ("yarn",)
