"""The weight store of disaggregated mode (megatron_rl/disagg/weights.py, parallel.dist.weight_update_store).

The weight group's TCPStore takes connections from any client, without credentials. What the
trainer writes to it (each bucket's names, shapes and dtypes; the start signal) is JSON
authenticated with a key derived from the hub's key, so a value set by anyone else is refused
before any of it is used and nothing of it is ever executed (it was unpickled: remote code
execution on the generators). A store for generators on this node listens on the loopback only.
The bucket bytes themselves travel over the process group, faked here by an in-process channel
(threads); each bucket carries a checksum that the receiver checks (test_disagg_delta.py: resends, delta).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import pickle
import queue
import socket
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch

from megatron_rl.disagg.weights import (BroadcastSink, WeightReceiver, WeightStoreError, read_start, signed_get,
                                        signed_set)
from megatron_rl.parallel.dist import free_port, weight_update_store

KEY = bytes(range(32))  # the hub's key of this run
D = b"0" * 32  # a well-formed digest
_EXECUTED: list[str] = []


def _record() -> None:  # what the forged pickle runs on a receiver that unpickles it
    _EXECUTED.append("unpickled")


class _Exploit:
    def __reduce__(self):
        return (_record, ())


class Channel:
    """The weight group's broadcast between a sink (rank 0) and one receiver (rank 1), threads of this process:
    what the sink sends, the receiver's next broadcast yields. `tamper(n, sent)` sits at the channel boundary: it
    sees the n-th delivery and returns what arrives (None: nothing arrives, the receiver's buffer stays as it was
    allocated)."""

    def __init__(self, tamper: Optional[Callable[[int, torch.Tensor], Optional[torch.Tensor]]] = None) -> None:
        self.wire: queue.Queue = queue.Queue()
        self.tamper = tamper
        self.deliveries = 0
        self.sent: list[int] = []  # bytes of each broadcast the sink made

    def end(self, rank: int) -> "_End":
        return _End(self, rank)


class _End:
    device = torch.device("cpu")
    world_size = 2

    def __init__(self, channel: Channel, rank: int) -> None:
        self.channel, self.rank = channel, rank

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if self.rank == src:
            self.channel.sent.append(tensor.numel())
            self.channel.wire.put(tensor.clone())
            return
        sent = self.channel.wire.get(timeout=20)
        assert sent.shape == tensor.shape, "the receiver sized its buffer from the bucket's metadata"
        n, self.channel.deliveries = self.channel.deliveries, self.channel.deliveries + 1
        arrived = sent if self.channel.tamper is None else self.channel.tamper(n, sent.clone())
        if arrived is not None:
            tensor.copy_(arrived)


def in_thread(fn: Callable[[], Any]) -> Future:
    """The sink's side of an update, run while the test's thread receives (each bucket waits for the answers)."""
    pool = ThreadPoolExecutor(1)
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return future


def announced(store: Any, version: int) -> None:
    """Wait until the sink (another thread) has announced `version`'s first bucket, as a generator's poll sees it."""
    store.wait([f"v{version}/b0"], datetime.timedelta(seconds=20))


def send_version(sink: BroadcastSink, buckets: list[list[tuple[str, torch.Tensor]]], version: int) -> Future:
    def send() -> None:
        for i, bucket in enumerate(buckets):
            sink.update_weights(bucket, version, flush=i == len(buckets) - 1)
    return in_thread(send)


class _Engine:
    def __init__(self) -> None:
        self.calls: list[tuple[list[tuple[str, torch.Tensor]], int, bool]] = []

    def update_weights(self, named_tensors, version: int, flush: bool = True) -> None:
        self.calls.append(([(n, t.clone()) for n, t in named_tensors], version, flush))

    def update_adapters(self, adapters, scaling: float, version: int) -> None:
        self.calls.append(({m: (a.clone(), b.clone()) for m, (a, b) in adapters.items()}, version, scaling))


@pytest.fixture
def store():
    master = weight_update_store("127.0.0.1", free_port(), 2, is_master=True, timeout_s=5)
    yield master


def _client(store) -> torch.distributed.TCPStore:
    """Anyone on the store's network: a plain client, no credentials."""
    return torch.distributed.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=5))


