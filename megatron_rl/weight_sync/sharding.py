"""Between a full (unsharded) Megatron state dict and this rank's TP/PP/EP shard of it.

Which dimension a parameter is split along comes from Megatron's own parameter
attributes (`tensor_model_parallel`, `partition_dim`); the exceptions are SwiGLU's fused
`linear_fc1`, whose gate and up halves are split separately, an expert's down projection, which
Transformer Engine tags wrongly (`_partition_dim`), and layer numbering, which is
local to a pipeline stage (`decoder.layers.0` on stage 1 is global layer
`num_layers / pp`). With tied embeddings and PP > 1 the last stage holds its own copy of
the embedding as `output_layer.weight`. Names are the local layer spec's (`canonical_name`). A model with
LoRA adapters gathers as its merged weights (or, asked so, its base weights) and loads into its base weights
(`local_tensors`); `gather_adapters` gathers the adapters themselves.

Experts (`mlp.experts.local_experts.{j}`): expert-parallel rank r holds the global experts
[r * E / ep, (r + 1) * E / ep) as local experts 0 .. E / ep - 1, each split over the expert
tensor-parallel group like a dense MLP. A full state dict names experts by global index.
"""

from __future__ import annotations

import re
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron_rl.models.lora import SUFFIX, LoRAAdapter, merged_weight, reset_adapters
from megatron_rl.parallel.state import ParallelGroups

Tensor = torch.Tensor
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def layer_offset(model: torch.nn.Module) -> int:
    """Global index of this stage's first transformer layer."""
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    if layers is None or len(layers) == 0:
        return 0
    return layers[0].layer_number - 1


def num_local_experts(model: torch.nn.Module, groups: ParallelGroups) -> int:
    return (model.config.num_moe_experts or 0) // groups.ep_size


def global_name(local: str, offset: int, expert_offset: int = 0) -> str:
    """Stage-local layer number -> global; with `expert_offset`, local expert index -> global."""
    match = _LAYER.match(local)
    if match is None:
        return local
    name = f"decoder.layers.{int(match.group(1)) + offset}." + local[match.end():]
    if expert_offset:
        name = _EXPERT.sub(lambda m: f".mlp.experts.local_experts.{int(m.group(1)) + expert_offset}.", name)
    return name


def _is_expert(name: str) -> bool:
    # By name: Megatron tags expert params `allreduce=False` only when ep > 1
    # (tensor_parallel/layers.py:886), but their TP group is the expert one at any ep.
    return _EXPERT.search(name) is not None


def _is_glu_fc1(name: str, model: torch.nn.Module) -> bool:
    # dense `mlp.linear_fc1` and each expert's `mlp.experts.local_experts.{j}.linear_fc1` (and its bias: gpt-oss)
    return name.endswith(("linear_fc1.weight", "linear_fc1.bias")) and model.config.gated_linear_unit


def _tp_coords(name: str, groups: ParallelGroups) -> tuple[int, int, dist.ProcessGroup]:
    """(size, rank, group) of the tensor-parallel group that splits this parameter."""
    if _is_expert(name):
        return groups.etp_size, groups.etp_rank, groups.etp_group
    return groups.tp_size, groups.tp_rank, groups.tp_group


def _partition_dim(name: str, param: Tensor) -> int:
    """The dimension a tensor-parallel parameter is split along: its `partition_dim`, except an expert's down
    projection, split along its inputs (1) but tagged 0 by Transformer Engine. Megatron builds an expert's TE
    linears with parallel_mode=None (it does their communication itself: extensions/transformer_engine.py,
    explicit_expert_comm), and TE tags every weight of a linear that is not "row" with dim 0."""
    if _is_expert(name) and name.endswith("linear_fc2.weight"):
        return 1
    return param.partition_dim


def _split(full: Tensor, dim: int, size: int, rank: int, glu: bool) -> Tensor:
    if glu:
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(size, dim=dim)[rank], up.chunk(size, dim=dim)[rank]], dim=dim)
    return full.chunk(size, dim=dim)[rank]


