"""DeepSeek-V2 and DeepSeek-V3 (and V3's architecture: Kimi-K2, Moonlight): multi-latent attention with YaRN,
dense first layers, routed experts over groups with a routed scaling factor and ungated shared experts;
V2's router is a softmax whose top k is not renormalised, V3's the sigmoid router with the selection bias.

HF <-> Megatron conversion. DeepSeek-V3 (and the checkpoints of its architecture: Kimi-K2, Moonlight) and
DeepSeek-V2-Lite (the full V2 and V2.5 group their experts in a way Megatron-core does not express:
`DeepseekV2Converter`): multi-latent attention (MLA) with optional YaRN scaling, the first `first_k_dense_replace`
layers dense, the others a mixture of experts with ungated shared experts. DeepSeek-V3 routes as GLM-4.5 does (a
sigmoid router choosing by score + a per-expert bias from the best groups, renormalised and scaled weights;
`glm4_moe.py`), DeepSeek-V2 by a softmax over all experts.

Attention on disk (HF) and in Megatron's `MLASelfAttention` (local spec names), one to one:

    self_attn.q_a_proj           [q_lora_rank, H]                   linear_q_down_proj
    self_attn.q_a_layernorm      [q_lora_rank]                      q_layernorm
    self_attn.q_b_proj           [heads x (nope + rope), q_lora]    linear_q_up_proj
    self_attn.q_proj             [heads x (nope + rope), H]         linear_q_proj  (q_lora_rank null)
    self_attn.kv_a_proj_with_mqa [kv_lora_rank + rope, H]           linear_kv_down_proj
    self_attn.kv_a_layernorm     [kv_lora_rank]                     kv_layernorm
    self_attn.kv_b_proj          [heads x (nope + v), kv_lora]      linear_kv_up_proj
    self_attn.o_proj             [H, heads x v]                     linear_proj

Both order each head's query rows [no-RoPE part; RoPE part] and each head's key-value rows [key
no-RoPE part; value], and both store the rotated dimensions interleaved in pairs (see
`models/gpt._mla_fields`; transformers' DeepSeek-V2 rotates them as complex pairs and leaves them
interleaved, V3 and Megatron-core de-interleave them, the same permutation for queries and keys, so the
scores are equal), so nothing is permuted. The Transformer Engine spec fuses the latent norms
into the up projections (`linear_q_up_proj.layer_norm_weight`); `weight_sync.sharding.canonical_name`
maps them back. Multi-token-prediction layers (`num_nextn_predict_layers`; on disk the layers after the
decoder's) are not read: transformers does not run them either, and an export writes none.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional

from megatron_rl.checks import invalid
from megatron_rl.families.common import router_groups, shared_experts_and_dense_first, sigmoid_router
from megatron_rl.families.convert.dense import DenseDecoderConverter, hf_rope
from megatron_rl.families.convert.moe import SparseMoeLayout, prediction_layer_tensor
from megatron_rl.families.convert.yarn import YarnRope, rope_fields
from megatron_rl.families.glm4_moe import GROUPED_MOE_FIELDS
from megatron_rl.families.spec import FamilySpec

if TYPE_CHECKING:
    from torch import Tensor


# (HF name under self_attn., Megatron name under self_attention.) of the attention's tensors besides o_proj
_COMPRESSED_QUERY = (("q_a_proj.weight", "linear_q_down_proj.weight"), ("q_a_layernorm.weight", "q_layernorm.weight"),
                     ("q_b_proj.weight", "linear_q_up_proj.weight"))
_DIRECT_QUERY = (("q_proj.weight", "linear_q_proj.weight"),)
_KEY_VALUE = (("kv_a_proj_with_mqa.weight", "linear_kv_down_proj.weight"),
              ("kv_a_layernorm.weight", "kv_layernorm.weight"), ("kv_b_proj.weight", "linear_kv_up_proj.weight"))


def _mla_pairs(arch: Any) -> tuple[tuple[str, str], ...]:
    return (_COMPRESSED_QUERY if arch.q_lora_rank is not None else _DIRECT_QUERY) + _KEY_VALUE


class MlaMoeConverter(YarnRope, SparseMoeLayout, DenseDecoderConverter):
    """What DeepSeek-V2 and -V3 share: multi-latent attention, RoPE or YaRN, dense first layers, routed
    plus ungated shared experts. Subclasses name their router (`_router_arch`, `_router_config`) and the
    defaults transformers' config class gives absent keys (`defaults`)."""

    name = ""
    defaults: dict[str, Any] = {}
    hf_fields = DenseDecoderConverter.hf_fields.but(**GROUPED_MOE_FIELDS).but(
        mapped=("attention_bias", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "scoring_func", "topk_method", "rope_interleave", "head_dim"),
        ignored={"qk_head_dim": "transformers derives it: qk_nope_head_dim + qk_rope_head_dim",
                 "aux_loss_alpha": "the weight of DeepSeek's load-balancing loss (training only)",
                 "seq_aux": "DeepSeek's per-sequence load-balancing loss (training only)",
                 "ep_size": "the expert-parallel size of DeepSeek's own code (a layout, not the model)"},
        fixed={"moe_layer_freq": (1, "experts in every moe_layer_freq-th layer after the dense ones (DeepSeek's "
                                     "code and SGLang read it)"),
               "mlp_bias": (False, "biases on the MLPs")})

    # -- config.json ----------------------------------------------------------------------------
    def config_dict(self, arch: Any, eos_token_id: int = 0) -> dict[str, Any]:
        cfg = super().config_dict(arch, eos_token_id)
        theta = cfg.pop("rope_theta")
        cfg.pop("rope_scaling", None)
        del cfg["head_dim"]  # transformers sets it to qk_rope_head_dim itself
        cfg.update(
            rope_parameters=self.rope_parameters(arch, theta), attention_bias=False,
            q_lora_rank=arch.q_lora_rank, kv_lora_rank=arch.kv_lora_rank, qk_nope_head_dim=arch.qk_nope_head_dim,
            qk_rope_head_dim=arch.qk_rope_head_dim, v_head_dim=arch.v_head_dim,
            n_routed_experts=arch.num_experts, num_experts_per_tok=arch.moe_router_topk,
            moe_intermediate_size=arch.moe_ffn_hidden_size,
            n_shared_experts=arch.moe_shared_expert_intermediate_size // arch.moe_ffn_hidden_size,
            first_k_dense_replace=len(arch.moe_dense_layers), norm_topk_prob=arch.moe_norm_topk_prob,
            routed_scaling_factor=arch.moe_routed_scaling_factor, n_group=arch.moe_router_num_groups,
            topk_group=arch.moe_router_group_topk, output_router_logits=False,
            # DeepSeek's own config.json has it, and SGLang reads it (transformers assumes it)
            moe_layer_freq=1, **self._router_config(arch))
        return cfg

    def _router_config(self, arch: Any) -> dict[str, Any]:
        raise NotImplementedError

    def _router_arch(self, hf: dict[str, Any], where: Path) -> dict[str, Any]:
        raise NotImplementedError

    def arch_from_config(self, hf: dict[str, Any], where: Path) -> dict[str, Any]:
        rope_scaling = rope_fields(hf_rope(hf), where)
        if hf.get("attention_bias", False):
            raise ValueError(f"{where}: attention_bias=true is not supported (Megatron-core's multi-latent "
                             "attention has no bias; DeepSeek's checkpoints have none)")
        hf = {**self.defaults, **hf}  # absent keys mean what transformers' config class defaults to
        experts = hf.get("n_routed_experts", hf.get("num_local_experts"))
        if not experts:
            raise ValueError(f"{where}: n_routed_experts={experts!r}: a {self.family} checkpoint needs experts")
        shared = hf["n_shared_experts"]
        if not shared:
            raise ValueError(f"{where}: n_shared_experts={shared!r}: {self.name} MoE layers have shared experts")
        layers, first_dense = hf["num_hidden_layers"], hf["first_k_dense_replace"]
        if not 0 <= first_dense < layers:
            raise ValueError(f"{where}: first_k_dense_replace={first_dense} leaves no layer with experts "
                             f"(num_hidden_layers={layers})")
        if hf.get("head_dim") not in (None, hf["qk_rope_head_dim"]):
            # transformers writes qk_rope_head_dim there, and its DeepSeek-V3 sizes RoPE from it
            raise ValueError(f"{where}: head_dim={hf['head_dim']} is not supported: multi-latent attention rotates "
                             f"qk_rope_head_dim={hf['qk_rope_head_dim']} dimensions of each head (head_dim must "
                             "equal it, or be absent)")
        hf = {**hf, "head_dim": None}  # MLA's widths are below
        arch = super().arch_from_config(hf, where)
        width = hf["moe_intermediate_size"]
        arch.update(
            qkv_bias=None, qk_layernorm=None, head_dim=None,
            num_query_groups=hf["num_attention_heads"],  # every head gets its own keys and values
            q_lora_rank=hf["q_lora_rank"], kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            num_experts=experts, moe_ffn_hidden_size=width, moe_router_topk=hf["num_experts_per_tok"],
            moe_shared_expert_intermediate_size=shared * width, moe_dense_layers=list(range(first_dense)),
            moe_routed_scaling_factor=float(hf["routed_scaling_factor"]),
            moe_router_num_groups=hf["n_group"] or 1, moe_router_group_topk=hf["topk_group"] or 1)
        arch.update(self._router_arch(hf, where))
        if rope_scaling["rope_scaling_factor"] is not None and not rope_scaling["rope_scaling_truncate"]:
            raise ValueError(f"{where}: rope_parameters truncate=false is not supported (Megatron-core's multi-latent "
                             "attention rounds YaRN's correction range)")
        arch.update(rope_scaling)
        return arch

    def ignored_hf_tensor(self, name: str, arch: Any) -> Optional[str]:
        return super().ignored_hf_tensor(name, arch) or prediction_layer_tensor(name, arch)

    # -- attention --------------------------------------------------------------------------------
    def attention_hf_names(self, arch: Any, prefix: str) -> set[str]:
        return {prefix + "self_attn." + hf for hf, _ in _mla_pairs(arch)}

    def attention_to_megatron(self, hf: dict[str, Tensor], att: str, m: str, arch: Any) -> dict[str, Tensor]:
        return {m + meg: hf[att + name] for name, meg in _mla_pairs(arch)}

    def attention_to_hf(self, meg: dict[str, Tensor], att: str, m: str, arch: Any) -> dict[str, Tensor]:
        return {att + name: meg[m + meg_name] for name, meg_name in _mla_pairs(arch)}

    def expected_hf_shapes(self, arch: Any, names: Iterable[str]) -> dict[str, tuple[int, ...]]:
        names = list(names)
        shapes = super().expected_hf_shapes(arch, names)
        hidden, heads = arch.hidden_size, arch.num_attention_heads
        qk, rope = arch.resolved_head_dim, arch.qk_rope_head_dim
        mla = {"q_a_proj.weight": (arch.q_lora_rank, hidden), "q_a_layernorm.weight": (arch.q_lora_rank,),
               "q_b_proj.weight": (heads * qk, arch.q_lora_rank), "q_proj.weight": (heads * qk, hidden),
               "kv_a_proj_with_mqa.weight": (arch.kv_lora_rank + rope, hidden),
               "kv_a_layernorm.weight": (arch.kv_lora_rank,),
               "kv_b_proj.weight": (heads * (arch.qk_nope_head_dim + arch.v_head_dim), arch.kv_lora_rank),
               "o_proj.weight": (hidden, heads * arch.v_head_dim)}
        for n in names:
            for ending, shape in mla.items():
                if n.endswith(".self_attn." + ending):
                    shapes[n] = shape
        return shapes

    # -- a sparse layer's MLP: GLM-4.5's --------------------------------------------------------------
    hf_shared_expert = "mlp.shared_experts."


