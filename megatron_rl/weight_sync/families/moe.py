"""The mixture-of-experts MLP layout shared by Qwen3-MoE and Mixtral: a router and SwiGLU experts
in place of every MLP. Families mix `SparseMoeLayout` into their attention converter and name
where the block lives and what its three expert projections are called.

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
from typing import Any, Iterable, Optional

import torch

Tensor = torch.Tensor
_MEG_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.")


def _experts(names: Iterable[str], prefix: str, pattern: re.Pattern) -> list[int]:
    """Expert indices among `names` of the layer under `prefix`."""
    return sorted({int(m.group(1)) for n in names if n.startswith(prefix) and (m := pattern.match(n, len(prefix)))})


class SparseMoeLayout:
    """MLP conversion for a decoder whose every layer is a mixture of SwiGLU experts; mixed in
    before a `DenseDecoderConverter` subclass, whose attention and embedding layout it keeps."""

    hf_moe_block = "mlp."
    """HF module holding the router (`gate`) and the `experts`, relative to the layer."""
    hf_expert_projections = ("gate_proj", "up_proj", "down_proj")
    """HF names of each expert's gate, up and down projections."""

    def _hf_expert_pattern(self) -> re.Pattern:
        return re.compile(re.escape(self.hf_moe_block) + r"experts\.(\d+)\.")

    def mlp_hf_names(self, arch: Any, prefix: str, experts: Optional[Iterable[int]] = None) -> set[str]:
        block = prefix + self.hf_moe_block
        names = {block + "gate.weight"}  # the router is replicated: every rank needs it
        for e in range(arch.num_experts) if experts is None else experts:
            names |= {block + f"experts.{e}.{p}.weight" for p in self.hf_expert_projections}
        return names

    def mlp_to_megatron(self, hf: dict[str, Tensor], h: str, m: str, arch: Any) -> dict[str, Tensor]:
        gate, up, down = self.hf_expert_projections
        block = h + self.hf_moe_block
        out = {m + "mlp.router.weight": hf[block + "gate.weight"]}
        for e in _experts(hf, h, self._hf_expert_pattern()):
            src, dst = f"{block}experts.{e}.", f"{m}mlp.experts.local_experts.{e}."
            out[dst + "linear_fc1.weight"] = torch.cat([hf[src + f"{gate}.weight"], hf[src + f"{up}.weight"]], dim=0)
            out[dst + "linear_fc2.weight"] = hf[src + f"{down}.weight"]
        return out

    def mlp_to_hf(self, meg: dict[str, Tensor], h: str, m: str, arch: Any) -> dict[str, Tensor]:
        gate, up, down = self.hf_expert_projections
        block = h + self.hf_moe_block
        out = {block + "gate.weight": meg[m + "mlp.router.weight"]}
        for e in _experts(meg, m, _MEG_EXPERT):
            src, dst = f"{m}mlp.experts.local_experts.{e}.", f"{block}experts.{e}."
            out[dst + f"{gate}.weight"], out[dst + f"{up}.weight"] = meg[src + "linear_fc1.weight"].chunk(2, dim=0)
            out[dst + f"{down}.weight"] = meg[src + "linear_fc2.weight"]
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
        for n in names:
            if n.endswith(self.hf_moe_block + "gate.weight"):
                shapes[n] = (arch.num_experts, hidden)
            elif f".{self.hf_moe_block}experts." in n:
                shapes[n] = (hidden, width) if n.endswith(down) else (width, hidden)
        return shapes
