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

Every bucket carries a checksum (`weight_sync.checksum.bucket_digest`, in its metadata). A generator hashes
the bytes it received and acknowledges each bucket in the store (`v<version>/b<i>/a<attempt>/g<rank>`: ok,
corrupt, or missing); only when every generator said ok does the trainer write `done` (`.../d<attempt>`) and
the generators load the bucket. Otherwise it writes `send` and broadcasts the bucket again, up to
`max_resends` times, then `fail`: both ends raise, and no generator has loaded a byte of that bucket.
With `delta` (rollout.weight_sync_delta) the trainer keeps, per weight bucket, the names, shapes, dtypes and
digest that every generator acknowledged last; a bucket equal to that is announced as `unchanged` and not
broadcast. A generator that does not hold exactly that bucket (a receiver that never got it) answers
`missing`, and the bucket is sent after all. Adapter buckets are always sent (they change every step).

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
import itertools
import json
import logging
import math
import re
import time
from typing import Any, Callable, Iterable, Optional

import torch

from megatron_rl.weight_sync.checksum import DIGEST_SIZE, bucket_digest
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
_DIGEST = re.compile(f"[0-9a-f]{{{2 * DIGEST_SIZE}}}")
MAX_RESENDS = 3  # a bucket that fails its checksum this many times more is an error, not bad luck
ACKS = ("ok", "corrupt", "missing")  # a generator's answer to a bucket
DECISIONS = ("done", "send", "fail")  # the trainer's, once every generator answered


class WeightStoreError(RuntimeError):
    """A value in the weight store that this run's trainer did not write, or not in its format."""


def _key(version: int, bucket: int) -> str:
    return f"v{version}/b{bucket}"


def _ack_key(version: int, bucket: int, attempt: int, rank: int) -> str:
    return f"{_key(version, bucket)}/a{attempt}/g{rank}"


def _decision_key(version: int, bucket: int, attempt: int) -> str:
    return f"{_key(version, bucket)}/d{attempt}"


def _read_word(store: Any, hub_key: bytes, name: str, allowed: tuple[str, ...]) -> str:
    payload = signed_get(store, hub_key, name)
    word = payload.decode("ascii", errors="replace")
    if word not in allowed:
        raise _malformed(name, f"must be one of {', '.join(allowed)}, got {payload[:40]!r}")
    return word


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
    digest: str = ""  # weight_sync.checksum.bucket_digest of the bytes
    unchanged: bool = False  # not broadcast: the generators hold these bytes already (delta sync)

    @property
    def ends_version(self) -> bool:
        return self.lora_scaling is not None or (self.flush and not self.adapters_follow)