class DeepseekV3Converter(MlaMoeConverter):
    """DeepSeek-V3's router: sigmoid scores, choice by score + a per-expert bias (noaux_tc) from the best
    groups by their top-2 sum, weights renormalised and scaled (GLM-4.5's)."""

    family = "deepseek_v3"
    model_type = "deepseek_v3"
    # Kimi-K2's config.json names its own model_type (its remote code) for this architecture; an export
    # writes deepseek_v3, which transformers builds
    model_type_aliases = ("kimi_k2",)
    architecture = "DeepseekV3ForCausalLM"
    name = "DeepSeek-V3"
    defaults = {"q_lora_rank": 1536, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,  # DeepseekV3Config
                "first_k_dense_replace": 3, "n_shared_experts": 1, "norm_topk_prob": True}
    sparse_layer_extras = (("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias",
                            lambda arch: (arch.num_experts,)),)

    def _router_config(self, arch: Any) -> dict[str, Any]:
        # scoring_func / topk_method: what DeepSeek's own config.json says, and SGLang and vLLM read
        return dict(rope_interleave=True, num_nextn_predict_layers=0, scoring_func="sigmoid", topk_method="noaux_tc")

    def _router_arch(self, hf: dict[str, Any], where: Path) -> dict[str, Any]:
        if hf.get("rope_interleave", True) is False:
            raise ValueError(f"{where}: rope_interleave=false is not supported: Megatron-core's multi-latent "
                             "attention reads the rotated dimensions interleaved, as DeepSeek's checkpoints store them")
        if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError(f"{where}: scoring_func={hf.get('scoring_func')!r}, "
                             f"topk_method={hf.get('topk_method')!r}: "
                             "only DeepSeek-V3's sigmoid router with the selection bias (noaux_tc) is supported")
        return {"moe_norm_topk_prob": bool(hf["norm_topk_prob"])}