def _forge(client, name: str, value: bytes) -> None:
    client.set(name, value)
    client.get(name)  # a set is not acknowledged: the round trip makes it visible to the other connections


def _buckets() -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    return [[("a.weight", torch.randn(3, 4, generator=g)), ("a.bias", torch.randn(4, generator=g).bfloat16())],
            [("steps", torch.arange(6, dtype=torch.int64)), ("empty", torch.zeros(0, 2))]]


def raw_bytes(tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    """A bucket's bytes as numpy lays each tensor out (bf16 through int16: numpy has no bf16)."""
    return b"".join((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes() for _, t in tensors)


def blake2b_tree(data: bytes) -> str:
    """weight_sync/checksum.py's digest of a bucket under 16 MiB, from hashlib: one leaf, then the root."""
    def h(b: bytes) -> hashlib.blake2b:
        return hashlib.blake2b(b, digest_size=16, person=b"mrl-bucket")
    return h(len(data).to_bytes(8, "little") + h(data).digest()).hexdigest()


def test_buckets_go_through_the_store_as_authenticated_json_and_arrive_bit_exact(store):
    channel, engine = Channel(), _Engine()
    sink = BroadcastSink(channel.end(0), store, KEY)
    buckets = _buckets()
    sending = send_version(sink, buckets, 0)
    peer = _client(store)  # the generator's own connection (a client's calls wait on one another)
    receiver = WeightReceiver(channel.end(1), peer, engine, KEY)
    announced(peer, 0)
    assert receiver.poll() and receiver.version == 0
    sending.result(timeout=20)
    mac, _, body = store.get("v0/b0").partition(b"\n")
    assert len(mac) == 64 and json.loads(body) == {  # by hand: names, shapes, dtype names, the flush flag, digest
        "flush": False, "tensors": [["a.weight", [3, 4], "float32"], ["a.bias", [4], "bfloat16"]],
        "digest": blake2b_tree(raw_bytes(buckets[0]))}
    assert sink.weight_version == 0 and channel.sent == [12 * 4 + 4 * 2, 6 * 8]
    assert [(version, flush) for _, version, flush in engine.calls] == [(0, False), (0, True)]
    for (got, _, _), want in zip(engine.calls, buckets):
        assert [n for n, _ in got] == [n for n, _ in want]
        for (_, a), (_, b) in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert not receiver.poll()


def test_a_value_set_by_another_client_of_the_store_is_refused_and_never_unpickled(store):
    attacker, engine = _client(store), _Engine()
    receiver = WeightReceiver(Channel().end(1), store, engine, KEY)
    _forge(attacker, "v0/b0", pickle.dumps(_Exploit()))
    with pytest.raises(WeightStoreError, match="weight store value 'v0/b0' .*not written by this run's trainer"):
        receiver.poll()
    assert _EXECUTED == [] and engine.calls == []
    forged = json.dumps({"flush": True, "tensors": [["a.weight", [3, 4], "float32"]]}).encode()
    signed_set(attacker, b"\x00" * 32, "v0/b0", forged)  # well-formed, under a key of the attacker's choosing
    attacker.get("v0/b0")
    with pytest.raises(WeightStoreError, match="not written by this run's trainer"):
        receiver.poll()
    _forge(attacker, "v0/b0", b"0" * 64 + b"\n" + forged)
    with pytest.raises(WeightStoreError, match="not written by this run's trainer"):
        receiver.poll()
    assert engine.calls == [] and receiver.version == -1


def test_a_genuine_value_replayed_under_another_name_is_refused(store):
    channel = Channel()
    sending = send_version(BroadcastSink(channel.end(0), store, KEY), _buckets()[:1], 0)
    peer = _client(store)
    receiver = WeightReceiver(channel.end(1), peer, _Engine(), KEY)
    announced(peer, 0)
    assert receiver.poll() and receiver.version == 0
    sending.result(timeout=20)
    attacker = _client(store)
    _forge(attacker, "v1/b0", store.get("v0/b0"))  # replays version 0's bucket as version 1's
    with pytest.raises(WeightStoreError, match="'v1/b0'"):
        receiver.poll()


def test_the_base_then_adapters_in_one_version_and_later_the_adapters_alone(store):
    """rollout.weight_sync=adapters: the base weights' last bucket says adapters follow, the adapter bucket
    (each module's A and B, alpha / r) completes the version; the next version is that bucket alone."""
    channel, engine = Channel(), _Engine()
    sink = BroadcastSink(channel.end(0), store, KEY)
    g = torch.Generator().manual_seed(1)
    adapters = {f"model.layers.0.self_attn.{p}_proj": (torch.randn(2, 4, generator=g), torch.randn(3, 2, generator=g))
                for p in ("q", "o")}
    sink.adapters_follow = True
    buckets = _buckets()

    def send() -> None:
        for i, bucket in enumerate(buckets):
            sink.update_weights(bucket, 0, flush=i == len(buckets) - 1)
        sink.update_adapters(adapters, 8.0, 0)
    sending = in_thread(send)
    peer = _client(store)  # the generator's own connection (a client's calls wait on one another)
    receiver = WeightReceiver(channel.end(1), peer, engine, KEY)
    announced(peer, 0)
    assert receiver.poll() and receiver.version == 0
    sending.result(timeout=20)
    assert json.loads(store.get("v0/b1").partition(b"\n")[2])["adapters_follow"] is True
    pairs = [(f"model.layers.0.self_attn.{p}_proj.lora_{m}", t) for p in ("q", "o")
             for m, t in zip("AB", adapters[f"model.layers.0.self_attn.{p}_proj"])]
    assert json.loads(store.get("v0/b2").partition(b"\n")[2]) == {"lora_scaling": 8.0, "tensors": [
        [name, list(t.shape), "float32"] for name, t in pairs], "digest": blake2b_tree(raw_bytes(pairs))}
    assert [call[1:] for call in engine.calls] == [(0, False), (0, True), (0, 8.0)]
    got = engine.calls[2][0]
    assert list(got) == list(adapters) and all(torch.equal(got[m][0], adapters[m][0]) and
                                               torch.equal(got[m][1], adapters[m][1]) for m in adapters)
    assert not sink.adapters_follow and not receiver.poll()  # the version ended with the adapters
    moved = {m: (a + 1, b - 1) for m, (a, b) in adapters.items()}
    sending = in_thread(lambda: sink.update_adapters(moved, 8.0, 1))
    announced(peer, 1)
    assert receiver.poll() and receiver.version == 1
    sending.result(timeout=20)
    assert not store.check(["v0/b0"]) and not store.check(["v0/b0/a0/g1"]) and not store.check(["v0/b0/d0"])
    assert [call[1:] for call in engine.calls[3:]] == [(1, 8.0)] and torch.equal(
        engine.calls[3][0]["model.layers.0.self_attn.o_proj"][1], moved["model.layers.0.self_attn.o_proj"][1])


@pytest.mark.parametrize("body, message", [
    (b"\x80\x04K\x01.", "not JSON"),
    (b"[1, 2]", "must be an object"),
    (b'{"tensors": []}', "keys must be exactly"),
    (b'{"digest": "%s", "flush": true, "tensors": [], "code": "x"}' % D, "keys must be exactly"),
    (b'{"digest": "%s", "flush": 1, "tensors": []}' % D, "flush must be true or false"),
    (b'{"digest": "%s", "flush": true, "tensors": {}}' % D, "tensors must be a list"),
    (b'{"digest": "%s", "flush": true, "tensors": [["w", [2], "object"]]}' % D, "unknown dtype 'object'"),
    (b'{"digest": "%s", "flush": true, "tensors": [["w", [2], "torch.float32"]]}' % D, "unknown dtype 'torch.float32'"),
    (b'{"digest": "%s", "flush": true, "tensors": [["w", "2", "float32"]]}' % D, "shape must be a list of integers >= 0"),
    (b'{"digest": "%s", "flush": true, "tensors": [["w", [-1], "float32"]]}' % D, "shape must be a list of integers >= 0"),
    (b'{"digest": "%s", "flush": true, "tensors": [["w", [true], "float32"]]}' % D, "shape must be a list of integers >= 0"),
    (b'{"digest": "%s", "flush": true, "tensors": [[7, [2], "float32"]]}' % D, "name must be a string"),
    (b'{"digest": "%s", "flush": true, "tensors": [["w", [2]]]}' % D, r"must be \[name, shape, dtype\]"),
    (b'{"digest": "%s", "flush": false, "adapters_follow": true, "tensors": []}' % D, "only on a bucket with flush true"),
    (b'{"digest": "%s", "flush": true, "adapters_follow": 1, "tensors": []}' % D, "adapters_follow must be true or false"),
    (b'{"digest": "%s", "lora_scaling": -2, "tensors": []}' % D, "lora_scaling must be a finite number > 0"),
    (b'{"digest": "%s", "lora_scaling": true, "tensors": []}' % D, "lora_scaling must be a finite number > 0"),
    (b'{"digest": "%s", "lora_scaling": 2, "flush": true, "tensors": []}' % D, "keys must be exactly"),
    (b'{"digest": "%s", "lora_scaling": 2, "tensors": [["m.lora_B", [2], "float32"], ["m.lora_A", [2], "float32"]]}' % D,
     "must be <module>.lora_A, <module>.lora_B pairs"),
    (b'{"digest": "%s", "lora_scaling": 2, "tensors": [["m.lora_A", [2], "float32"]]}' % D, "must be <module>.lora_A, <module>.lora_B"),
    (b'{"flush": true, "tensors": [], "digest": "abc"}', "digest must be 32 lowercase hex digits"),
    (b'{"flush": true, "tensors": [], "digest": 7}', "digest must be 32 lowercase hex digits"),
    (b'{"flush": true, "tensors": []}', "keys must be exactly"),  # no digest
    (b'{"flush": true, "unchanged": false, "tensors": [], "digest": "%s"}' % D, "unchanged must be true"),
    (b'{"lora_scaling": 2, "unchanged": true, "tensors": [], "digest": "%s"}' % D, "keys must be exactly"),
])
def test_authentic_but_malformed_metadata_is_refused_with_the_reason(store, body, message):
    """A value under the right key that is not what a sink writes (a bug, or a sink of another
    version of this code) is refused by name before a buffer is sized from it."""
    signed_set(store, KEY, "v0/b0", body)
    engine = _Engine()
    with pytest.raises(WeightStoreError, match=f"weight store value 'v0/b0' is malformed: .*{message}"):
        WeightReceiver(Channel().end(1), store, engine, KEY).poll()
    assert engine.calls == []


def test_the_start_signal_is_authenticated_too(store):
    signed_set(store, KEY, "go", b"3")
    assert read_start(store, KEY, "go") == 3 and signed_get(store, KEY, "go") == b"3"
    _forge(_client(store), "go", b"5")
    with pytest.raises(WeightStoreError, match="'go' .*not written by this run's trainer"):
        read_start(store, KEY, "go")
    signed_set(store, KEY, "go", b"five")
    with pytest.raises(WeightStoreError, match="'go' is malformed"):
        read_start(store, KEY, "go")


def _listening(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* write them) of the sockets listening on `port`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if Path(table).exists():
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hex_port = local.rpartition(":")
                if state == "0A" and int(hex_port, 16) == port:
                    out.append(address)
    return out


def test_a_loopback_weight_store_listens_on_the_loopback_only():
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux's /proc/net/tcp to list listening sockets")
    master = weight_update_store("127.0.0.1", free_port(), 2, is_master=True, timeout_s=5)
    assert _listening(master.port) == ["0100007F"]  # 127.0.0.1, not [::] (every interface)
    client = weight_update_store("127.0.0.1", master.port, 2, is_master=False, timeout_s=5)
    client.set("x", b"1")
    assert master.get("x") == b"1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: picks the interface of the default route
            other = s.getsockname()[0]
    except OSError:
        return
    if not other.startswith("127."):
        with pytest.raises(OSError):
            socket.create_connection((other, master.port), timeout=2).close()
