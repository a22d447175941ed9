"""The weight path of disaggregated mode: the trainer's weight sync, broadcast to the generators.

Trainer side, `BroadcastSink` implements the engine's `update_weights(named_tensors, version,
flush)`, so `weight_sync.stream.sync_weights` drives it exactly as it drives a colocated
engine (same TP gather, PP stages, HF names and layouts, buckets): each bucket's names,
shapes and dtypes go to the group's store under `v<version>/b<i>`, then its bytes go out in
one broadcast over the `WeightUpdateGroup` (gloo on CPU, NCCL on GPU).

Generator side, `WeightReceiver.poll()` is called between generation chunks: when the first
bucket of the next version is announced in the store it joins the broadcasts, bucket by
bucket, and loads each into its engine with `engine.update_weights(bucket, version, flush)`.
With rollout.weight_sync=adapters (a LoRA run) the trainer sends the frozen base weights once, then
each version's adapters alone: `sync_adapters` into the sink's `update_adapters`, one bucket of
`<module>.lora_A` / `.lora_B` tensors that the receiver hands to `engine.update_adapters`.
The trainer blocks in the broadcast until every generator has joined, i.e. at most one
generation chunk (`rollout.partial_rollout_tokens`) or, without partial rollouts, one request.

The store is a TCPStore: it takes connections from any client, without credentials. So what
the trainer writes to it (the bucket metadata, the start signal) is JSON, never a pickle, and
carries an HMAC-SHA256 keyed by a key derived from the hub's (`channel.Hub.key`, which every
generator has: from its spawn arguments or `hub.json`), bound to the value's store key; a
receiver refuses a value whose MAC does not match, then one whose JSON is not exactly what a
sink writes (`WeightStoreError`), before sizing a buffer from it. Not covered: the bucket bytes
themselves travel over the process group, whose connections (gloo's or NCCL's, set up through
the same store's rendezvous keys) are not authenticated; see docs/rollout.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import math
import time
from typing import Any, Callable, Iterable, Optional

import torch

from megatron_rl.weight_sync.stream import BucketMeta, bucket_bytes_of, pack_bucket, unpack_bucket

logger = logging.getLogger(__name__)

# the dtypes a bucket may hold, by the names the metadata uses (torch's, without "torch.")
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in (
        "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if isinstance(getattr(torch, name, None), torch.dtype)}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAC_HEX = 64  # hex digits of an HMAC-SHA256


class WeightStoreError(RuntimeError):
    """A value in the weight store that this run's trainer did not write, or not in its format."""


def _key(version: int, bucket: int) -> str:
    return f"v{version}/b{bucket}"


def _mac(hub_key: bytes, name: str, payload: bytes) -> str:
    # a key of its own (not the hub's), and the value's store key under the MAC: a genuine value
    # copied to another key (another version's or bucket's) does not verify there
    store_key = hmac.new(hub_key, b"megatron_rl.disagg weight store", hashlib.sha256).digest()
    return hmac.new(store_key, name.encode() + b"\0" + payload, hashlib.sha256).hexdigest()


def signed_set(store: Any, hub_key: bytes, name: str, payload: bytes) -> None:
    """Set `name` to `payload` with its MAC (`<64 hex digits>\\n<payload>`)."""
    store.set(name, _mac(hub_key, name, payload).encode() + b"\n" + payload)


def signed_get(store: Any, hub_key: bytes, name: str) -> bytes:
    """The payload of `name` (blocks until it is set); raises WeightStoreError unless its MAC verifies."""
    value = bytes(store.get(name))
    mac, newline, payload = value[:_MAC_HEX], value[_MAC_HEX:_MAC_HEX + 1], value[_MAC_HEX + 1:]
    expected = _mac(hub_key, name, payload).encode()
    if newline != b"\n" or not hmac.compare_digest(mac, expected):
        raise WeightStoreError(f"weight store value {name!r} failed authentication: it was not written by this "
                               "run's trainer (the store accepts any client on its network; another process "
                               "set it, or a trainer of another run shares the address); refusing it")
    return payload


def _malformed(name: str, why: str) -> WeightStoreError:
    return WeightStoreError(f"weight store value {name!r} is malformed: {why}")


ADAPTER_SUFFIXES = (".lora_A", ".lora_B")  # an adapter bucket's tensor names: <HF module>.lora_A / .lora_B