# The Transformer Engine spec fuses a layer's norms into the linear after them
# (TELayerNormColumnParallelLinear): (its parameter name, the local spec's). Under multi-latent
# attention the input norm stays apart and the latent norms fuse into the up projections.
_TE_FUSED_NORMS = ((".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
                   (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
                   (".self_attention.linear_q_up_proj.layer_norm_weight", ".self_attention.q_layernorm.weight"),
                   (".self_attention.linear_kv_up_proj.layer_norm_weight", ".self_attention.kv_layernorm.weight"))


def canonical_name(name: str) -> str:
    """A parameter's name in the local layer spec, which the converters use, whichever spec built it.
    (A mixture of experts' sparse layers keep `pre_mlp_layernorm` under both specs.)"""
    for fused, local in _TE_FUSED_NORMS:
        if name.endswith(fused):
            return name[: -len(fused)] + local
    return name


# GLM-4.5's per-expert selection bias: part of the weights (HF e_score_correction_bias), which
# Megatron holds as a buffer of the router since its optimizer never touches it.
WEIGHT_BUFFERS = (".router.expert_bias",)


def local_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, str, Tensor]]:
    """(name, owning module, attribute, tensor): the stage's parameters (each once) and weight buffers in module
    order, so that a layer's tensors come together (weight sync converts a layer at a time). LoRA adapters are
    no weights of their own: an adapted linear's weight gathers merged with its adapter (`_stage_tensors`)."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        if isinstance(module, LoRAAdapter):
            continue
        prefix = module_name + "." if module_name else ""
        for name, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield canonical_name(prefix + name), module, name, p
        for name, b in module.named_buffers(recurse=False):
            if (prefix + name).endswith(WEIGHT_BUFFERS):
                yield prefix + name, module, name, b


def _source_name(name: str, full: dict[str, Tensor]) -> str:
    if name == "output_layer.weight" and name not in full:
        return "embedding.word_embeddings.weight"  # tied embeddings, last stage's copy
    return name


@torch.no_grad()
def load_full_state_dict(model: torch.nn.Module, full: dict[str, Tensor], groups: ParallelGroups) -> None:
    """Copy this rank's shard of `full` into `model` (a GPTModel stage, not DDP-wrapped).

    Raises ValueError naming the first missing tensor or shape mismatch. LoRA adapters restart at B = 0: the
    model then computes `full`, which is a merged state dict (`gather_full_state_dict`) or a base model's.
    """
    offset = layer_offset(model)
    expert_offset = groups.ep_rank * num_local_experts(model, groups)
    reset_adapters(model)
    for name, _, _, param in local_tensors(model):
        src = _source_name(global_name(name, offset, expert_offset), full)
        if src not in full:
            raise ValueError(f"weights are missing tensor {src!r} needed by parameter {name!r}")
        tensor = full[src]
        tp_size, tp_rank, _ = _tp_coords(name, groups)
        if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
            tensor = _split(tensor, _partition_dim(name, param), tp_size, tp_rank, _is_glu_fc1(name, model))
        if tensor.shape != param.shape:
            raise ValueError(f"tensor {src!r} has shape {tuple(full[src].shape)}, which does not fit "
                             f"parameter {name!r} of shape {tuple(param.shape)} at tp={groups.tp_size}, "
                             f"ep={groups.ep_size}")
        param.copy_(tensor.to(param.dtype))


def _gather_tp(name: str, param: Tensor, tensor: Tensor, model: torch.nn.Module, groups: ParallelGroups) -> Tensor:
    """`tensor` (this rank's shard, sharded as `param`) gathered over its tensor-parallel group."""
    tensor = tensor.detach()
    tp_size, _, tp_group = _tp_coords(name, groups)
    if not (getattr(param, "tensor_model_parallel", False) and tp_size > 1):
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(tp_size)]
    dist.all_gather(parts, tensor.contiguous(), group=tp_group)
    dim = _partition_dim(name, param)
    if _is_glu_fc1(name, model):
        halves = [p.chunk(2, dim=dim) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves], dim=dim),
                          torch.cat([h[1] for h in halves], dim=dim)], dim=dim)
    return torch.cat(parts, dim=dim)


def is_gathered(name: str, param: Tensor, groups: ParallelGroups) -> bool:
    """Whether `gathered` all-gathers this parameter (split over TP ranks, or an expert at EP > 1)."""
    tp_size = _tp_coords(name, groups)[0]
    return (getattr(param, "tensor_model_parallel", False) and tp_size > 1) or (groups.ep_size > 1 and _is_expert(name))


def gathered(name: str, param: Tensor, value: Tensor, model: torch.nn.Module, groups: ParallelGroups) -> list[Tensor]:
    """The full tensors this rank's `value` of `param` (local name `name`) is part of: TP shards all-gathered,
    and an expert's all-gathered over EP (one tensor per EP rank, in rank order: the local expert of each)."""
    tensor = _gather_tp(name, param, value, model, groups)
    if groups.ep_size > 1 and _is_expert(name):
        # every EP rank holds the same local names: gather them in EP-rank order
        parts = [torch.empty_like(tensor) for _ in range(groups.ep_size)]
        dist.all_gather(parts, tensor.contiguous(), group=groups.ep_group)
        return parts
    return [tensor]


