"""Weight sync: stream the trainer's weights into rollout engines as HF-named tensors.

Per pipeline stage in turn, one transformer layer at a time: the stage's ranks all-gather
the layer's tensor-parallel shards (and expert-parallel experts), convert the full layer
to HF names and layouts (QKV and gate/up splits) with the family's converter, and group
the results into buckets of about `bucket_bytes`. Other stages receive each bucket by
broadcast over the pipeline group. Every rank that owns an engine loads each bucket as it
arrives, so neither the full model nor a second copy of it is ever materialised. Each
update is stamped with a version; time and bytes/s are returned. An engine in the trainer's own
process (the hf backend) at PP=1 needs no HF tensors at all: it is written in place (`in_place.py`).

A LoRA model sends its merged weights W + (alpha / r) B A, or (`rollout.weight_sync=adapters`) its frozen
base weights once (`merged=False`) and then only its adapters (`sync_adapters`): the engine adds
(alpha / r) B A x itself, and a step's sync moves r (in + out) numbers per adapted module instead of the model.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_rl.parallel.state import ParallelGroups
from megatron_rl.families import get_converter
from megatron_rl.rollout.base import InPlaceEngine
from megatron_rl.weight_sync.in_place import sync_in_place
from megatron_rl.weight_sync.sharding import gather_adapters, stage_layers

logger = logging.getLogger(__name__)
Tensor = torch.Tensor


@dataclasses.dataclass
class SyncStats:
    version: int
    num_tensors: int
    num_bytes: int
    num_buckets: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / max(self.seconds, 1e-9) / 1e9

    def metrics(self) -> dict[str, float]:
        return {"sync/seconds": self.seconds, "sync/gb_per_s": self.gb_per_s, "sync/bytes": float(self.num_bytes)}


def _stage_hf_tensors(model: torch.nn.Module, groups: ParallelGroups, arch: Any,
                      merged: bool = True) -> Iterator[tuple[str, Tensor]]:
    """This stage's weights in HF names, a layer at a time (TP/EP-gathered, full tensors)."""
    converter = get_converter(arch.family)
    for layer in stage_layers(model, groups, merged):
        # the last stage's copy of a tied embedding (PP > 1) is not sent
        meg = {name: tensor for name, tensor, _, _ in layer
               if not (name == "output_layer.weight" and arch.tie_word_embeddings)}
        for name, tensor in converter.megatron_to_hf(meg, arch).items():
            # A tied lm_head is the embedding (converters write it for checkpoints): engines take it from
            # model.embed_tokens.weight, so sending it would move the vocabulary's rows twice.
            if not (name == "lm_head.weight" and arch.tie_word_embeddings):
                yield name, tensor


def _buckets(tensors: Iterator[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in tensors:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


BucketMeta = list[tuple[str, tuple[int, ...], torch.dtype]]


def pack_bucket(bucket: list[tuple[str, Tensor]]) -> tuple[BucketMeta, Tensor]:
    """A bucket as (names, shapes and dtypes; its bytes in one flat uint8 tensor): tensors keep their
    own dtype (GLM-4.5's fp32 router bias beside bf16 weights)."""
    meta = [(name, tuple(t.shape), t.dtype) for name, t in bucket]
    return meta, torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for _, t in bucket])


def bucket_bytes_of(meta: BucketMeta) -> int:
    return sum(int(torch.Size(shape).numel()) * dtype.itemsize for _, shape, dtype in meta)


def unpack_bucket(meta: BucketMeta, flat: Tensor) -> list[tuple[str, Tensor]]:
    """`pack_bucket`'s inverse (a part whose offset does not suit its dtype is copied first)."""
    out, offset = [], 0
    for name, shape, dtype in meta:
        width = dtype.itemsize
        size = int(torch.Size(shape).numel()) * width
        part = flat[offset:offset + size]
        out.append((name, (part if offset % width == 0 else part.clone()).view(dtype).view(shape)))
        offset += size
    return out


