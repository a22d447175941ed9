"""gpt-oss (gpt-oss-20b, -120b): experts in every layer with a bias on every linear layer, a clamped SwiGLU,
attention sinks, sliding-window attention on some layers, YaRN.

HF <-> Megatron conversion. gpt-oss (gpt-oss-20b, gpt-oss-120b): grouped-query attention with a bias on every
projection, a learned sink logit per head, sliding-window attention in the layers HF's `layer_types` marks
"sliding_attention" (the even ones), YaRN; in every layer a mixture of experts with a biased router (softmax over
the top k logits) and biased experts whose SwiGLU is clamped. How Megatron-core expresses each: `models/gpt.py:
_gpt_oss_fields`.

HF on disk (also transformers' layout in memory) and Megatron (local spec names), per layer:

    self_attn.{q,k,v}_proj.{weight,bias}     self_attention.linear_qkv.{weight,bias} (fused per KV group)
    self_attn.o_proj.{weight,bias}           self_attention.linear_proj.{weight,bias}
    self_attn.sinks [heads]                  self_attention.core_attention.softmax_offset
    mlp.router.{weight,bias} [E, H], [E]     mlp.router.{weight,bias}
    mlp.experts.gate_up_proj [E, H, 2I]      mlp.experts.local_experts.{e}.linear_fc1.weight [2I, H] = [gate; up]
    mlp.experts.gate_up_proj_bias [E, 2I]    mlp.experts.local_experts.{e}.linear_fc1.bias = [gate; up]
    mlp.experts.down_proj [E, I, H]          mlp.experts.local_experts.{e}.linear_fc2.weight [H, I]
    mlp.experts.down_proj_bias [E, H]        mlp.experts.local_experts.{e}.linear_fc2.bias

HF stores the experts stacked, transposed (x @ W), and each expert's gate and up columns interleaved
(gate = [..., ::2], up = [..., 1::2]); Megatron one [gate; up] linear per expert. An expert-parallel rank
reads only its rows of the stacked tensors (`stacked_expert_names`); writing them back needs every expert.
The released checkpoints are MXFP4-quantised (`quantization_config`, refused by `checkpoint.hf`): load a
bf16 copy (dequantised, without quantization_config).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional


from megatron_rl.checks import check_min, invalid
from megatron_rl.families.common import renormalising_router
from megatron_rl.families.convert.dense import DenseDecoderConverter, hf_rope
from megatron_rl.families.convert.moe import MOE_LOSS_FIELDS
from megatron_rl.families.convert.yarn import YarnRope, rope_fields
from megatron_rl.families.spec import FamilySpec

if TYPE_CHECKING:
    from torch import Tensor

    from megatron_rl.families.convert.dense import InPlaceView


_STACKED = ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj",
            "mlp.experts.down_proj_bias")
_HF_STACKED = re.compile(r"^(model\.layers\.\d+\.)mlp\.experts\.gate_up_proj$")
_HF_STACKED_ANY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\."
                             r"(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$")
_MEG_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.)mlp\.experts\.local_experts\.(\d+)\.linear_fc1\.weight$")
_SWIGLU_ALPHA = 1.702  # Megatron-core's quick_gelu: x * sigmoid(1.702 x)
# what transformers' GptOssConfig gives a config.json without rope keys (configuration_gpt_oss.py: __post_init__,
# default_theta)
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
_DEFAULT_THETA = 150000.0
_LAYER_TYPES = ("sliding_attention", "full_attention")


def _interleave(gate: Tensor, up: Tensor) -> Tensor:
    """[..., I] gate and up -> [..., 2I] with gate at the even positions, up at the odd ones."""
    import torch
    return torch.stack([gate, up], dim=-1).flatten(-2)


class GptOssConverter(YarnRope, DenseDecoderConverter):
    family = "gpt_oss"
    model_type = "gpt_oss"
    architecture = "GptOssForCausalLM"
    hf_fields = DenseDecoderConverter.hf_fields.but(
        mapped=("attention_bias", "swiglu_alpha", "swiglu_limit", "num_local_experts", "num_experts",
                "num_experts_per_tok", "sliding_window"),
        ignored={**MOE_LOSS_FIELDS,
                 "experts_per_token": "the original release's copy of num_experts_per_tok, which transformers reads",
                 "initial_context_length": "the original release's pre-training context; transformers reads the "
                                           "RoPE entry's original_max_position_embeddings"})

    # -- config.json ----------------------------------------------------------------------------
    def config_dict(self, arch: Any, eos_token_id: int = 0) -> dict[str, Any]:
        cfg = super().config_dict(arch, eos_token_id)
        theta = cfg.pop("rope_theta")
        cfg.pop("rope_scaling", None)
        windowed = set(arch.sliding_window_layers)
        cfg.update(
            rope_parameters=self.rope_parameters(arch, theta), attention_bias=True,
            intermediate_size=arch.moe_ffn_hidden_size,
            num_local_experts=arch.num_experts, num_experts_per_tok=arch.moe_router_topk,
            router_aux_loss_coef=arch.moe_aux_loss_coeff, output_router_logits=False,
            sliding_window=arch.sliding_window,
            layer_types=[_LAYER_TYPES[0] if i in windowed else _LAYER_TYPES[1] for i in range(arch.num_layers)],
            swiglu_limit=arch.swiglu_limit, swiglu_alpha=_SWIGLU_ALPHA)
        return cfg

    def arch_from_config(self, hf: dict[str, Any], where: Path) -> dict[str, Any]:
        # no rope entry at all: transformers' default for gpt-oss, YaRN (an entry without a type is plain RoPE)
        rope = hf_rope(hf, _DEFAULT_ROPE, _DEFAULT_THETA)
        hf = {**hf, "rope_theta": rope["rope_theta"]}
        rope_scaling = rope_fields(rope, where)
        if not hf.get("attention_bias", True):
            raise ValueError(f"{where}: attention_bias=false is not supported (Megatron-core gives every linear "
                             "layer a bias or none, and gpt-oss's experts and router have one)")
        alpha = hf.get("swiglu_alpha", _SWIGLU_ALPHA)
        if alpha != _SWIGLU_ALPHA:
            raise ValueError(f"{where}: swiglu_alpha={alpha} is not supported (Megatron-core's quick_gelu fixes "
                             f"it at {_SWIGLU_ALPHA})")
        experts = hf.get("num_local_experts", hf.get("num_experts"))
        if not experts:
            raise ValueError(f"{where}: num_local_experts={experts!r}: a gpt_oss checkpoint needs experts")
        layers = hf["num_hidden_layers"]
        # transformers' default: every other layer windowed, starting with the first
        types = hf.get("layer_types") or [_LAYER_TYPES[(i + 1) % 2 == 0] for i in range(layers)]
        if len(types) != layers or any(t not in _LAYER_TYPES for t in types):
            raise ValueError(f"{where}: layer_types={types} must give one of {', '.join(_LAYER_TYPES)} for each of "
                             f"the num_hidden_layers={layers} layers")
        window = hf.get("sliding_window", 128)
        arch = super().arch_from_config(hf, where)
        arch.update(
            qkv_bias=True, qk_layernorm=False, ffn_hidden_size=hf["intermediate_size"],
            num_experts=experts, moe_ffn_hidden_size=hf["intermediate_size"],
            moe_router_topk=hf["num_experts_per_tok"], moe_norm_topk_prob=True,
            sliding_window=window,
            sliding_window_layers=[i for i, t in enumerate(types) if t == _LAYER_TYPES[0]] if window else [],
            swiglu_limit=float(hf.get("swiglu_limit", 7.0)))
        arch.update(rope_scaling)
        return arch

    def _check_layer_types(self, hf: dict[str, Any], where: Path) -> None:
        pass  # sliding and full attention per layer: arch_from_config reads them

    # -- attention: the dense layout (with the output projection's bias) plus the sinks ---------------
    def attention_hf_names(self, arch: Any, prefix: str) -> set[str]:
        return super().attention_hf_names(arch, prefix) | {prefix + "self_attn.sinks"}

    def attention_to_megatron(self, hf: dict[str, Tensor], att: str, m: str, arch: Any) -> dict[str, Tensor]:
        out = super().attention_to_megatron(hf, att, m, arch)
        out[m + "core_attention.softmax_offset"] = hf[att + "sinks"]
        return out

    def attention_to_hf(self, meg: dict[str, Tensor], att: str, m: str, arch: Any) -> dict[str, Tensor]:
        out = super().attention_to_hf(meg, att, m, arch)
        out[att + "sinks"] = meg[m + "core_attention.softmax_offset"]
        return out

    # -- the mixture of experts -------------------------------------------------------------------
    def mlp_hf_names(self, arch: Any, prefix: str, experts: Optional[Iterable[int]] = None) -> set[str]:
        # the stacked tensors hold every expert; an expert-parallel rank reads its rows (`stacked_expert_names`)
        return {prefix + "mlp.router.weight", prefix + "mlp.router.bias", *(prefix + n for n in _STACKED)}

    def stacked_expert_names(self, names: Iterable[str]) -> set[str]:
        return {n for n in names if n.endswith(_STACKED)}

    def mlp_to_megatron(self, hf: dict[str, Tensor], h: str, m: str, arch: Any) -> dict[str, Tensor]:
        return {m + "mlp.router.weight": hf[h + "mlp.router.weight"], m + "mlp.router.bias": hf[h + "mlp.router.bias"]}

    def hf_to_megatron(self, hf: dict[str, Tensor], arch: Any, first_expert: int = 0) -> dict[str, Tensor]:
        import torch
        out = super().hf_to_megatron(hf, arch)
        for name in hf:
            match = _HF_STACKED.match(name)
            if match is None:
                continue
            h = match.group(1)
            m = "decoder" + h[len("model"):]
            block = h + "mlp.experts."
            gate_up, gate_up_bias = hf[block + "gate_up_proj"], hf[block + "gate_up_proj_bias"]
            down, down_bias = hf[block + "down_proj"], hf[block + "down_proj_bias"]
            for j in range(gate_up.shape[0]):
                dst = f"{m}mlp.experts.local_experts.{first_expert + j}."
                out[dst + "linear_fc1.weight"] = torch.cat([gate_up[j, :, 0::2], gate_up[j, :, 1::2]], dim=1).t()
                out[dst + "linear_fc1.bias"] = torch.cat([gate_up_bias[j, 0::2], gate_up_bias[j, 1::2]])
                out[dst + "linear_fc2.weight"] = down[j].t()
                out[dst + "linear_fc2.bias"] = down_bias[j]
        return out

    def mlp_to_hf(self, meg: dict[str, Tensor], h: str, m: str, arch: Any) -> dict[str, Tensor]:
        import torch
        out = {h + "mlp.router.weight": meg[m + "mlp.router.weight"], h + "mlp.router.bias": meg[m + "mlp.router.bias"]}
        experts = sorted(int(match.group(2)) for n in meg if (match := _MEG_EXPERT.match(n)) and match.group(1) == m)
        if experts != list(range(arch.num_experts)):
            raise ValueError(f"{m}: gpt-oss stores a layer's experts stacked, which needs all {arch.num_experts} "
                             f"of them; got {len(experts)}")
        gate_up, gate_up_bias, down, down_bias = [], [], [], []
        for e in experts:
            src = f"{m}mlp.experts.local_experts.{e}."
            gate, up = meg[src + "linear_fc1.weight"].chunk(2, dim=0)
            gate_up.append(_interleave(gate.t(), up.t()))
            gate_up_bias.append(_interleave(*meg[src + "linear_fc1.bias"].chunk(2)))
            down.append(meg[src + "linear_fc2.weight"].t())
            down_bias.append(meg[src + "linear_fc2.bias"])
        block = h + "mlp.experts."
        out.update({block + "gate_up_proj": torch.stack(gate_up),
                    block + "gate_up_proj_bias": torch.stack(gate_up_bias),
                    block + "down_proj": torch.stack(down), block + "down_proj_bias": torch.stack(down_bias)})
        return out

    def in_place_views(self, name: str, meg: dict[str, Tensor], arch: Any) -> Optional[list[InPlaceView]]:
        """The stacked experts, a view of each expert's tensor per row: gate_up_proj [E, H, 2I] viewed as
        [E, H, I, 2] takes an expert's gate (transposed) at [e, ..., 0] and its up at [e, ..., 1]."""
        match = _HF_STACKED_ANY.match(name)
        if match is None:
            return super().in_place_views(name, meg, arch)
        layer, stacked = match.groups()
        bias = stacked.endswith("_bias")
        kind = "bias" if bias else "weight"
        views: list[InPlaceView] = []
        for e in range(arch.num_experts):
            expert = f"decoder.layers.{layer}.mlp.experts.local_experts.{e}."
            if stacked.startswith("gate_up_proj"):
                gate, up = meg[expert + f"linear_fc1.{kind}"].chunk(2)
                if not bias:
                    gate, up = gate.t(), up.t()  # HF computes x @ W
                shape = (arch.num_experts, *gate.shape, 2)  # [..., 2I] as [..., I, 2]: gate even, up odd
                views += [(shape, (e, ..., 0), gate), (shape, (e, ..., 1), up)]
            else:
                down = meg[expert + f"linear_fc2.{kind}"]
                views.append((None, (e,), down if bias else down.t()))
        return views

    def expected_hf_shapes(self, arch: Any, names: Iterable[str]) -> dict[str, tuple[int, ...]]:
        names = list(names)
        shapes = super().expected_hf_shapes(arch, names)
        hidden, width, experts = arch.hidden_size, arch.moe_ffn_hidden_size, arch.num_experts
        own = {"self_attn.o_proj.bias": (hidden,), "self_attn.sinks": (arch.num_attention_heads,),
               "mlp.router.weight": (experts, hidden), "mlp.router.bias": (experts,),
               "mlp.experts.gate_up_proj": (experts, hidden, 2 * width),
               "mlp.experts.gate_up_proj_bias": (experts, 2 * width),
               "mlp.experts.down_proj": (experts, width, hidden), "mlp.experts.down_proj_bias": (experts, hidden)}
        for n in names:
            for ending, shape in own.items():
                if n.endswith("." + ending):
                    shapes[n] = shape
        return shapes


