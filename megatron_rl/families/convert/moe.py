"""The mixture-of-experts MLP layout shared by Qwen3-MoE, Qwen2-MoE and Mixtral: a router and SwiGLU experts
in place of the MLP of every layer but the dense ones (`model.moe_dense_layers`, which keep the dense
layout). Families mix `SparseMoeLayout` into their attention converter and name where the block
lives and what its three expert projections are called.

HF on disk (the hub layout `save_pretrained` writes; in memory `transformers` fuses the experts):
`{block}gate.weight` [E, H] is the router, `{block}experts.{e}.{gate,up,down}.weight` the
experts (Qwen3-MoE: block `mlp.`, projections `gate_proj`, `up_proj`, `down_proj`; Mixtral:
block `block_sparse_moe.`, projections `w1`, `w3`, `w2`). Megatron (SequentialMLP,
`moe_grouped_gemm=False`): `mlp.router.weight` [E, H] and
`mlp.experts.local_experts.{e}.linear_fc1.weight` = [gate; up], `linear_fc2.weight` = down. In a
full Megatron state dict `e` is the global expert index; `weight_sync.sharding` renumbers it per
expert-parallel rank. Like the dense layout, conversions work on whatever subset of experts they
are given (an expert-parallel rank reads only its own).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

if TYPE_CHECKING:
    from torch import Tensor


_MEG_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.")


def _experts(names: Iterable[str], prefix: str, pattern: re.Pattern) -> list[int]:
    """Expert indices among `names` of the layer under `prefix`."""
    return sorted({int(m.group(1)) for n in names if n.startswith(prefix) and (m := pattern.match(n, len(prefix)))})


# What a mixture of experts' config.json says about training alone: transformers' load-balancing loss
MOE_LOSS_FIELDS = {"output_router_logits": "returns the router logits for transformers' load-balancing loss",
                   "router_aux_loss_coef": "the weight of transformers' load-balancing loss (model.moe_aux_loss_coeff "
                                           "sets the trainer's)"}
# The expert keys of a Qwen-style MoE config.json (Qwen2-MoE, Qwen3-MoE), which `qwen_moe_arch` reads
QWEN_MOE_FIELDS = dict(mapped=("num_experts", "num_local_experts", "moe_intermediate_size", "num_experts_per_tok",
                               "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"),
                       ignored=MOE_LOSS_FIELDS)


def prediction_layer_tensor(name: str, arch: Any) -> Optional[str]:
    """Why a GLM-4.5 or DeepSeek checkpoint tensor may be left unread: it belongs to a multi-token-prediction
    layer (`num_nextn_predict_layers`), stored as the layers after the decoder's; None otherwise."""
    match = re.match(r"^model\.layers\.(\d+)\.", name)
    if match and int(match.group(1)) >= arch.num_layers:
        return "a multi-token-prediction layer (num_nextn_predict_layers), which transformers does not run"
    return None


def qwen_moe_config(arch: Any) -> dict[str, Any]:
    """The config.json keys of a Qwen-style MoE (Qwen2-MoE, Qwen3-MoE); dense layers are written as
    `mlp_only_layers` with `decoder_sparse_step=1`, which means the same as any other spelling."""
    return dict(num_experts=arch.num_experts, num_experts_per_tok=arch.moe_router_topk,
                moe_intermediate_size=arch.moe_ffn_hidden_size, norm_topk_prob=arch.moe_norm_topk_prob,
                router_aux_loss_coef=arch.moe_aux_loss_coeff, decoder_sparse_step=1,
                mlp_only_layers=sorted(arch.moe_dense_layers), output_router_logits=False)


def qwen_moe_dense_layers(hf: dict[str, Any], where: Path) -> list[int]:
    """The dense layers of a Qwen-style MoE config.json: as transformers builds the decoder, layer i
    has experts when i is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0."""
    layers, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"{where}: decoder_sparse_step={step!r} must be a positive integer")
    only = hf.get("mlp_only_layers") or []
    if any(not isinstance(i, int) or not 0 <= i < layers for i in only):
        raise ValueError(f"{where}: mlp_only_layers={only} must name layers in [0, num_hidden_layers={layers})")
    dense = [i for i in range(layers) if i in only or (i + 1) % step != 0]
    if len(dense) == layers:
        raise ValueError(f"{where}: mlp_only_layers={only} with decoder_sparse_step={step} leaves no layer "
                         "with experts; load it as the dense family")
    return dense