def _adapter_modules(names: list[str]) -> list[str]:
    """The modules of an adapter bucket's tensor names, read off every A (decode_bucket checks the pairs)."""
    return [n[:-len(ADAPTER_SUFFIXES[0])] for n in names[::2]]


@dataclasses.dataclass(frozen=True)
class Bucket:
    """What a bucket's metadata says. A weight bucket: `flush` (the version's weights are complete) and,
    on the flushing bucket, `adapters_follow` (an adapter bucket of the same version comes next). An
    adapter bucket (`lora_scaling` set: alpha / r) holds each module's A and B and ends the version."""

    meta: BucketMeta
    flush: bool
    adapters_follow: bool = False
    lora_scaling: Optional[float] = None

    @property
    def ends_version(self) -> bool:
        return self.lora_scaling is not None or (self.flush and not self.adapters_follow)


def encode_bucket(meta: BucketMeta, flush: bool, adapters_follow: bool = False,
                  lora_scaling: Optional[float] = None) -> bytes:
    """A bucket's metadata as JSON: {"flush": bool, "tensors": [[name, shape, dtype name], ...]}, with
    "adapters_follow": true on a flushing weight bucket an adapter bucket follows; an adapter bucket is
    {"lora_scaling": number, "tensors": [...]}."""
    for _, _, dtype in meta:
        if dtype not in _NAMES:
            raise ValueError(f"a weight of dtype {dtype} cannot be sent to the generators: allowed dtypes are "
                             f"{', '.join(DTYPES)}")
    tensors = [[name, [int(n) for n in shape], _NAMES[dtype]] for name, shape, dtype in meta]
    if lora_scaling is not None:
        doc: dict[str, Any] = {"lora_scaling": float(lora_scaling), "tensors": tensors}
    else:
        doc = {"flush": bool(flush), "tensors": tensors}
        if adapters_follow:
            if not flush:
                raise ValueError("adapters_follow is for the bucket that completes the weights (flush=True)")
            doc["adapters_follow"] = True
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_bucket(payload: bytes, name: str) -> Bucket:
    """`encode_bucket`'s inverse, checked field by field (raises WeightStoreError naming the problem)."""
    try:
        doc = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _malformed(name, f"not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise _malformed(name, f"must be an object, got {type(doc).__name__}")
    shapes = ({"flush", "tensors"}, {"flush", "tensors", "adapters_follow"}, {"lora_scaling", "tensors"})
    if set(doc) not in shapes:
        raise _malformed(name, "keys must be exactly flush, tensors (and adapters_follow), or lora_scaling, tensors; "
                         f"got {', '.join(sorted(map(str, doc)))}")
    scaling = doc.get("lora_scaling")
    if "lora_scaling" in doc and not (type(scaling) in (int, float) and math.isfinite(scaling) and scaling > 0):
        raise _malformed(name, f"lora_scaling must be a finite number > 0, got {scaling!r}")
    for key in ("flush", "adapters_follow"):
        if key in doc and not isinstance(doc[key], bool):
            raise _malformed(name, f"{key} must be true or false, got {doc[key]!r}")
    if doc.get("adapters_follow") is False or (doc.get("adapters_follow") and not doc["flush"]):
        raise _malformed(name, "adapters_follow must be true, and only on a bucket with flush true")
    if not isinstance(doc["tensors"], list):
        raise _malformed(name, "tensors must be a list")
    meta: BucketMeta = []
    for i, entry in enumerate(doc["tensors"]):
        if not isinstance(entry, list) or len(entry) != 3:
            raise _malformed(name, f"tensor {i} must be [name, shape, dtype], got {entry!r}")
        tensor, shape, dtype = entry
        if not isinstance(tensor, str):
            raise _malformed(name, f"tensor {i}: name must be a string, got {tensor!r}")
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise _malformed(name, f"tensor {tensor!r}: shape must be a list of integers >= 0, got {shape!r}")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise _malformed(name, f"tensor {tensor!r}: unknown dtype {dtype!r} (allowed: {', '.join(DTYPES)})")
        meta.append((tensor, tuple(shape), DTYPES[dtype]))
    if scaling is not None:
        names = [tensor for tensor, _, _ in meta]
        modules = _adapter_modules(names)
        if names != [m + suffix for m in modules for suffix in ADAPTER_SUFFIXES]:
            raise _malformed(name, "an adapter bucket's tensors must be <module>.lora_A, <module>.lora_B pairs")
        return Bucket(meta, True, lora_scaling=float(scaling))
    return Bucket(meta, doc["flush"], adapters_follow=doc.get("adapters_follow", False))


def read_start(store: Any, hub_key: bytes, name: str) -> int:
    """The first weight version, from the trainer's start signal (`signed_set(.., str(version))`)."""
    payload = signed_get(store, hub_key, name)
    if not payload.isdigit():
        raise _malformed(name, f"must be a weight version (a non-negative integer), got {payload[:40]!r}")
    return int(payload)


class BroadcastSink:
    """The trainer's end: an `update_weights` / `update_adapters` target that broadcasts each bucket to the
    generators. `hub_key`: the hub's key (`channel.Hub.key`), which authenticates the metadata in the store.
    Set `adapters_follow` before a full weight update that `update_adapters` completes (rollout.weight_sync=
    adapters: the base weights, then their adapters, one version)."""

    def __init__(self, group: Any, store: Any, hub_key: bytes) -> None:
        self.group, self.store, self.hub_key = group, store, hub_key
        self.weight_version = -1
        self.adapters_follow = False
        self._bucket = 0
        self._version: Optional[int] = None
        self._sent: Optional[tuple[int, int]] = None  # (version, buckets) of the last complete update

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       flush: bool = True) -> None:
        follow = flush and self.adapters_follow
        self._send(list(named_tensors), version, flush=flush, adapters_follow=follow)
        if flush and not follow:
            self._sent_all(version)

    def update_adapters(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float,
                        version: int) -> None:
        """The engine's `update_adapters`, in one bucket: {HF module: (A [r, in], B [out, r])}, alpha / r."""
        tensors = [(module + suffix, t) for module, pair in adapters.items()
                   for suffix, t in zip(ADAPTER_SUFFIXES, pair)]
        self._send(tensors, version, flush=True, lora_scaling=scaling)
        self.adapters_follow = False
        self._sent_all(version)

    def _send(self, tensors: list[tuple[str, torch.Tensor]], version: int, **fields: Any) -> None:
        if version != self._version:
            self._version, self._bucket = version, 0
        meta, flat = pack_bucket(tensors)
        signed_set(self.store, self.hub_key, _key(version, self._bucket), encode_bucket(meta, **fields))
        self.group.broadcast(flat.to(self.group.device), src=0)
        self._bucket += 1

    def _sent_all(self, version: int) -> None:
        if self._sent is not None:  # every member has read the previous update's keys by now
            for bucket in range(self._sent[1]):
                self.store.delete_key(_key(self._sent[0], bucket))
        self._sent = (version, self._bucket)
        self.weight_version = version


