"""Weight sync into an engine in the trainer's process, in place: a plan of copies from views of the Megatron
tensors into views of the engine's parameters, made once per model.

The bucketed stream (`stream.py`) builds every HF tensor and hands it over by name, which an engine in another
process needs. An engine in this one (`rollout.base.InPlaceEngine`: the hf backend) has its parameters allocated
already, in the hub layout or a known slice of it (`hf_memory_slot`), so a sync can copy straight into them.

The first sync of a model builds the plan (`InPlacePlan.build`): the family's converter runs on the stage's
tensors a layer at a time, as in the stream, and each HF tensor it returns is traced back to the Megatron tensor
it is a view of (storage and offsets); where it is none (Q, K and V: the rows of every KV group; gpt-oss's
stacked experts), the converter's `in_place_views` gives views that fill it piece by piece. Each view is a copy
of the plan: its geometry in its Megatron tensor, and the engine region it fills. That sync copies through the
plan and checks the result: every HF tensor written piece by piece equals the converter's bit for bit in the
engine, every element of every Megatron tensor is copied exactly once, and (the engine's own check, `weight_targets`) every element of
every engine parameter is written exactly once. Any miss raises.

Every later sync only walks the plan: each parameter's value (TP / EP all-gathered and LoRA-merged as the
stream does it: the only new tensors), then `copy_` of each view into its engine view, which the engine keeps
until it releases its weights (a sync after a release makes the views again, copying nothing more). No HF
tensors, buckets, dicts or name lookups. Pipeline-parallel runs keep the stream: other stages' tensors arrive
by broadcast.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any, Optional

import torch

from megatron_rl.families import get_converter
from megatron_rl.models.lora import adapter_of
from megatron_rl.parallel.state import ParallelGroups
from megatron_rl.rollout.base import InPlaceEngine, WeightRegion, covered_once, region_view
from megatron_rl.weight_sync import sharding

logger = logging.getLogger(__name__)
Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class _Copy:
    """One copy of a sync: the view `value.as_strided(size, stride, value.storage_offset() + offset)` of a
    Megatron tensor's value (`whole`: the value itself) into the engine region `region`."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    whole: bool
    region: WeightRegion


@dataclasses.dataclass
class _Source:
    """A parameter or weight buffer of the stage (read from its module each sync: offloading may replace its
    storage) and, per full tensor its value becomes (one per expert-parallel rank for an expert), the layout the
    value must have and the copies it feeds."""

    name: str  # stage-local (sharding.local_tensors)
    module: torch.nn.Module
    attribute: str
    table: dict  # the module's _parameters or _buffers
    gathered: bool  # all-gathered over TP / EP each sync
    layouts: list[tuple[torch.Size, tuple[int, ...]]] = dataclasses.field(default_factory=list)
    copies: list[list[_Copy]] = dataclasses.field(default_factory=list)


# a full Megatron tensor of the layer being planned: (its value, its source, which of the source's full tensors)
_Entry = tuple[Tensor, _Source, int]


