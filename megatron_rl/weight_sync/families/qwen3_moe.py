"""Qwen3-MoE: Qwen3 attention (per-head q/k RMSNorm, explicit head_dim) with a mixture of SwiGLU
experts in place of every MLP.

HF on disk (the hub layout `save_pretrained` writes; in memory `transformers` fuses the experts):
`mlp.gate.weight` [E, H] is the router, `mlp.experts.{e}.{gate,up,down}_proj.weight` the
experts. Megatron (SequentialMLP, `moe_grouped_gemm=False`): `mlp.router.weight` [E, H] and
`mlp.experts.local_experts.{e}.linear_fc1.weight` = [gate; up], `linear_fc2.weight` = down. In a
full Megatron state dict `e` is the global expert index; `weight_sync.sharding` renumbers it
per expert-parallel rank. Like the dense layout, conversions work on whatever subset of
experts they are given (an expert-parallel rank reads only its own).

Routing (softmax over all experts, top-k, renormalised when `norm_topk_prob`) is Megatron's
`moe_router_score_function="softmax"` with `moe_router_pre_softmax=not norm_topk_prob`.
Refused: dense layers among the sparse ones (`mlp_only_layers`, `decoder_sparse_step` != 1)
and shared experts, which Qwen3-MoE checkpoints do not have.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from megatron_rl.weight_sync.families import register
from megatron_rl.weight_sync.families.qwen3 import Qwen3Converter

Tensor = torch.Tensor
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.")
_MEG_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.")


def _experts(names: Iterable[str], prefix: str, pattern: re.Pattern) -> list[int]:
    """Expert indices among `names` of the layer under `prefix`."""
    return sorted({int(m.group(1)) for n in names if n.startswith(prefix) and (m := pattern.match(n, len(prefix)))})


@register
class Qwen3MoeConverter(Qwen3Converter):
    family = "qwen3_moe"
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"

    def config_dict(self, arch: Any, eos_token_id: int = 0) -> dict[str, Any]:
        cfg = super().config_dict(arch, eos_token_id)
        cfg.update(
            num_experts=arch.num_experts,
            num_experts_per_tok=arch.moe_router_topk,
            moe_intermediate_size=arch.moe_ffn_hidden_size,
            norm_topk_prob=arch.moe_norm_topk_prob,
            router_aux_loss_coef=arch.moe_aux_loss_coeff,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            output_router_logits=False,
        )
        return cfg

    def arch_from_config(self, hf: dict[str, Any], where: Path) -> dict[str, Any]:
        if hf.get("mlp_only_layers"):
            raise ValueError(f"{where}: mlp_only_layers={hf['mlp_only_layers']} is not supported "
                             "(dense MLP layers between MoE layers); only mlp_only_layers=[] is")
        if hf.get("decoder_sparse_step", 1) != 1:
            raise ValueError(f"{where}: decoder_sparse_step={hf['decoder_sparse_step']} is not supported "
                             "(dense MLP layers between MoE layers); only decoder_sparse_step=1 is")
        if hf.get("shared_expert_intermediate_size"):
            raise ValueError(f"{where}: shared_expert_intermediate_size={hf['shared_expert_intermediate_size']} "
                             "(shared experts) is not supported")
        # transformers >= 5 writes num_experts under its standard name num_local_experts
        num_experts = hf.get("num_experts", hf.get("num_local_experts"))
        if not num_experts:
            raise ValueError(f"{where}: num_experts={num_experts!r}: a qwen3_moe checkpoint needs experts")
        arch = super().arch_from_config(hf, where)
        arch.update(
            num_experts=num_experts,
            moe_ffn_hidden_size=hf["moe_intermediate_size"],
            moe_router_topk=hf["num_experts_per_tok"],
            moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),  # transformers' default
        )
        return arch

    # -- one layer's MLP ----------------------------------------------------------------------
    def mlp_hf_names(self, arch: Any, prefix: str, experts: Optional[Iterable[int]] = None) -> set[str]:
        names = {prefix + "mlp.gate.weight"}  # the router is replicated: every rank needs it
        for e in range(arch.num_experts) if experts is None else experts:
            names |= {prefix + f"mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")}
        return names

    def mlp_to_megatron(self, hf: dict[str, Tensor], h: str, m: str, arch: Any) -> dict[str, Tensor]:
        out = {m + "mlp.router.weight": hf[h + "mlp.gate.weight"]}
        for e in _experts(hf, h, _HF_EXPERT):
            src, dst = f"{h}mlp.experts.{e}.", f"{m}mlp.experts.local_experts.{e}."
            out[dst + "linear_fc1.weight"] = torch.cat([hf[src + "gate_proj.weight"], hf[src + "up_proj.weight"]],
                                                       dim=0)
            out[dst + "linear_fc2.weight"] = hf[src + "down_proj.weight"]
        return out

    def mlp_to_hf(self, meg: dict[str, Tensor], h: str, m: str, arch: Any) -> dict[str, Tensor]:
        out = {h + "mlp.gate.weight": meg[m + "mlp.router.weight"]}
        for e in _experts(meg, m, _MEG_EXPERT):
            src, dst = f"{m}mlp.experts.local_experts.{e}.", f"{h}mlp.experts.{e}."
            gate, up = meg[src + "linear_fc1.weight"].chunk(2, dim=0)
            out[dst + "gate_proj.weight"], out[dst + "up_proj.weight"] = gate, up
            out[dst + "down_proj.weight"] = meg[src + "linear_fc2.weight"]
        return out

    def expected_hf_shapes(self, arch: Any, names: Iterable[str]) -> dict[str, tuple[int, ...]]:
        names = list(names)
        shapes = super().expected_hf_shapes(arch, names)
        hidden, width = arch.hidden_size, arch.moe_ffn_hidden_size
        for n in names:
            if n.endswith("mlp.gate.weight"):
                shapes[n] = (arch.num_experts, hidden)
            elif ".mlp.experts." in n:
                shapes[n] = (hidden, width) if n.endswith("down_proj.weight") else (width, hidden)
        return shapes