class WeightReceiver:
    """A generator's end: joins the broadcasts of the next version and loads them into `engine`.
    `hub_key`: the hub's key, which the metadata in the store must be authenticated with;
    `progress()` runs after each bucket (the generator's progress clock)."""

    def __init__(self, group: Any, store: Any, engine: Any, hub_key: bytes,
                 on_update: Optional[Callable[[int, float, float], None]] = None,
                 progress: Callable[[], None] = lambda: None) -> None:
        self.group, self.store, self.engine, self.hub_key = group, store, engine, hub_key
        self.on_update = on_update  # (version, start, end), for the generator's timeline
        self.progress = progress
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
            name = _key(version, bucket)
            got = decode_bucket(signed_get(self.store, self.hub_key, name), name)
            flat = torch.empty(bucket_bytes_of(got.meta), dtype=torch.uint8, device=self.group.device)
            self.group.broadcast(flat, src=0)
            tensors = unpack_bucket(got.meta, flat)
            if got.lora_scaling is None:
                self.engine.update_weights(tensors, version, flush=got.flush)
            else:
                pairs = [t for _, t in tensors]
                modules = _adapter_modules([n for n, _ in tensors])
                self.engine.update_adapters(dict(zip(modules, zip(pairs[::2], pairs[1::2]))), got.lora_scaling,
                                            version)
            self.progress()
            bucket += 1
            if got.ends_version:
                break
        self.version = version
        if self.on_update is not None:
            self.on_update(version, start, time.time())
        logger.info("weights v%d received in %d buckets (%.3fs)", version, bucket, time.time() - start)