def encode_bucket(meta: BucketMeta, digest: str, flush: bool, adapters_follow: bool = False,
                  lora_scaling: Optional[float] = None, unchanged: bool = False) -> bytes:
    """A bucket's metadata as JSON: {"flush": bool, "tensors": [[name, shape, dtype name], ...], "digest": hex},
    with "adapters_follow": true on a flushing weight bucket an adapter bucket follows and "unchanged": true on a
    weight bucket that is not broadcast (delta sync); an adapter bucket is {"lora_scaling": number, "tensors":
    [...], "digest": hex}."""
    if not _DIGEST.fullmatch(digest):
        raise ValueError(f"digest must be {2 * DIGEST_SIZE} lowercase hex digits (bucket_digest), got {digest!r}")
    for _, _, dtype in meta:
        if dtype not in _NAMES:
            raise ValueError(f"a weight of dtype {dtype} cannot be sent to the generators: allowed dtypes are "
                             f"{', '.join(DTYPES)}")
    tensors = [[name, [int(n) for n in shape], _NAMES[dtype]] for name, shape, dtype in meta]
    if lora_scaling is not None:
        if unchanged:
            raise ValueError("an adapter bucket is always sent (unchanged is for weight buckets)")
        doc: dict[str, Any] = {"lora_scaling": float(lora_scaling), "tensors": tensors, "digest": digest}
    else:
        doc = {"flush": bool(flush), "tensors": tensors, "digest": digest}
        if adapters_follow:
            if not flush:
                raise ValueError("adapters_follow is for the bucket that completes the weights (flush=True)")
            doc["adapters_follow"] = True
        if unchanged:
            doc["unchanged"] = True
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_bucket(payload: bytes, name: str) -> Bucket:
    """`encode_bucket`'s inverse, checked field by field (raises WeightStoreError naming the problem)."""
    try:
        doc = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _malformed(name, f"not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise _malformed(name, f"must be an object, got {type(doc).__name__}")
    weights = {"flush", "tensors", "digest"}
    shapes = (weights, weights | {"adapters_follow"}, weights | {"unchanged"},
              weights | {"adapters_follow", "unchanged"}, {"lora_scaling", "tensors", "digest"})
    if set(doc) not in shapes:
        raise _malformed(name, "keys must be exactly flush, tensors, digest (and adapters_follow, unchanged), or "
                         f"lora_scaling, tensors, digest; got {', '.join(sorted(map(str, doc)))}")
    if not isinstance(doc["digest"], str) or not _DIGEST.fullmatch(doc["digest"]):
        raise _malformed(name, f"digest must be {2 * DIGEST_SIZE} lowercase hex digits, got {doc['digest']!r}")
    if "unchanged" in doc and doc["unchanged"] is not True:
        raise _malformed(name, f"unchanged must be true where present, got {doc['unchanged']!r}")
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
        return Bucket(meta, True, lora_scaling=float(scaling), digest=doc["digest"])
    return Bucket(meta, doc["flush"], adapters_follow=doc.get("adapters_follow", False), digest=doc["digest"],
                  unchanged=doc.get("unchanged", False))


def read_start(store: Any, hub_key: bytes, name: str) -> int:
    """The first weight version, from the trainer's start signal (`signed_set(.., str(version))`)."""
    payload = signed_get(store, hub_key, name)
    if not payload.isdigit():
        raise _malformed(name, f"must be a weight version (a non-negative integer), got {payload[:40]!r}")
    return int(payload)


@dataclasses.dataclass
class SendCounts:
    """What one version's update moved: `bytes_full` the bytes of every bucket (what a sync without delta
    broadcasts once), `bytes_sent` the bytes broadcast (resends included); buckets likewise; `resends` the
    broadcasts repeated after a checksum mismatch or a missing bucket; `hash_seconds` the trainer's hashing."""

    bytes_full: int = 0
    bytes_sent: int = 0
    buckets: int = 0
    buckets_sent: int = 0
    resends: int = 0
    hash_seconds: float = 0.0

    def metrics(self) -> dict[str, float]:
        return {f"weight_sync/{k}": float(v) for k, v in dataclasses.asdict(self).items()}


class BroadcastSink:
    """The trainer's end: an `update_weights` / `update_adapters` target that broadcasts each bucket to the
    generators. `hub_key`: the hub's key (`channel.Hub.key`), which authenticates the metadata in the store.
    Set `adapters_follow` before a full weight update that `update_adapters` completes (rollout.weight_sync=
    adapters: the base weights, then their adapters, one version). `delta`: send only the weight buckets that
    differ from what every generator acknowledged last (rollout.weight_sync_delta); `max_resends`: broadcasts
    of a bucket after the first that the generators may need before it is an error. `group.world_size - 1`
    generators acknowledge every bucket; while the trainer waits for their answers it calls `alive()` (raises
    when a generator died: the controller's liveness check) and gives up after `answer_timeout_s`."""

    def __init__(self, group: Any, store: Any, hub_key: bytes, delta: bool = False,
                 max_resends: int = MAX_RESENDS, alive: Callable[[], None] = lambda: None,
                 answer_timeout_s: float = 1800.0) -> None:
        if max_resends < 0:
            raise ValueError(f"max_resends must be >= 0, got {max_resends}")
        self.group, self.store, self.hub_key = group, store, hub_key
        self.delta, self.max_resends = delta, max_resends
        self.alive, self.answer_timeout_s = alive, answer_timeout_s
        self.weight_version = -1
        self.adapters_follow = False
        self.last_counts = SendCounts()  # of the last complete update
        self._bucket = 0
        self._version: Optional[int] = None
        self._counts = SendCounts()
        # weight bucket index -> (names, shapes, dtypes; digest) that every generator acknowledged last
        self._held: dict[int, tuple[BucketMeta, str]] = {}
        self._keys: list[str] = []  # this update's store keys
        self._sent_keys: list[str] = []  # the last complete update's, deleted when the next one completes

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

    def metrics(self) -> dict[str, float]:
        """`weight_sync/...` of the last complete update (`SendCounts`)."""
        return self.last_counts.metrics()

    def _send(self, tensors: list[tuple[str, torch.Tensor]], version: int, **fields: Any) -> None:
        if version != self._version:
            self._version, self._bucket, self._counts = version, 0, SendCounts()
        index, counts = self._bucket, self._counts
        meta, flat = pack_bucket(tensors)
        start = time.perf_counter()
        digest = bucket_digest(flat)
        counts.hash_seconds += time.perf_counter() - start
        weights = fields.get("lora_scaling") is None
        unchanged = self.delta and weights and self._held.get(index) == (meta, digest)
        self._set(_key(version, index), encode_bucket(meta, digest, unchanged=unchanged, **fields))
        counts.buckets += 1
        counts.bytes_full += flat.numel()
        on_device = None
        send = not unchanged
        for attempt in range(self.max_resends + 1):
            if send:
                on_device = flat.to(self.group.device) if on_device is None else on_device
                self.group.broadcast(on_device, src=0)
                counts.buckets_sent += 1
                counts.bytes_sent += flat.numel()
            bad = self._answers(version, index, attempt)
            decision = "done" if not bad else "fail" if attempt == self.max_resends else "send"
            self._set(_decision_key(version, index, attempt), decision.encode())
            if decision == "done":
                break
            if decision == "fail":
                raise RuntimeError(
                    f"weights v{version}, bucket {index} ({len(meta)} tensors from {meta[0][0] if meta else '-'}, "
                    f"{flat.numel()} bytes): after {attempt + 1} broadcasts the generators still answer "
                    f"{_describe(bad)}; corrupt: the bytes received do not match the checksum (a faulty link, NIC "
                    "or GPU memory), missing: a generator does not hold a bucket announced as unchanged. No generator "
                    "loaded any of this bucket")
            logger.warning("weights v%d bucket %d: %s; sending it again (%d of %d)", version, index, _describe(bad),
                           attempt + 1, self.max_resends)
            counts.resends += 1
            send = True
        if weights:
            self._held[index] = (meta, digest)
        self._bucket += 1

    def _answers(self, version: int, index: int, attempt: int) -> dict[int, str]:
        """Each generator's answer to this broadcast (blocks until all are in): {rank: answer} of those not ok."""
        bad = {}
        for rank in range(1, self.group.world_size):
            name = _ack_key(version, index, attempt, rank)
            self._keys.append(name)
            self._wait(name, rank)
            answer = _read_word(self.store, self.hub_key, name, ACKS)
            if answer != "ok":
                bad[rank] = answer
        return bad

    def _wait(self, name: str, rank: int) -> None:
        """Until `name` is set; a generator that died after a broadcast would otherwise leave the trainer blocked
        in the store for its whole timeout, so its liveness is checked meanwhile."""
        deadline, pause = time.monotonic() + self.answer_timeout_s, 1e-4
        while not self.store.check([name]):
            self.alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"generator {rank - 1} has not answered {name!r} within {self.answer_timeout_s:g}s "
                                   "(rollout.weight_update_timeout_s): it hangs in hashing or loading a bucket")
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def _set(self, name: str, payload: bytes) -> None:
        signed_set(self.store, self.hub_key, name, payload)
        self._keys.append(name)

    def _sent_all(self, version: int) -> None:
        for name in self._sent_keys:  # every member has read the previous update's keys by now
            self.store.delete_key(name)
        self._sent_keys, self._keys = self._keys, []
        self.weight_version = version
        self.last_counts = self._counts
        c = self._counts
        logger.info("weights v%d: sent %d of %d buckets, %.1f of %.1f MB (%d resends), hashing %.3fs", version,
                    c.buckets_sent, c.buckets, c.bytes_sent / 1e6, c.bytes_full / 1e6, c.resends, c.hash_seconds)