class DeepseekV2Converter(MlaMoeConverter):
    """DeepSeek-V2-Lite (and -Lite-Chat): softmax over all experts, the top k kept without renormalising
    (`topk_method` greedy) or from the best `topk_group` groups ranked by their best expert
    (group_limited_greedy), weights times `routed_scaling_factor`; no selection bias. Megatron's softmax
    router with `moe_router_pre_softmax` and the scaling factor; its groups rank by the sum of their top
    moe_router_topk / moe_router_group_topk scores, which is the best expert when that is 1 (ModelConfig
    refuses other settings, among them the full DeepSeek-V2's and V2.5's 6 experts from 3 of 8 groups)."""

    family = "deepseek_v2"
    model_type = "deepseek_v2"
    architecture = "DeepseekV2ForCausalLM"
    name = "DeepSeek-V2"
    defaults = {"q_lora_rank": 1536, "n_group": None, "topk_group": None,  # DeepseekV2Config
                "routed_scaling_factor": 1.0, "first_k_dense_replace": 0, "n_shared_experts": 2,
                "topk_method": "greedy"}

    def _router_config(self, arch: Any) -> dict[str, Any]:
        grouped = arch.moe_router_num_groups > 1
        return dict(scoring_func="softmax", topk_method="group_limited_greedy" if grouped else "greedy")

    def _router_arch(self, hf: dict[str, Any], where: Path) -> dict[str, Any]:
        method = hf["topk_method"]
        if method not in ("greedy", "group_limited_greedy") or hf.get("scoring_func", "softmax") != "softmax":
            raise ValueError(f"{where}: scoring_func={hf.get('scoring_func')!r}, topk_method={method!r}: a "
                             "deepseek_v2 checkpoint routes by softmax with greedy or group_limited_greedy (for "
                             "noaux_tc, DeepSeek-V3's router, use model_type deepseek_v3)")
        if hf.get("norm_topk_prob"):
            # transformers' DeepseekV2 ignores it, DeepSeek's own code and SGLang renormalise: the trainer and
            # an SGLang engine would route differently
            raise ValueError(f"{where}: norm_topk_prob=true is not supported for deepseek_v2 (transformers ignores "
                             "it, DeepSeek's code and SGLang renormalise; DeepSeek-V2's checkpoints say false)")
        router = {"moe_norm_topk_prob": False}
        if method == "greedy":  # transformers ignores the groups then
            router.update(moe_router_num_groups=1, moe_router_group_topk=1)
        return router


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
SPECS = (FamilySpec("deepseek_v2", "DeepSeek-V2", DeepseekV2Converter, check_moe=_check_v2_moe,
                    **_COMMON),
         FamilySpec("deepseek_v3", "DeepSeek-V3", DeepseekV3Converter, router="sigmoid",
                    check_moe=_check_v3_moe, **_COMMON))
