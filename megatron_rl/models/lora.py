"""LoRA: low-rank adapters on the GPT model's linear layers, tensor- and sequence-parallel.

`attach_lora(model, model_cfg, groups)` gives every targeted linear of this rank's stage (`model.lora_targets`:
linear_qkv, linear_proj, linear_fc1, linear_fc2 of the attention and the dense MLPs; experts.linear_fc1 and
experts.linear_fc2 of each routed expert this rank holds; shared_experts.linear_fc1 and .linear_fc2 of the
shared experts, a dense MLP to Megatron) an adapter: the layer then returns W x + (alpha / rank) B A x. A
starts random (PEFT's Kaiming-uniform), B at zero, so a model with fresh adapters computes what its base
weights compute. Only the adapters train (`trainable`); the engine
receives merged weights W + (alpha / rank) B A (`weight_sync.sharding` asks `merged_weight`), so rollouts
need no adapter support.

Sharding follows the base layer's: a column-parallel linear (W split along its outputs) has A whole on every
tensor-parallel rank and B split like W; a row-parallel one (W split along its inputs) has A split like W and
B whole. So `B_local A_local` is exactly this rank's shard of the merged update, and the checkpoint holds A
and B with Megatron's sharding (`LoRAAdapter.sharded_state_dict`; linear_fc1's B like SwiGLU's fc1).
Communication mirrors the layer's own, on the rank-wide A x instead of the hidden-wide activations: a column
adapter all-gathers A x over the sequence-parallel ranks (or, without sequence parallelism, all-reduces its
gradient: each rank's B sees part of the outputs); a row adapter reduce-scatters A x (or all-reduces it: each
rank sees part of the inputs). Under sequence parallelism the TP-whole factor (a column adapter's A, a row
adapter's B) sees this rank's tokens only, so its gradient is summed over the TP ranks like the norms'.

A routed expert's linears (Megatron's SequentialMLP: one MLP per local expert) are split over the expert
tensor-parallel ranks (parallel.etp) and do no communication of their own: the token dispatcher gives every
rank of an expert's group the same tokens and sums the group's partial outputs (and, backward, its partial
input gradients). So an expert adapter communicates no activations either: a column adapter's B_local A x
and a row adapter's B A_local x_local are partial outputs like the layer's, summed by the dispatcher. Only
the group-whole factor's gradient (a column adapter's A, a row adapter's B) is then a partial sum, which is
all-reduced over the group in the backward pass (`_summed_grad`). Each expert's A is drawn from its global
expert index, and each adapter carries its expert weight's `allreduce` tag: where the experts are expert
parameters to Megatron's DDP and optimizer (EP > 1, or etp != tp: models/gpt.py), so are their adapters,
reduced over the expert-data-parallel ranks; each expert-parallel rank trains its own experts' adapters.

The adapter runs as a forward hook of the linear it adapts (the input is the hook's argument, the output
(y, bias) gets the adapter's term), so the layer specs and their fused kernels stay Megatron's, under the
local spec and Transformer Engine's alike; TE's linear_qkv / linear_fc1 fuse the norm before them, whose
output the adapter recomputes from the layer's own norm weights.

Written here rather than taken from a library: PEFT adapts torch.nn.Linear and HF modules, not Megatron-core's
tensor-parallel layers, and Megatron-Bridge (which has PEFT for Megatron) is not among this project's
dependencies.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Optional

import torch
import torch.nn.functional as F

from megatron_rl.parallel.state import ParallelGroups

Tensor = torch.Tensor
COLUMN = ("linear_qkv", "linear_fc1")  # W split along its outputs
ROW = ("linear_proj", "linear_fc2")  # W split along its inputs
EXPERTS = "experts."  # model.lora_targets "experts.linear_fc1": linear_fc1 of every routed expert
SHARED = "shared_experts."  # "shared_experts.linear_fc1": the shared experts' (split over TP like a dense MLP)
SUFFIX = "_lora"  # the adapter of `parent.linear_qkv` is `parent.linear_qkv_lora`


class LoRAAdapter(torch.nn.Module):
    """The adapter of one linear layer; `forward(x)` is its term of the layer's output."""

    def __init__(self, target: str, linear: torch.nn.Module, rank: int, alpha: float, groups: ParallelGroups,
                 sequence_parallel: bool, glu: bool, full_a: Tensor, expert: bool = False) -> None:
        super().__init__()
        self.target, self.rank, self.scale, self.expert = target, rank, alpha / rank, expert
        self.column = target in COLUMN
        self.glu = glu and target == "linear_fc1"
        # an expert's linear is split over the expert tensor-parallel group, any other over the TP group
        tp_rank = groups.etp_rank if expert else groups.tp_rank
        self.tp_group = groups.etp_group if expert else groups.tp_group
        self.tp_size = groups.etp_size if expert else groups.tp_size
        self.sequence_parallel = sequence_parallel and self.tp_size > 1 and not expert
        self.norm = _fused_norm(linear)
        weight = linear.weight
        out_local, in_local = weight.shape
        a = full_a if self.column else full_a.chunk(self.tp_size, dim=1)[tp_rank]
        self.a = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
        self.b = torch.nn.Parameter(torch.zeros(out_local, rank, device=weight.device, dtype=weight.dtype))
        if self.a.shape[1] != in_local:
            raise ValueError(f"LoRA {target}: A has {self.a.shape[1]} inputs, the layer's weight {in_local}")
        # Megatron's attributes, read by its optimizer (grad-norm counts), the checkpoint and weight sync: the
        # split factor is this module's own (sharded_state_dict), the TP-whole one is identical on every rank.
        split, whole = (self.b, self.a) if self.column else (self.a, self.b)
        split.tensor_model_parallel, split.partition_dim, split.partition_stride = self.tp_size > 1, \
            0 if self.column else 1, 1
        whole.tensor_model_parallel = False
        if expert:  # as the expert's weight: Megatron marks it split even when etp is 1, and its DDP reduces it
            # over the expert-data-parallel ranks when experts are split over expert-parallel ones
            split.tensor_model_parallel = bool(getattr(weight, "tensor_model_parallel", False))
            whole.tensor_model_parallel = split.tensor_model_parallel and self.tp_size == 1
            for param in (self.a, self.b):
                param.allreduce = getattr(weight, "allreduce", True)
        # Under sequence parallelism the TP-whole factor sees only this rank's tokens (forward): its gradient is
        # a sum over the TP ranks, which finalize_model_grads forms for parameters marked so (as for the norms).
        whole.sequence_parallel = self.sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        from megatron.core.tensor_parallel import mappings

        if self.norm is not None:
            x = self.norm(x)
        if self.expert:  # partial outputs like the expert's own, summed by the token dispatcher
            a, b = self.a, self.b
            if self.tp_size > 1:  # the group-whole factor's gradient is a partial sum over the group
                a, b = (_summed_grad(a, self.tp_group), b) if self.column else (a, _summed_grad(b, self.tp_group))
            return F.linear(F.linear(x, a), b) * self.scale
        h = F.linear(x, self.a)  # rank-wide [tokens, r]: the communication below moves r columns, not hidden
        if self.column:
            if self.sequence_parallel:  # this rank's tokens -> all of them; backward: reduce-scatter (B_local
                # gives each rank part of every token's gradient of A x)
                h = mappings.gather_from_sequence_parallel_region(h, group=self.tp_group)
            elif self.tp_size > 1:  # B_local sees part of the outputs: sum the ranks' gradients of A x
                h = mappings.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
            return F.linear(h, self.b) * self.scale
        # row: A_local sees this rank's inputs only, so A x is a partial sum over the TP ranks
        if self.sequence_parallel:  # as the layer's reduce-scatter: summed, this rank's part of the sequence
            h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
        elif self.tp_size > 1:
            h = mappings.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return F.linear(h, self.b) * self.scale

    @torch.no_grad()
    def merged(self, weight: Tensor) -> Tensor:
        """W + (alpha / rank) B A for this rank's shard W of the layer's weight, summed in fp32, in W's dtype."""
        return torch.addmm(weight.float(), self.b.float(), self.a.float(), alpha=self.scale).to(weight.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        groups = {"tp_group": self.tp_group, "dp_cp_group": metadata["dp_cp_group"]} \
            if metadata and metadata.get("dp_cp_group") is not None else {}  # as Megatron's linear layers
        sharded = make_sharded_tensors_for_checkpoint(state, prefix, {"b": 0} if self.column else {"a": 1},
                                                      sharded_offsets, **groups)
        if self.glu:  # B's rows are this rank's gate rows, then its up rows, as linear_fc1's weight
            singleton = (metadata or {}).get("singleton_local_shards", False)
            sharded[f"{prefix}b"] = apply_swiglu_sharded_factory(sharded[f"{prefix}b"], sharded_offsets, singleton)
        return sharded


def _summed_grad(param: Tensor, group: Any) -> Tensor:
    """`param` itself forward; backward, its gradient all-reduced over `group`."""
    from megatron.core.tensor_parallel import mappings

    return mappings.copy_to_tensor_model_parallel_region(param, group=group)


class _Norm(torch.nn.Module):
    """The norm Transformer Engine fuses into a LayerNormColumnParallelLinear, recomputed from its weights."""

    def __init__(self, linear: torch.nn.Module) -> None:
        super().__init__()
        self.linear = [linear]  # not a submodule: its parameters are the layer's
        config = linear.config
        self.rms = config.normalization == "RMSNorm"
        self.eps = config.layernorm_epsilon
        self.zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))

    def forward(self, x: Tensor) -> Tensor:
        linear = self.linear[0]
        weight = linear.layer_norm_weight.float() + (1.0 if self.zero_centered else 0.0)
        xf = x.float()
        if self.rms:
            out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * weight
        else:
            bias = getattr(linear, "layer_norm_bias", None)
            out = F.layer_norm(xf, (xf.shape[-1],), weight, None if bias is None else bias.float(), self.eps)
        return out.to(x.dtype)