def qwen_moe_arch(hf: dict[str, Any], where: Path, family: str) -> dict[str, Any]:
    """ModelConfig's expert fields from a Qwen-style MoE config.json (raises ValueError naming the
    file for no experts, or a dense-layer pattern transformers would not build)."""
    # transformers >= 5 writes num_experts under its standard name num_local_experts
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not num_experts:
        raise ValueError(f"{where}: num_experts={num_experts!r}: a {family} checkpoint needs experts")
    return dict(num_experts=num_experts, moe_ffn_hidden_size=hf["moe_intermediate_size"],
                moe_router_topk=hf["num_experts_per_tok"], moe_dense_layers=qwen_moe_dense_layers(hf, where),
                moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)))  # transformers' default


def _layer(prefix: str) -> int:
    """The global layer index of an HF (`model.layers.{i}.`) or Megatron (`decoder.layers.{i}.`) prefix."""
    return int(prefix.rstrip(".").rsplit(".", 1)[1])


class SparseMoeLayout:
    """MLP conversion for a decoder whose layers are mixtures of SwiGLU experts, except those in
    `moe_dense_layers`, which keep the dense SwiGLU layout; mixed in before a `DenseDecoderConverter`
    subclass, whose attention and embedding layout it keeps. Families name where their sparse
    layers keep the router and experts, their shared expert, and further one-to-one tensors."""

    hf_moe_block = "mlp."
    """HF module holding the router (`gate`) and the `experts`, relative to the layer."""
    hf_expert_projections = ("gate_proj", "up_proj", "down_proj")
    """HF names of each expert's gate, up and down projections."""
    hf_shared_expert: Optional[str] = None
    """HF module of the shared expert(s), relative to the layer: one SwiGLU MLP (`{gate,up,down}_proj`)
    of width `moe_shared_expert_intermediate_size` that every token passes through, Megatron's
    `mlp.shared_experts.` (`linear_fc1` = [gate; up], `linear_fc2` = down); None: no shared expert."""
    sparse_layer_extras: tuple[tuple[str, str, Callable[[Any], tuple[int, ...]]], ...] = ()
    """Further tensors of a sparse layer's MLP, each renamed as it is: (HF name, Megatron name, its
    shape given the architecture), names relative to the layer (Qwen2-MoE's shared-expert gate,
    GLM-4.5's router bias). Every expert-parallel rank reads them."""

    def _hf_expert_pattern(self) -> re.Pattern:
        return re.compile(re.escape(self.hf_moe_block) + r"experts\.(\d+)\.")

    @staticmethod
    def _sparse(arch: Any, prefix: str) -> bool:
        return arch.is_sparse_layer(_layer(prefix))

    def mlp_hf_names(self, arch: Any, prefix: str, experts: Optional[Iterable[int]] = None) -> set[str]:
        if not self._sparse(arch, prefix):  # a dense layer: every expert-parallel rank reads it all
            return super().mlp_hf_names(arch, prefix)  # type: ignore[misc]
        block = prefix + self.hf_moe_block
        names = {block + "gate.weight"}  # the router is replicated: every rank needs it
        for e in range(arch.num_experts) if experts is None else experts:
            names |= {block + f"experts.{e}.{p}.weight" for p in self.hf_expert_projections}
        if self.hf_shared_expert:  # replicated over expert-parallel ranks, like a dense MLP
            names |= {f"{prefix}{self.hf_shared_expert}{p}_proj.weight" for p in ("gate", "up", "down")}
        return names | {prefix + hf_name for hf_name, _, _ in self.sparse_layer_extras}

    def mlp_to_megatron(self, hf: dict[str, Tensor], h: str, m: str, arch: Any) -> dict[str, Tensor]:
        import torch
        if not self._sparse(arch, h):
            return super().mlp_to_megatron(hf, h, m, arch)  # type: ignore[misc]
        gate, up, down = self.hf_expert_projections
        block = h + self.hf_moe_block
        out = {m + "mlp.router.weight": hf[block + "gate.weight"]}
        for e in _experts(hf, h, self._hf_expert_pattern()):
            src, dst = f"{block}experts.{e}.", f"{m}mlp.experts.local_experts.{e}."
            out[dst + "linear_fc1.weight"] = torch.cat([hf[src + f"{gate}.weight"], hf[src + f"{up}.weight"]], dim=0)
            out[dst + "linear_fc2.weight"] = hf[src + f"{down}.weight"]
        if self.hf_shared_expert:
            src, dst = h + self.hf_shared_expert, m + "mlp.shared_experts."
            out[dst + "linear_fc1.weight"] = torch.cat([hf[src + "gate_proj.weight"], hf[src + "up_proj.weight"]])
            out[dst + "linear_fc2.weight"] = hf[src + "down_proj.weight"]
        out.update({m + meg_name: hf[h + hf_name] for hf_name, meg_name, _ in self.sparse_layer_extras})
        return out

    def mlp_to_hf(self, meg: dict[str, Tensor], h: str, m: str, arch: Any) -> dict[str, Tensor]:
        if not self._sparse(arch, h):
            return super().mlp_to_hf(meg, h, m, arch)  # type: ignore[misc]
        gate, up, down = self.hf_expert_projections
        block = h + self.hf_moe_block
        out = {block + "gate.weight": meg[m + "mlp.router.weight"]}
        for e in _experts(meg, m, _MEG_EXPERT):
            src, dst = f"{m}mlp.experts.local_experts.{e}.", f"{block}experts.{e}."
            out[dst + f"{gate}.weight"], out[dst + f"{up}.weight"] = meg[src + "linear_fc1.weight"].chunk(2, dim=0)
            out[dst + f"{down}.weight"] = meg[src + "linear_fc2.weight"]
        if self.hf_shared_expert:
            src, dst = m + "mlp.shared_experts.", h + self.hf_shared_expert
            out[dst + "gate_proj.weight"], out[dst + "up_proj.weight"] = meg[src + "linear_fc1.weight"].chunk(2)
            out[dst + "down_proj.weight"] = meg[src + "linear_fc2.weight"]
        out.update({h + hf_name: meg[m + meg_name] for hf_name, meg_name, _ in self.sparse_layer_extras})
        return out

    def hf_memory_slot(self, name: str, arch: Any) -> tuple[str, tuple]:
        """transformers >= 5 holds every family's block as `mlp.` in memory, the router as
        `mlp.gate.weight` and the experts fused: `mlp.experts.gate_up_proj` [E, 2I, H] (each
        expert's [gate; up]) and `mlp.experts.down_proj` [E, H, I]. A hub expert tensor is one
        slice of those, so weight updates can be copied in piece by piece."""
        match = re.match(r"^(model\.layers\.\d+\.)" + re.escape(self.hf_moe_block)
                         + r"(?:gate|experts\.(\d+)\.(\w+))\.weight$", name)
        if match is None:
            return name, ()
        layer, expert, projection = match.groups()
        if expert is None:
            return layer + "mlp.gate.weight", ()
        gate, up, down = self.hf_expert_projections
        e, width = int(expert), arch.moe_ffn_hidden_size
        if projection == down:
            return layer + "mlp.experts.down_proj", (e,)
        if projection not in (gate, up):
            raise ValueError(f"{name}: unknown expert projection {projection!r} (expected {gate}, {up} or {down})")
        rows = slice(0, width) if projection == gate else slice(width, 2 * width)
        return layer + "mlp.experts.gate_up_proj", (e, rows)

    def expected_hf_shapes(self, arch: Any, names: Iterable[str]) -> dict[str, tuple[int, ...]]:
        names = list(names)
        shapes = super().expected_hf_shapes(arch, names)  # type: ignore[misc]  (the dense converter's)
        hidden, width = arch.hidden_size, arch.moe_ffn_hidden_size
        down = f".{self.hf_expert_projections[2]}.weight"
        shared = arch.moe_shared_expert_intermediate_size
        for n in names:
            if n.endswith(self.hf_moe_block + "gate.weight"):
                shapes[n] = (arch.num_experts, hidden)
            elif f".{self.hf_moe_block}experts." in n:
                shapes[n] = (hidden, width) if n.endswith(down) else (width, hidden)
            elif self.hf_shared_expert and f".{self.hf_shared_expert}" in n:
                shapes[n] = (hidden, shared) if n.endswith("down_proj.weight") else (shared, hidden)
            for hf_name, _, shape in self.sparse_layer_extras:
                if n.endswith("." + hf_name):
                    shapes[n] = shape(arch)
        return shapes