def _check_moe(m: Any) -> None:
    if m.qkv_bias is False:
        raise invalid("model.qkv_bias", False, "gpt-oss has a bias on every linear layer (HF attention_bias "
                      "false is not supported); set model.qkv_bias=true or null")
    renormalising_router(m, "gpt-oss")


def _check(m: Any) -> None:
    """gpt-oss's own fields: the sliding window and the layers that use it, the SwiGLU clamp."""
    if m.swiglu_limit is None:
        raise invalid("model.swiglu_limit", None, "model.family=gpt_oss clamps its experts' SwiGLU: set it "
                      "(HF swiglu_limit; gpt-oss: 7)")
    check_min("model.swiglu_limit", m.swiglu_limit, 0, strict=True)
    layers = list(m.sliding_window_layers)
    m.sliding_window_layers = sorted(layers)  # one spelling per layout (checkpoints compare it)
    if m.sliding_window is None:
        if layers:
            raise invalid("model.sliding_window_layers", layers, "needs model.sliding_window (the window "
                          "width); set it, or model.sliding_window_layers=[]")
        return
    check_min("model.sliding_window", m.sliding_window, 1)
    m.check_layer_list("sliding_window_layers", layers)


SPECS = (FamilySpec("gpt_oss", "gpt-oss", GptOssConverter, moe=True, experts_in_every_layer=True,
                    renormalised_topk=True, rope_scalings=("yarn",), qkv_bias=True, linear_bias=True,
                    attention_sinks=True, own_fields={"sliding_window": None, "sliding_window_layers": [],
                                                      "swiglu_limit": None},
                    check=_check, check_moe=_check_moe),)