def _fused_norm(linear: torch.nn.Module) -> Optional[_Norm]:
    return _Norm(linear) if getattr(linear, "layer_norm_weight", None) is not None else None


def _hook(adapter: LoRAAdapter):
    def add_adapter_term(module: torch.nn.Module, args: tuple, output: Any) -> Any:
        out, bias = output  # Megatron's linears return (output, bias or None)
        return out + adapter(args[0]), bias
    return add_adapter_term


def _full_a(seed: int, layer: int, target: str, rank: int, in_features: int) -> Tensor:
    """A's full value (the same on every rank that holds a part of it): Kaiming-uniform like PEFT's and
    torch.nn.Linear's, from a generator seeded by (seed, global layer, target; an expert's target names its
    global index, "experts.3.linear_fc1")."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{layer}/{target}".encode()))
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on a [rank, in] weight
    return (torch.rand(rank, in_features, generator=gen, dtype=torch.float32) * 2 - 1) * bound


def attach_lora(model: torch.nn.Module, model_cfg: Any, groups: ParallelGroups) -> list[LoRAAdapter]:
    """Adapters on this stage's targeted linears (before DDP wraps the model); returns them in module order."""
    config = model.config
    adapters: list[LoRAAdapter] = []

    def attach(parent: torch.nn.Module, target: str, layer: int, expert: Optional[int],
               key: Optional[str] = None) -> None:
        linear = getattr(parent, target, None)
        if linear is None:  # a layer with experts (for the dense targets), multi-latent attention
            return
        tp_size = groups.tp_size if expert is None else groups.etp_size
        in_features = linear.weight.shape[1] * (tp_size if target in ROW else 1)
        key = key or (target if expert is None else f"{EXPERTS}{expert}.{target}")
        full_a = _full_a(model_cfg.init_seed, layer, key, model_cfg.lora_rank, in_features)
        adapter = LoRAAdapter(target, linear, model_cfg.lora_rank, model_cfg.lora_alpha, groups,
                              config.sequence_parallel, config.gated_linear_unit, full_a, expert=expert is not None)
        parent.add_module(target + SUFFIX, adapter)
        linear.register_forward_hook(_hook(adapter))
        linear.__dict__["lora_adapter"] = adapter  # for merged_weight; not a second submodule
        adapters.append(adapter)

    for layer in getattr(getattr(model, "decoder", None), "layers", []):
        index = layer.layer_number - 1
        for parent_name in ("self_attention", "mlp"):
            parent = getattr(layer, parent_name, None)
            for target in model_cfg.lora_targets:
                if parent is not None and not target.startswith((EXPERTS, SHARED)):
                    attach(parent, target, index, None)
        shared = getattr(getattr(layer, "mlp", None), "shared_experts", None)
        for target in model_cfg.lora_targets:
            if shared is not None and target.startswith(SHARED):
                attach(shared, target.removeprefix(SHARED), index, None, key=target)
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is None:  # a dense layer
            continue
        local = getattr(experts, "local_experts", None)
        if local is None and any(t.startswith(EXPERTS) for t in model_cfg.lora_targets):
            raise ValueError(f"LoRA on experts needs one MLP module per expert (Megatron's SequentialMLP, "
                             f"moe_grouped_gemm=False); layer {index}'s experts are a {type(experts).__name__}")
        if local is None:
            continue
        first = groups.ep_rank * len(local)  # this rank's experts are first, first + 1, ... (global indices)
        for j, expert_mlp in enumerate(local):
            for target in model_cfg.lora_targets:
                if target.startswith(EXPERTS):
                    attach(expert_mlp, target.removeprefix(EXPERTS), index, first + j)
    embedding = getattr(model, "embedding", None)  # the first stage's
    if embedding is not None and model_cfg.recompute == "full":
        embedding.register_forward_hook(_input_requires_grad)
    return adapters