def _broadcast_bucket(bucket: Optional[list[tuple[str, Tensor]]], src: int,
                      groups: ParallelGroups) -> Optional[list[tuple[str, Tensor]]]:
    """Send one bucket from pipeline stage `src` (global rank) to the other stages; None ends."""
    packed = None if bucket is None else pack_bucket(bucket)
    meta = [None if packed is None else packed[0]]
    dist.broadcast_object_list(meta, src=src, group=groups.pp_group)
    if meta[0] is None:
        return None
    if packed is not None:
        flat = packed[1].to(groups.device)
    else:
        flat = torch.empty(bucket_bytes_of(meta[0]), dtype=torch.uint8, device=groups.device)
    dist.broadcast(flat, src=src, group=groups.pp_group)
    if bucket is not None:
        return bucket
    return unpack_bucket(meta[0], flat)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def sync_weights(model: torch.nn.Module, groups: ParallelGroups, arch: Any, engine: Any, version: int,
                 bucket_bytes: int = 256 * 2**20, merged: bool = True) -> SyncStats:
    """Push the model's current weights into `engine` (None on ranks that own no engine); a LoRA model's
    adapted weights merged, or with `merged` False its base weights.

    Every rank of the model-parallel group must call this (it contains collectives). An engine in this process
    (`InPlaceEngine`) at PP=1 is written in place (`in_place.py`: no buckets, `num_buckets` 0).
    """
    _synchronize(groups.device)  # the step's kernels still in flight are not the sync's time
    start = time.perf_counter()
    if groups.pp_size == 1 and isinstance(engine, InPlaceEngine):
        plan = sync_in_place(model, groups, arch, engine, version, merged)
        return _finish(SyncStats(version, plan.num_tensors, plan.num_bytes, 0, 0.0), start, groups)
    num_tensors = num_bytes = num_buckets = 0

    def deliver(bucket: list[tuple[str, Tensor]], last: bool) -> None:
        nonlocal num_tensors, num_bytes, num_buckets
        num_buckets += 1
        num_tensors += len(bucket)
        num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        if engine is not None:
            engine.update_weights(bucket, version, flush=last)

    pending: Optional[list[tuple[str, Tensor]]] = None  # delay one bucket to know which is last
    for stage in range(groups.pp_size):
        src = _stage_global_rank(groups, stage)
        mine = groups.pp_rank == stage
        stream = _buckets(_stage_hf_tensors(model, groups, arch, merged), bucket_bytes) if mine else None
        while True:
            bucket = next(stream, None) if mine else None
            if groups.pp_size > 1:
                bucket = _broadcast_bucket(bucket, src, groups)
            if bucket is None:
                break
            if pending is not None:
                deliver(pending, last=False)
            pending = bucket
    if pending is not None:
        deliver(pending, last=True)
    return _finish(SyncStats(version, num_tensors, num_bytes, num_buckets, 0.0), start, groups)


def _finish(stats: SyncStats, start: float, groups: ParallelGroups) -> SyncStats:
    _synchronize(groups.device)  # the engine's copies are queued on the GPU: the time is when they are done
    stats.seconds = time.perf_counter() - start
    logger.info("weight sync v%d: %d tensors, %.1f MB %s, %.3fs (%.2f GB/s)", stats.version, stats.num_tensors,
                stats.num_bytes / 1e6, f"in {stats.num_buckets} buckets" if stats.num_buckets else "in place",
                stats.seconds, stats.gb_per_s)
    return stats


@torch.no_grad()
def sync_adapters(model: torch.nn.Module, groups: ParallelGroups, arch: Any, engine: Any, version: int) -> SyncStats:
    """Push only the model's LoRA adapters into `engine` (None on ranks that own no engine), whose weights are
    the model's base weights (`sync_weights(..., merged=False)`): {HF module: (A [r, in], B [out, r])} as the
    family's converter names them (linear_qkv's adapter becomes q_proj's, k_proj's and v_proj's, each with the
    whole A and its rows of B), scaled by alpha / r; `version` takes effect. Every rank of the model-parallel
    group must call this (the adapters are gathered over TP and PP)."""
    _synchronize(groups.device)
    start = time.perf_counter()
    converter = get_converter(arch.family)
    adapters = {module: pair for weight, (a, b) in gather_adapters(model, groups).items()
                for module, pair in converter.adapter_to_hf(weight, a, b, arch).items()}
    if not adapters:
        raise ValueError("sync_adapters: the model has no LoRA adapters (model.lora_rank=0)")
    if engine is not None:
        engine.update_adapters(adapters, arch.lora_alpha / arch.lora_rank, version)
    num_bytes = sum(t.numel() * t.element_size() for pair in adapters.values() for t in pair)
    _synchronize(groups.device)
    stats = SyncStats(version, 2 * len(adapters), num_bytes, 1, time.perf_counter() - start)
    logger.info("adapter sync v%d: %d modules, %.3f MB, %.3fs", version, len(adapters), num_bytes / 1e6,
                stats.seconds)
    return stats


def _stage_global_rank(groups: ParallelGroups, stage: int) -> int:
    return dist.get_global_rank(groups.pp_group, stage) if groups.pp_size > 1 else groups.rank