def _describe(bad: dict[int, str]) -> str:
    return ", ".join(f"generator {rank - 1}: {answer}" for rank, answer in sorted(bad.items()))


class WeightReceiver:
    """A generator's end: joins the broadcasts of the next version, checks each bucket's checksum and loads the
    verified ones into `engine`. `hub_key`: the hub's key, which the metadata in the store must be authenticated
    with; `progress()` runs after each bucket (the generator's progress clock)."""

    def __init__(self, group: Any, store: Any, engine: Any, hub_key: bytes,
                 on_update: Optional[Callable[[int, float, float], None]] = None,
                 progress: Callable[[], None] = lambda: None) -> None:
        self.group, self.store, self.engine, self.hub_key = group, store, engine, hub_key
        self.on_update = on_update  # (version, start, end), for the generator's timeline
        self.progress = progress
        self.version = -1
        # weight bucket index -> (names, shapes, dtypes; digest) of what the engine holds from that bucket
        self.held: dict[int, tuple[BucketMeta, str]] = {}

    def poll(self) -> bool:
        """Apply the next version if the trainer has announced it; True if one was applied."""
        if not self.store.check([_key(self.version + 1, 0)]):
            return False
        self.receive(self.version + 1)
        return True

    def receive(self, version: int) -> None:
        """Join every bucket broadcast of `version` (blocks until the trainer sends them)."""
        start = time.time()
        bucket = num_loaded = 0
        while True:
            name = _key(version, bucket)
            got = decode_bucket(signed_get(self.store, self.hub_key, name), name)
            tensors = self._take(version, bucket, got)
            if got.lora_scaling is None:
                if tensors is not None or got.flush:  # an unchanged last bucket still completes the version
                    self.engine.update_weights(tensors or [], version, flush=got.flush)
                if tensors is not None:
                    self.held[bucket] = (got.meta, got.digest)
            else:
                pairs = [t for _, t in tensors]
                modules = _adapter_modules([n for n, _ in tensors])
                self.engine.update_adapters(dict(zip(modules, zip(pairs[::2], pairs[1::2]))), got.lora_scaling,
                                            version)
            num_loaded += tensors is not None
            self.progress()
            bucket += 1
            if got.ends_version:
                break
        self.version = version
        if self.on_update is not None:
            self.on_update(version, start, time.time())
        logger.info("weights v%d received: %d buckets, %d of them loaded (%.3fs)", version, bucket, num_loaded,
                    time.time() - start)

    def _take(self, version: int, index: int, got: Bucket) -> Optional[list[tuple[str, torch.Tensor]]]:
        """The bucket's verified tensors, or None for an unchanged bucket this engine holds: answers each
        broadcast (ok / corrupt / missing) and joins the trainer's resends until it says done."""
        holds = got.lora_scaling is None and self.held.get(index) == (got.meta, got.digest)
        join = not got.unchanged
        flat: Optional[torch.Tensor] = None
        for attempt in itertools.count():  # the trainer bounds the resends (its decision `fail`)
            if join:
                received = torch.empty(bucket_bytes_of(got.meta), dtype=torch.uint8, device=self.group.device)
                self.group.broadcast(received, src=0)
                flat = received if bucket_digest(received) == got.digest else None
                answer = "ok" if flat is not None else "corrupt"
            else:
                answer = "ok" if holds else "missing"
            signed_set(self.store, self.hub_key, _ack_key(version, index, attempt, self.group.rank), answer.encode())
            decision = _read_word(self.store, self.hub_key, _decision_key(version, index, attempt), DECISIONS)
            if decision == "done":
                return None if flat is None else unpack_bucket(got.meta, flat)
            if decision == "fail":
                break
            join = True
        raise RuntimeError(f"weights v{version}, bucket {index}: the trainer gave up after {attempt + 1} broadcasts "
                           f"(this generator's last answer: {answer}); none of the bucket was loaded")