def _input_requires_grad(module: torch.nn.Module, args: tuple, output: Tensor) -> Tensor:
    """The frozen embedding's output, marked as needing a gradient. Full activation recomputation checkpoints
    each block with an autograd function whose output needs a gradient only if an input does: from a frozen
    embedding none would, and no adapter inside would get a gradient."""
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)
    return output


def is_adapter_param(name: str) -> bool:
    """A parameter name (local or global) of an adapter."""
    return any(f".{t}{SUFFIX}." in name for t in (*COLUMN, *ROW))


def trainable(model: torch.nn.Module) -> None:
    """Freeze everything but the adapters."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_param(name))


def adapter_of(module: torch.nn.Module, name: str) -> Optional[LoRAAdapter]:
    """The adapter of `module`'s parameter `name` (an adapted linear's weight), or None."""
    # attach_lora's attribute; not getattr, for which nn.Module raises (and catches) per miss
    return module.__dict__.get("lora_adapter") if name == "weight" else None


def merged_weight(module: torch.nn.Module, name: str, param: Tensor) -> Tensor:
    """`param` (named `name` in `module`) as the engine and HF checkpoints see it: W + (alpha / rank) B A for an
    adapted linear's weight, the parameter itself otherwise."""
    adapter = adapter_of(module, name)
    return param.detach() if adapter is None else adapter.merged(param.detach())