class InPlacePlan:
    """The copies of one model's weights into an engine's parameters (the module docstring)."""

    def __init__(self, family: str, sources: list[_Source], num_tensors: int, num_bytes: int) -> None:
        self.family = family
        self.sources = sources
        self.regions: list[WeightRegion] = [c.region for s in sources for copies in s.copies for c in copies]
        self.num_tensors = num_tensors  # HF tensors written
        self.num_bytes = num_bytes  # of the trainer's values, as the stream would send them

    @classmethod
    @torch.no_grad()
    def build(cls, model: torch.nn.Module, groups: ParallelGroups, arch: Any, engine: InPlaceEngine,
              merged: bool) -> "InPlacePlan":
        """The plan, made while syncing `model` into `engine` through it; every check of the module docstring."""
        converter = get_converter(arch.family)
        sources = [_Source(name, module, attribute, module._parameters if module._parameters.get(attribute) is tensor
                           else module._buffers, sharding.is_gathered(name, tensor, groups))
                   for name, module, attribute, tensor in sharding.local_tensors(model)]
        num_tensors = num_bytes = 0
        for entries in sharding.stage_layers(model, groups, merged):
            layer: dict[str, _Entry] = {}
            for name, value, i, j in entries:
                sources[i].layouts.append((value.shape, value.stride()))
                sources[i].copies.append([])
                layer[name] = (value, sources[i], j)
            meg = {name: value for name, (value, _, _) in layer.items()}
            used: dict[int, list[Tensor]] = {}  # id(value) -> the views copied from it
            for hf_name, tensor in converter.megatron_to_hf(meg, arch).items():
                # A tied lm_head is the embedding (converters write it for checkpoints): engines tie it themselves.
                if hf_name == "lm_head.weight" and arch.tie_word_embeddings:
                    continue
                slot = engine.weight_slot(hf_name)
                views = _views(hf_name, tensor, layer, meg, converter, arch)
                for (value, source, j), region, view in views:
                    target = region_view(slot, region)
                    if target.shape != view.shape:
                        raise ValueError(f"weight sync: the engine's {region} is {tuple(target.shape)}, its "
                                         f"Megatron view {tuple(view.shape)}")
                    target.copy_(view)
                    start = view.storage_offset() - value.storage_offset()
                    whole = start == 0 and view.shape == value.shape and view.stride() == value.stride()
                    source.copies[j].append(_Copy(tuple(view.shape), view.stride(), start, whole, region))
                    used.setdefault(id(value), []).append(view)
                if views[0][2] is not tensor and not torch.equal(slot, tensor.to(slot.dtype)):  # built from views
                    raise AssertionError(f"weight sync: the in-place copies of {hf_name} differ from the converter's")
                num_tensors += 1
                num_bytes += tensor.numel() * tensor.element_size()
            for name, (value, _, _) in layer.items():
                if not covered_once(value, used.get(id(value), [])):
                    raise ValueError(f"weight sync: the engine's tensors do not use each element of {name} exactly "
                                     f"once: {arch.family}'s converter must use every Megatron tensor, and once")
        plan = cls(arch.family, sources, num_tensors, num_bytes)
        engine.weight_targets(plan.regions, plan)  # the engine's own check: every parameter written once
        logger.info("weight sync in place: a plan of %d copies into %d engine tensors", len(plan.regions),
                    plan.num_tensors)
        return plan

    @torch.no_grad()
    def run(self, model: torch.nn.Module, groups: ParallelGroups, engine: InPlaceEngine, merged: bool) -> None:
        """Copy the model's current weights into `engine` (a LoRA model's merged ones with `merged`)."""
        targets = iter(engine.weight_targets(self.regions, self))
        for source in self.sources:
            tensor = source.table[source.attribute]
            adapter = adapter_of(source.module, source.attribute) if merged else None
            value = tensor if adapter is None else adapter.merged(tensor.detach())
            values = sharding.gathered(source.name, tensor, value, model, groups) if source.gathered else (value,)
            for value, (shape, stride), copies in zip(values, source.layouts, source.copies, strict=True):
                if value.shape != shape or value.stride() != stride:
                    raise RuntimeError(f"weight sync: {source.name} is {tuple(value.shape)} with strides "
                                       f"{value.stride()}, the in-place plan was made for {tuple(shape)}, {stride}")
                base = value.storage_offset()
                for copy in copies:
                    view = value if copy.whole else value.as_strided(copy.size, copy.stride, base + copy.offset)
                    next(targets).copy_(view)


def _views(hf_name: str, tensor: Tensor, layer: dict[str, _Entry], meg: dict[str, Tensor], converter: Any,
           arch: Any) -> list[tuple[_Entry, WeightRegion, Tensor]]:
    """The views of Megatron tensors that write the HF tensor `hf_name` (`tensor`, the converter's), each with the
    layer entry it views and the engine region it fills: `tensor` itself where it is a view of one, else the
    converter's `in_place_views`."""
    views = [(None, (), tensor)] if _owner(tensor, layer) else converter.in_place_views(hf_name, meg, arch)
    if views is None:
        raise ValueError(f"weight sync: {arch.family}'s {hf_name} is no view of one Megatron tensor, and its "
                         "converter's in_place_views gives none to write it in place")
    out = []
    for shape, index, view in views:
        entry = _owner(view, layer)
        if entry is None:
            raise ValueError(f"weight sync: a view that {arch.family}'s in_place_views gives for {hf_name} is no "
                             "view of one Megatron tensor")
        out.append((entry, (hf_name, shape, index), view))
    return out


def _owner(view: Tensor, layer: dict[str, _Entry]) -> Optional[_Entry]:
    """The entry of `layer` whose value `view` is a view of (same storage, within its elements), or None."""
    storage = view.untyped_storage().data_ptr()
    start, end = _span(view)
    for entry in layer.values():
        value = entry[0]
        if value.untyped_storage().data_ptr() == storage and value.dtype == view.dtype:
            first, last = _span(value)
            if first <= start and end <= last:
                return entry
    return None


def _span(t: Tensor) -> tuple[int, int]:
    """The storage elements `t` reaches: [first, last]."""
    first = t.storage_offset()
    return first, first + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


# one plan per model (it reads the model's modules each sync, and holds no engine memory)
_PLANS: "weakref.WeakKeyDictionary[torch.nn.Module, InPlacePlan]" = weakref.WeakKeyDictionary()


def sync_in_place(model: torch.nn.Module, groups: ParallelGroups, arch: Any, engine: InPlaceEngine, version: int,
                  merged: bool = True) -> InPlacePlan:
    """Copy the model's weights into `engine` through the model's plan (made by this call the first time);
    `version` takes effect. Every rank of the model-parallel group must call this or `stream.sync_weights` (both
    all-gather the same tensors in the same order)."""
    plan = _PLANS.get(model)
    if plan is None or plan.family != arch.family:
        plan = _PLANS[model] = InPlacePlan.build(model, groups, arch, engine, merged)
    else:
        plan.run(model, groups, engine, merged)
    engine.weights_written(version, plan)
    return plan

