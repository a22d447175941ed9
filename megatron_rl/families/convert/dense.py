"""The dense decoder layout shared by Llama, Qwen2 and Qwen3: HF <-> Megatron tensor mapping,
HF config <-> architecture fields (RoPE: default, Llama 3.1's `llama3` scaling, or YaRN, which Qwen's
model cards give for long contexts; others are refused). Families subclass it and change only what
differs, the config.json keys they read or ignore (`hf_fields`, `fields.py`) and the checkpoint tensors they
ignore (`ignored_hf_tensor`) included.

Megatron fuses Q, K and V into one `linear_qkv` whose rows are grouped per KV group:
[q (heads_per_group * head_dim), k (head_dim), v (head_dim)] x groups; and SwiGLU's gate and
up projections into `linear_fc1` = [gate; up]. Megatron names here are the local layer
spec's; `weight_sync.sharding` gives a Transformer Engine model's parameters these names.
Conversions work on any subset of layers (a pipeline stage's), found from the names given.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional


from megatron_rl.families.convert.fields import BASE_FIELDS, HFFields, check_config_keys
from megatron_rl.families.convert.yarn import NO_YARN, yarn_fields, yarn_rope_parameters

if TYPE_CHECKING:
    from torch import Tensor

    # (shape to view an HF tensor as, or None; index into that view; the Megatron view copied there)
    InPlaceView = tuple[Optional[tuple[int, ...]], tuple, Tensor]

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MEG_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_HF_QKV = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)$")
# The HF modules each LoRA target (model.lora_targets) becomes, in the order of its fused rows: the
# modules `adapter_to_hf` writes adapters for, and SGLang's lora_target_modules.
LORA_HF_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                   "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}


def qkv_fuse(q: Tensor, k: Tensor, v: Tensor, groups: int) -> Tensor:
    import torch
    rest = q.shape[1:]
    parts = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def qkv_groups(qkv: Tensor, heads: int, groups: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """`linear_qkv`'s Q, K and V rows per KV group, [groups, rows of one group, *rest] each: views of a
    contiguous `qkv`."""
    import torch
    per_group = qkv.reshape(groups, (heads // groups + 2) * head_dim, *qkv.shape[1:])
    q, k, v = torch.split(per_group, [heads // groups * head_dim, head_dim, head_dim], dim=1)
    return q, k, v


def qkv_split(qkv: Tensor, heads: int, groups: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    rest = qkv.shape[1:]
    q, k, v = qkv_groups(qkv, heads, groups, head_dim)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _layers(names: Iterable[str], pattern: re.Pattern) -> list[int]:
    return sorted({int(m.group(1)) for n in names if (m := pattern.match(n))})


def hf_rope(hf: dict[str, Any], default: Optional[dict[str, Any]] = None,
            default_theta: float = 10000.0) -> dict[str, Any]:
    """The RoPE entry of a config.json as transformers (>= 5) reads it: `rope_scaling` if there is one, else
    `rope_parameters` (else `default`), with `rope_theta` and `partial_rotary_factor` from the top level where the
    entry has none, and for scaled RoPE (llama3, yarn) the top-level `original_max_position_embeddings` in place
    of the entry's, or else max_position_embeddings (modeling_rope_utils.py: convert_rope_params_to_dict,
    standardize_rope_params)."""
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or default or {})
    rope.setdefault("rope_theta", hf.get("rope_theta", default_theta))
    if hf.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    if rope.get("rope_type", rope.get("type", "default")) in ("llama3", "yarn"):
        if "original_max_position_embeddings" in hf:
            rope["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        rope.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 4096))
    return rope


# Tensors a checkpoint may hold that no family reads: (pattern, why)
IGNORED_TENSORS = ((re.compile(r"(^|\.)rotary_emb\.inv_freq$"),
                    "RoPE's frequency cache (older transformers saved it): recomputed from the config"),)


class DenseDecoderConverter:
    """HF <-> Megatron for a pre-norm RMSNorm / SwiGLU / RoPE / GQA decoder."""

    family = "dense"
    model_type = ""
    model_type_aliases: tuple[str, ...] = ()  # other config.json model_type values of the same architecture
    architecture = ""
    hf_fields: HFFields = BASE_FIELDS.but(mapped=(
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
        "original_max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "hidden_act", "layer_types"))
    """What this family does with each config.json key (`fields.py`); `arch_from_config` reads the mapped ones."""

    # -- architecture <-> config.json ---------------------------------------------------------
    def config_dict(self, arch: Any, eos_token_id: int = 0) -> dict[str, Any]:
        """The HF `config.json` of this architecture."""
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": arch.vocab_size,
            "hidden_size": arch.hidden_size,
            "intermediate_size": arch.ffn_hidden_size,
            "num_hidden_layers": arch.num_layers,
            "num_attention_heads": arch.num_attention_heads,
            "num_key_value_heads": arch.num_query_groups,
            "head_dim": arch.resolved_head_dim,
            "max_position_embeddings": arch.max_position_embeddings,
            "rope_theta": arch.rope_theta,
            "rms_norm_eps": arch.norm_eps,
            "tie_word_embeddings": arch.tie_word_embeddings,
            **self._rope_scaling_dict(arch),
            "hidden_act": "silu",
            "bos_token_id": eos_token_id,
            "eos_token_id": eos_token_id,
            "pad_token_id": eos_token_id,
            "attention_dropout": 0.0,
        }

    @staticmethod
    def _rope_scaling_dict(arch: Any) -> dict[str, Any]:
        """HF's `rope_scaling` entry (the pre-5.0 spelling, which transformers 5 still reads)."""
        if arch.rope_scaling_factor is None:
            return {}
        if getattr(arch, "rope_scaling_type", None) == "yarn":
            return {"rope_scaling": yarn_rope_parameters(arch)}
        return {"rope_scaling": {
            "rope_type": "llama3", "factor": arch.rope_scaling_factor,
            "low_freq_factor": arch.rope_scaling_low_freq_factor,
            "high_freq_factor": arch.rope_scaling_high_freq_factor,
            "original_max_position_embeddings": arch.rope_scaling_original_max_position_embeddings}}

    @staticmethod
    def _rope_scaling_fields(hf: dict[str, Any], where: Path) -> dict[str, Any]:
        """ModelConfig's rope fields (all of them: a config file's values never survive a checkpoint without
        them) from the RoPE entry (`hf_rope`: `rope_scaling`, transformers < 5, or `rope_parameters`, >= 5).
        YaRN's missing factor is transformers' default: max_position_embeddings over the original context."""
        rope = hf_rope(hf)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        plain = {"rope_scaling_type": None, **NO_YARN, "rope_scaling_low_freq_factor": 1.0,
                 "rope_scaling_high_freq_factor": 4.0}
        if rope_type == "default":
            return plain
        if rope_type == "yarn":
            if rope.get("factor") is None:
                rope["factor"] = hf.get("max_position_embeddings", 4096) / rope["original_max_position_embeddings"]
            return {**plain, **yarn_fields(rope, where), "rope_scaling_type": "yarn"}
        if rope_type != "llama3":
            raise ValueError(f"{where}: rope_scaling={rope} is not supported (only default RoPE, rope_type=llama3 "
                             "(Llama 3.1's scaling) and rope_type=yarn)")
        return {**plain, "rope_scaling_factor": float(rope["factor"]),
                "rope_scaling_low_freq_factor": float(rope["low_freq_factor"]),
                "rope_scaling_high_freq_factor": float(rope["high_freq_factor"]),
                "rope_scaling_original_max_position_embeddings": int(rope["original_max_position_embeddings"])}

    def arch_from_config(self, hf: dict[str, Any], where: Path) -> dict[str, Any]:
        """ModelConfig field values from a config.json (`where` names it in errors)."""
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{where}: hidden_act={hf['hidden_act']!r} is not supported (only silu)")
        self._check_layer_types(hf, where)
        heads = hf["num_attention_heads"]
        theta = hf_rope(hf)["rope_theta"]
        return {
            "family": self.family,
            "num_layers": hf["num_hidden_layers"],
            "hidden_size": hf["hidden_size"],
            "ffn_hidden_size": hf["intermediate_size"],
            "num_attention_heads": heads,
            "num_query_groups": hf.get("num_key_value_heads") or heads,
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
            "vocab_size": hf["vocab_size"],
            "max_position_embeddings": hf.get("max_position_embeddings", 4096),
            "rope_theta": float(theta),
            **self._rope_scaling_fields(hf, where),
            "norm_eps": hf.get("rms_norm_eps", 1e-6),
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "qkv_bias": bool(hf.get("attention_bias", False)),
            "qk_layernorm": False,
        }

    def _check_layer_types(self, hf: dict[str, Any], where: Path) -> None:
        """Refuse per-layer attention types other than full attention (transformers' layer_types)."""
        types = hf.get("layer_types") or []
        if any(t != "full_attention" for t in types):
            raise ValueError(f"{where}: layer_types={types} is not supported: model.family={self.family} attends "
                             "to the whole context in every layer (only \"full_attention\" entries)")

    def check_config(self, hf: dict[str, Any], where: Path) -> None:
        """Refuse, naming them all, the config.json keys this family neither maps nor ignores (`fields.py`)."""
        check_config_keys(hf, self.hf_fields, where)

    def ignored_hf_tensor(self, name: str, arch: Any) -> Optional[str]:
        """Why the checkpoint tensor `name`, which `hf_names` does not list, may be left unread; None: it may not."""
        if name == "lm_head.weight" and arch.tie_word_embeddings:
            # a copy of the embedding; `checkpoint.hf.stage_tensors` refuses one that differs (transformers would
            # compute with it)
            return "tied embeddings: a copy of the input embedding"
        return next((why for pattern, why in IGNORED_TENSORS if pattern.search(name)), None)

    # -- which HF tensors a pipeline stage needs ----------------------------------------------
    def hf_names(self, arch: Any, layers: Iterable[int], first_stage: bool, last_stage: bool,
                 experts: Optional[Iterable[int]] = None) -> set[str]:
        """HF tensors of these layers (and of the first / last stage's embedding, norm, head);
        `experts` limits a mixture of experts to those expert indices (None: all)."""
        names: set[str] = set()
        if first_stage or (last_stage and arch.tie_word_embeddings):
            names.add("model.embed_tokens.weight")
        if last_stage:
            names.add("model.norm.weight")
            if not arch.tie_word_embeddings:
                names.add("lm_head.weight")
        for i in layers:
            h = f"model.layers.{i}."
            names |= {h + "input_layernorm.weight", h + "post_attention_layernorm.weight",
                      h + "self_attn.o_proj.weight"}
            if arch.attention_output_bias:
                names.add(h + "self_attn.o_proj.bias")
            names |= self.mlp_hf_names(arch, h, experts)
            names |= self.attention_hf_names(arch, h)
        return names

    def attention_hf_names(self, arch: Any, prefix: str) -> set[str]:
        """HF names of one layer's attention projections and norms besides `o_proj`."""
        names = {prefix + f"self_attn.{p}_proj.weight" for p in "qkv"}
        if arch.resolved_qkv_bias:
            names |= {prefix + f"self_attn.{p}_proj.bias" for p in "qkv"}
        if arch.resolved_qk_layernorm:
            names |= {prefix + "self_attn.q_norm.weight", prefix + "self_attn.k_norm.weight"}
        return names

    def mlp_hf_names(self, arch: Any, prefix: str, experts: Optional[Iterable[int]] = None) -> set[str]:
        """HF names of one layer's MLP (`prefix` = "model.layers.{i}."); `experts`: see hf_names."""
        kinds = ("weight", "bias") if arch.mlp_bias else ("weight",)
        return {prefix + f"mlp.{p}_proj.{kind}" for p in ("gate", "up", "down") for kind in kinds}

    def stacked_expert_names(self, names: Iterable[str]) -> set[str]:
        """Those of `names` that hold every expert of a layer stacked along dim 0 (gpt-oss's
        `mlp.experts.gate_up_proj`): an expert-parallel rank reads only its rows of them, and passes the
        first row's expert index to `hf_to_megatron`. The other families store one tensor per expert."""
        return set()

    # -- tensors ------------------------------------------------------------------------------
    def hf_to_megatron(self, hf: dict[str, Tensor], arch: Any, first_expert: int = 0) -> dict[str, Tensor]:
        """Megatron tensors (full, unsharded, global layer numbers) for whatever `hf` holds; stacked expert
        tensors (`stacked_expert_names`) hold the experts from `first_expert` on."""
        out: dict[str, Tensor] = {}
        if "model.embed_tokens.weight" in hf:
            out["embedding.word_embeddings.weight"] = hf["model.embed_tokens.weight"]
        if "model.norm.weight" in hf:
            out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if "lm_head.weight" in hf and not arch.tie_word_embeddings:
            out["output_layer.weight"] = hf["lm_head.weight"]
        for i in _layers(hf, _HF_LAYER):
            h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
            out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
            out.update(self.attention_to_megatron(hf, h + "self_attn.", m + "self_attention.", arch))
            out[m + "self_attention.linear_proj.weight"] = hf[h + "self_attn.o_proj.weight"]
            if arch.attention_output_bias:
                out[m + "self_attention.linear_proj.bias"] = hf[h + "self_attn.o_proj.bias"]
            out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
            out.update(self.mlp_to_megatron(hf, h, m, arch))
        return out

    def attention_to_megatron(self, hf: dict[str, Tensor], att: str, m: str, arch: Any) -> dict[str, Tensor]:
        """One layer's attention besides the output projection: HF names under `att`
        ("model.layers.{i}.self_attn.") -> Megatron names under `m` ("decoder.layers.{i}.self_attention.")."""
        groups = arch.num_query_groups
        out = {m + "linear_qkv.weight": qkv_fuse(
            hf[att + "q_proj.weight"], hf[att + "k_proj.weight"], hf[att + "v_proj.weight"], groups)}
        if arch.resolved_qkv_bias:
            out[m + "linear_qkv.bias"] = qkv_fuse(
                hf[att + "q_proj.bias"], hf[att + "k_proj.bias"], hf[att + "v_proj.bias"], groups)
        if arch.resolved_qk_layernorm:
            out[m + "q_layernorm.weight"] = hf[att + "q_norm.weight"]
            out[m + "k_layernorm.weight"] = hf[att + "k_norm.weight"]
        return out

    def mlp_to_megatron(self, hf: dict[str, Tensor], h: str, m: str, arch: Any) -> dict[str, Tensor]:
        """One layer's MLP: HF names under `h` -> Megatron names under `m`."""
        import torch
        out = {}
        for kind in ("weight", "bias") if arch.mlp_bias else ("weight",):
            out[m + f"mlp.linear_fc1.{kind}"] = torch.cat([hf[h + f"mlp.gate_proj.{kind}"],
                                                           hf[h + f"mlp.up_proj.{kind}"]], dim=0)
            out[m + f"mlp.linear_fc2.{kind}"] = hf[h + f"mlp.down_proj.{kind}"]
        return out

    def megatron_to_hf(self, meg: dict[str, Tensor], arch: Any) -> dict[str, Tensor]:
        """HF tensors for whatever (full, unsharded) Megatron tensors `meg` holds."""
        out: dict[str, Tensor] = {}
        if "embedding.word_embeddings.weight" in meg:
            out["model.embed_tokens.weight"] = meg["embedding.word_embeddings.weight"]
            if arch.tie_word_embeddings:
                out["lm_head.weight"] = meg["embedding.word_embeddings.weight"]
        if "decoder.final_layernorm.weight" in meg:
            out["model.norm.weight"] = meg["decoder.final_layernorm.weight"]
        if "output_layer.weight" in meg and not arch.tie_word_embeddings:
            out["lm_head.weight"] = meg["output_layer.weight"]
        for i in _layers(meg, _MEG_LAYER):
            h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
            out[h + "input_layernorm.weight"] = meg[m + "input_layernorm.weight"]
            out.update(self.attention_to_hf(meg, h + "self_attn.", m + "self_attention.", arch))
            out[h + "self_attn.o_proj.weight"] = meg[m + "self_attention.linear_proj.weight"]
            if arch.attention_output_bias:
                out[h + "self_attn.o_proj.bias"] = meg[m + "self_attention.linear_proj.bias"]
            out[h + "post_attention_layernorm.weight"] = meg[m + "pre_mlp_layernorm.weight"]
            out.update(self.mlp_to_hf(meg, h, m, arch))
        return out

    def attention_to_hf(self, meg: dict[str, Tensor], att: str, m: str, arch: Any) -> dict[str, Tensor]:
        """The reverse of `attention_to_megatron`."""
        heads, groups, head_dim = arch.num_attention_heads, arch.num_query_groups, arch.resolved_head_dim
        out = {}
        q, k, v = qkv_split(meg[m + "linear_qkv.weight"], heads, groups, head_dim)
        out[att + "q_proj.weight"], out[att + "k_proj.weight"], out[att + "v_proj.weight"] = q, k, v
        if arch.resolved_qkv_bias:
            q, k, v = qkv_split(meg[m + "linear_qkv.bias"], heads, groups, head_dim)
            out[att + "q_proj.bias"], out[att + "k_proj.bias"], out[att + "v_proj.bias"] = q, k, v
        if arch.resolved_qk_layernorm:
            out[att + "q_norm.weight"] = meg[m + "q_layernorm.weight"]
            out[att + "k_norm.weight"] = meg[m + "k_layernorm.weight"]
        return out

    def mlp_to_hf(self, meg: dict[str, Tensor], h: str, m: str, arch: Any) -> dict[str, Tensor]:
        """One layer's MLP: Megatron names under `m` -> HF names under `h`."""
        out = {}
        for kind in ("weight", "bias") if arch.mlp_bias else ("weight",):
            gate, up = meg[m + f"mlp.linear_fc1.{kind}"].chunk(2)
            out[h + f"mlp.gate_proj.{kind}"], out[h + f"mlp.up_proj.{kind}"] = gate, up
            out[h + f"mlp.down_proj.{kind}"] = meg[m + f"mlp.linear_fc2.{kind}"]
        return out

    def adapter_to_hf(self, weight: str, a: Tensor, b: Tensor, arch: Any) -> dict[str, tuple[Tensor, Tensor]]:
        """A LoRA adapter of the Megatron weight `weight` (global name, e.g. "decoder.layers.3.mlp.linear_fc1.weight";
        full factors A [rank, in], B [out, rank]) as PEFT adapters of the HF modules that weight becomes:
        {"model.layers.3.mlp.gate_proj": (A, B's gate rows), ...}. A fused weight's rows go to its modules as
        `megatron_to_hf` sends them (B's rows are the update's rows), and every module gets the whole A, so
        each module's update is its rows of the fused one. (Every family's attention output and dense MLP are
        named as here; multi-latent attention has no linear_qkv, and experts' adapters never come here: runs
        with them sync and export merged weights only.)"""
        match = re.match(r"^decoder\.layers\.(\d+)\.(self_attention|mlp)\.(linear_\w+)\.weight$", weight)
        if match is None:
            raise ValueError(f"{weight}: not a weight LoRA adapts")
        layer, block, target = match.groups()
        if target not in LORA_HF_MODULES:
            raise ValueError(f"{weight}: not a weight LoRA adapts")
        h = f"model.layers.{layer}." + ("self_attn." if block == "self_attention" else "mlp.")
        if target == "linear_qkv":
            rows = qkv_split(b, arch.num_attention_heads, arch.num_query_groups, arch.resolved_head_dim)
        elif target == "linear_fc1":
            rows = b.chunk(2, dim=0)
        else:
            rows = (b,)
        return {h + module: (a, part) for module, part in zip(LORA_HF_MODULES[target], rows, strict=True)}

    def in_place_views(self, name: str, meg: dict[str, Tensor], arch: Any) -> Optional[list[InPlaceView]]:
        """How weight sync writes the HF tensor `name` of `megatron_to_hf(meg, arch)` into an engine's memory
        without building it, when it is no view of one tensor of `meg` (`weight_sync.in_place`): views of `meg`'s
        tensors, each with where it goes, (shape, index, view): the HF tensor viewed as `shape` (None: as it is)
        and indexed by `index` receives `view`; together they write every element. None: no such views. The dense
        layout's are Q, K and V, each the rows of every KV group of `linear_qkv` (one strided view)."""
        match = _HF_QKV.match(name)
        if match is None:
            return None
        layer, which, kind = match.groups()
        qkv = meg[f"decoder.layers.{layer}.self_attention.linear_qkv.{kind}"]
        parts = qkv_groups(qkv, arch.num_attention_heads, arch.num_query_groups, arch.resolved_head_dim)
        part = parts["qkv".index(which)]
        return [(tuple(part.shape), (), part)]

    def hf_memory_slot(self, name: str, arch: Any) -> tuple[str, tuple]:
        """Where the hub-layout tensor `name` lives in a `transformers` model in memory: (parameter
        name, index into that parameter). The dense layout is held as written."""
        return name, ()

    def expected_hf_shapes(self, arch: Any, names: Iterable[str]) -> dict[str, tuple[int, ...]]:
        """Shapes the architecture implies, for checking a checkpoint before loading it."""
        hidden, hd = arch.hidden_size, arch.resolved_head_dim
        q_out, kv_out = arch.num_attention_heads * hd, arch.num_query_groups * hd
        shapes = {}
        for n in names:
            if n in ("model.embed_tokens.weight", "lm_head.weight"):
                shapes[n] = (arch.vocab_size, hidden)
            elif n.endswith("layernorm.weight") or n == "model.norm.weight":
                shapes[n] = (hidden,)
            elif n.endswith(("q_norm.weight", "k_norm.weight")):
                shapes[n] = (hd,)
            elif n.endswith("q_proj.weight"):
                shapes[n] = (q_out, hidden)
            elif n.endswith(("k_proj.weight", "v_proj.weight")):
                shapes[n] = (kv_out, hidden)
            elif n.endswith("q_proj.bias"):
                shapes[n] = (q_out,)
            elif n.endswith(("k_proj.bias", "v_proj.bias")):
                shapes[n] = (kv_out,)
            elif n.endswith(("o_proj.bias", "down_proj.bias")):
                shapes[n] = (hidden,)
            elif n.endswith(("gate_proj.bias", "up_proj.bias")):
                shapes[n] = (arch.ffn_hidden_size,)
            elif n.endswith("o_proj.weight"):
                shapes[n] = (hidden, q_out)
            elif n.endswith(("gate_proj.weight", "up_proj.weight")):
                shapes[n] = (arch.ffn_hidden_size, hidden)
            elif n.endswith("down_proj.weight"):
                shapes[n] = (hidden, arch.ffn_hidden_size)
        return shapes