def _stage_tensors(model: torch.nn.Module, groups: ParallelGroups,
                   merged: bool) -> Iterator[tuple[str, Tensor, int, int]]:
    """(global name, full tensor, i, j): the j-th full tensor that the i-th of `local_tensors` becomes
    (`gathered`), its value merged with its LoRA adapter (models/lora.py: W + (alpha / rank) B A) if `merged`."""
    offset = layer_offset(model)
    num_local = num_local_experts(model, groups)
    for i, (name, module, attribute, param) in enumerate(local_tensors(model)):
        value = merged_weight(module, attribute, param) if merged else param
        for j, tensor in enumerate(gathered(name, param, value, model, groups)):
            yield global_name(name, offset, j * num_local), tensor, i, j


@torch.no_grad()
def gathered_stage_params(model: torch.nn.Module, groups: ParallelGroups,
                          merged: bool = True) -> Iterator[tuple[str, Tensor]]:
    """This stage's parameters one at a time as full tensors with global names: TP shards
    all-gathered, experts all-gathered over EP (every rank of the stage yields the same). An adapted
    linear's weight is the merged one, or with `merged` False the frozen base weight."""
    for name, tensor, _, _ in _stage_tensors(model, groups, merged):
        yield name, tensor


@torch.no_grad()
def stage_layers(model: torch.nn.Module, groups: ParallelGroups,
                 merged: bool = True) -> Iterator[list[tuple[str, Tensor, int, int]]]:
    """`gathered_stage_params` a transformer layer at a time (the embedding, the final norm and the output layer
    each alone), which the converters convert on their own; each tensor as (global name, tensor, i, j): the j-th
    full tensor (one per EP rank for an expert) of the i-th of `local_tensors`."""
    layer: list[tuple[str, Tensor, int, int]] = []
    current: Optional[int] = None
    for entry in _stage_tensors(model, groups, merged):
        match = _LAYER.match(entry[0])
        index = int(match.group(1)) if match else None
        if layer and index != current:
            yield layer
            layer = []
        current = index
        layer.append(entry)
        if index is None:
            yield layer
            layer = []
    if layer:
        yield layer


@torch.no_grad()
def gather_full_state_dict(model: torch.nn.Module, groups: ParallelGroups, merged: bool = True) -> dict[str, Tensor]:
    """The full state dict on every rank: TP all-gather, EP all-gather of experts, then PP
    exchange of stage tensors (`merged`: see `gathered_stage_params`).

    Meant for checks and small models: it materialises the whole model on each rank.
    Weight sync streams instead (`megatron_rl.weight_sync.stream`).
    """
    stage = {name: tensor.cpu().clone() for name, tensor in gathered_stage_params(model, groups, merged)}
    if groups.pp_size == 1:
        return stage
    full: dict[str, Tensor] = {}
    for part in _all_stages(stage, groups):
        for key, value in part.items():
            if key == "output_layer.weight" and model.config.pipeline_model_parallel_size > 1 \
                    and getattr(model, "share_embeddings_and_output_weights", False):
                continue  # the last stage's copy of the tied embedding
            full[key] = value
    return full


def _all_stages(stage: dict, groups: ParallelGroups) -> list[dict]:
    """Every pipeline stage's `stage` dict, in stage order, on every rank."""
    stages: list[dict | None] = [None] * groups.pp_size
    dist.all_gather_object(stages, stage, group=groups.pp_group)
    return stages


@torch.no_grad()
def gather_adapters(model: torch.nn.Module, groups: ParallelGroups) -> dict[str, tuple[Tensor, Tensor]]:
    """Every LoRA adapter of the model as full factors on every rank: {global name of the adapted weight
    ("decoder.layers.3.self_attention.linear_qkv.weight"): (A [rank, in], B [out, rank])}, so that the update
    is (alpha / rank) B A on the weight as `gather_full_state_dict` names and lays it out. The split factor
    (a column layer's B, a row layer's A) is gathered like the layer's weight: linear_fc1's B as SwiGLU's
    gate rows, then its up rows."""
    offset = layer_offset(model)
    stage = {}
    for module_name, module in model.named_modules():
        if isinstance(module, LoRAAdapter):
            if module.expert:  # the configuration refuses this (rollout.weight_sync=adapters, export --adapter)
                raise ValueError(f"{module_name}: experts' adapters reach engines and HF exports merged only")
            weight = module_name[: -len(SUFFIX)] + ".weight"
            a, b = (_gather_tp(weight, p, p, model, groups).cpu().clone() for p in (module.a, module.b))
            stage[global_name(weight, offset)] = (a, b)
    if groups.pp_size == 1:
        return stage
    return {key: value for part in _all_stages(stage, groups) for key, value in part.items()}