def peft_tensors(adapters: dict[str, tuple[Tensor, Tensor]],
                 dtype: Optional[torch.dtype] = None) -> dict[str, Tensor]:
    """HF modules' adapters {"model.layers.3.self_attn.q_proj": (A, B)} as PEFT's tensors
    ("base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight", ...). Each a contiguous copy: q, k and v
    share A, and B's parts are views of one tensor (safetensors and SGLang's flattened buckets refuse both)."""
    tensors: dict[str, Tensor] = {}
    for module, (lora_a, lora_b) in adapters.items():
        for name, value in (("lora_A", lora_a), ("lora_B", lora_b)):
            value = value.to(dtype) if dtype is not None else value
            tensors[f"base_model.model.{module}.{name}.weight"] = value.clone().contiguous()
    return tensors


def peft_config(rank: int, alpha: float, modules: list[str], base_model: str) -> dict[str, Any]:
    """PEFT's adapter_config.json of adapters on `modules` (full HF module names)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": rank, "lora_alpha": alpha, "target_modules": sorted(modules), "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True}


@torch.no_grad()
def reset_adapters(model: torch.nn.Module) -> None:
    """B = 0: the model computes its base weights again (after they were set to a merged state dict)."""
    for module in model.modules():
        if isinstance(module, LoRAAdapter):
            module.b.zero_()
