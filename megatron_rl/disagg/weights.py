"""The weight path of disaggregated mode: the trainer's weight sync, broadcast to the generators.

Trainer side, `BroadcastSink` implements the engine's `update_weights(named_tensors, version,
flush)`, so `weight_sync.stream.sync_weights` drives it exactly as it drives a colocated
engine (same TP gather, PP stages, HF names and layouts, buckets): each bucket's names,
shapes and dtypes go to the group's store under `v<version>/b<i>`, then its bytes go out in
one broadcast over the `WeightUpdateGroup` (gloo on CPU, NCCL on GPU).

Generator side, `WeightReceiver.poll()` is called between generation chunks: when the first
bucket of the next version is announced in the store it joins the broadcasts, bucket by
bucket, and loads each into its engine with `engine.update_weights(bucket, version, flush)`.
The trainer blocks in the broadcast until every generator has joined, i.e. at most one
generation chunk (`rollout.partial_rollout_tokens`) or, without partial rollouts, one request.
"""

from __future__ import annotations

import logging
import pickle
import time
from typing import Any, Callable, Iterable, Optional

import torch

from megatron_rl.weight_sync.stream import bucket_bytes_of, pack_bucket, unpack_bucket

logger = logging.getLogger(__name__)


def _key(version: int, bucket: int) -> str:
    return f"v{version}/b{bucket}"


class BroadcastSink:
    """The trainer's end: an `update_weights` target that broadcasts each bucket to the generators."""

    def __init__(self, group: Any, store: Any) -> None:
        self.group, self.store = group, store
        self.weight_version = -1
        self._bucket = 0
        self._version: Optional[int] = None
        self._sent: Optional[tuple[int, int]] = None  # (version, buckets) of the last complete update

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       flush: bool = True) -> None:
        tensors = list(named_tensors)
        if version != self._version:
            self._version, self._bucket = version, 0
        meta, flat = pack_bucket(tensors)
        self.store.set(_key(version, self._bucket), pickle.dumps((meta, flush)))
        self.group.broadcast(flat.to(self.group.device), src=0)
        self._bucket += 1
        if flush:  # every member has read the previous update's keys by now
            if self._sent is not None:
                for bucket in range(self._sent[1]):
                    self.store.delete_key(_key(self._sent[0], bucket))
            self._sent = (version, self._bucket)
            self.weight_version = version


class WeightReceiver:
    """A generator's end: joins the broadcasts of the next version and loads them into `engine`."""

    def __init__(self, group: Any, store: Any, engine: Any,
                 on_update: Optional[Callable[[int, float, float], None]] = None) -> None:
        self.group, self.store, self.engine = group, store, engine
        self.on_update = on_update  # (version, start, end), for the generator's timeline
        self.version = -1

    def poll(self) -> bool:
        """Apply the next version if the trainer has announced it; True if one was applied."""
        if not self.store.check([_key(self.version + 1, 0)]):
            return False
        self.receive(self.version + 1)
        return True

    def receive(self, version: int) -> None:
        """Join every bucket broadcast of `version` (blocks until the trainer sends them)."""
        start = time.time()
        bucket = 0
        while True:
            meta, flush = pickle.loads(self.store.get(_key(version, bucket)))
            flat = torch.empty(bucket_bytes_of(meta), dtype=torch.uint8, device=self.group.device)
            self.group.broadcast(flat, src=0)
            self.engine.update_weights(unpack_bucket(meta, flat), version, flush=flush)
            bucket += 1
            if flush:
                break
        self.version = version
        if self.on_update is not None:
            self.on_update(version, start, time.time())
        logger.info("weights v%d received in %d buckets (%.3fs)", version, bucket, time.time() - start)
