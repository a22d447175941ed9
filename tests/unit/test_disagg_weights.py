"""The weight store of disaggregated mode (megatron_rl/disagg/weights.py, parallel.dist.weight_update_store).

The weight group's TCPStore takes connections from any client, without credentials. What the
trainer writes to it (each bucket's names, shapes and dtypes; the start signal) is JSON
authenticated with a key derived from the hub's key, so a value set by anyone else is refused
before any of it is used and nothing of it is ever executed (it was unpickled: remote code
execution on the generators). A store for generators on this node listens on the loopback only.
The bucket bytes themselves travel over the process group, faked here by an in-process wire.
"""

from __future__ import annotations

import datetime
import json
import pickle
import socket
from pathlib import Path

import pytest
import torch

from megatron_rl.disagg.weights import (BroadcastSink, WeightReceiver, WeightStoreError, read_start, signed_get,
                                        signed_set)
from megatron_rl.parallel.dist import free_port, weight_update_store

KEY = bytes(range(32))  # the hub's key of this run
_EXECUTED: list[str] = []


def _record() -> None:  # what the forged pickle runs on a receiver that unpickles it
    _EXECUTED.append("unpickled")


class _Exploit:
    def __reduce__(self):
        return (_record, ())


class _Wire:
    """Both ends of one broadcast in one process: what the sink sends, the receiver's broadcast yields."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.sent.append(tensor.clone())


class _Receiving:
    device = torch.device("cpu")

    def __init__(self, wire: _Wire) -> None:
        self.wire = wire

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        sent = self.wire.sent.pop(0)
        assert sent.shape == tensor.shape, "the receiver sized its buffer from the bucket's metadata"
        tensor.copy_(sent)


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


def test_buckets_go_through_the_store_as_authenticated_json_and_arrive_bit_exact(store):
    wire, engine = _Wire(), _Engine()
    sink = BroadcastSink(wire, store, KEY)
    buckets = _buckets()
    for i, bucket in enumerate(buckets):
        sink.update_weights(bucket, 0, flush=i == len(buckets) - 1)
    mac, _, body = store.get("v0/b0").partition(b"\n")
    assert len(mac) == 64 and json.loads(body) == {  # by hand: names, shapes, dtype names, the flush flag
        "flush": False, "tensors": [["a.weight", [3, 4], "float32"], ["a.bias", [4], "bfloat16"]]}
    receiver = WeightReceiver(_Receiving(wire), store, engine, KEY)
    assert receiver.poll() and receiver.version == 0
    assert [(version, flush) for _, version, flush in engine.calls] == [(0, False), (0, True)]
    for (got, _, _), want in zip(engine.calls, buckets):
        assert [n for n, _ in got] == [n for n, _ in want]
        for (_, a), (_, b) in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert not receiver.poll()


def test_a_value_set_by_another_client_of_the_store_is_refused_and_never_unpickled(store):
    attacker, engine = _client(store), _Engine()
    receiver = WeightReceiver(_Receiving(_Wire()), store, engine, KEY)
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
    wire = _Wire()
    BroadcastSink(wire, store, KEY).update_weights(_buckets()[0], 0, flush=True)
    attacker = _client(store)
    _forge(attacker, "v1/b0", store.get("v0/b0"))  # replays version 0's bucket as version 1's
    receiver = WeightReceiver(_Receiving(wire), store, _Engine(), KEY)
    receiver.version = 0
    with pytest.raises(WeightStoreError, match="'v1/b0'"):
        receiver.poll()


def test_the_base_then_adapters_in_one_version_and_later_the_adapters_alone(store):
    """rollout.weight_sync=adapters: the base weights' last bucket says adapters follow, the adapter bucket
    (each module's A and B, alpha / r) completes the version; the next version is that bucket alone."""
    wire, engine = _Wire(), _Engine()
    sink = BroadcastSink(wire, store, KEY)
    g = torch.Generator().manual_seed(1)
    adapters = {f"model.layers.0.self_attn.{p}_proj": (torch.randn(2, 4, generator=g), torch.randn(3, 2, generator=g))
                for p in ("q", "o")}
    sink.adapters_follow = True
    buckets = _buckets()
    for i, bucket in enumerate(buckets):
        sink.update_weights(bucket, 0, flush=i == len(buckets) - 1)
    sink.update_adapters(adapters, 8.0, 0)
    assert json.loads(store.get("v0/b1").partition(b"\n")[2])["adapters_follow"] is True
    assert json.loads(store.get("v0/b2").partition(b"\n")[2]) == {"lora_scaling": 8.0, "tensors": [
        [f"model.layers.0.self_attn.{p}_proj.lora_{m}", shape, "float32"]
        for p in ("q", "o") for m, shape in (("A", [2, 4]), ("B", [3, 2]))]}
    receiver = WeightReceiver(_Receiving(wire), store, engine, KEY)
    assert receiver.poll() and receiver.version == 0
    assert [call[1:] for call in engine.calls] == [(0, False), (0, True), (0, 8.0)]
    got = engine.calls[2][0]
    assert list(got) == list(adapters) and all(torch.equal(got[m][0], adapters[m][0]) and
                                               torch.equal(got[m][1], adapters[m][1]) for m in adapters)
    assert not sink.adapters_follow and not receiver.poll()  # the version ended with the adapters
    moved = {m: (a + 1, b - 1) for m, (a, b) in adapters.items()}
    sink.update_adapters(moved, 8.0, 1)
    assert not store.check(["v0/b0"]) and receiver.poll() and receiver.version == 1
    assert [call[1:] for call in engine.calls[3:]] == [(1, 8.0)] and torch.equal(
        engine.calls[3][0]["model.layers.0.self_attn.o_proj"][1], moved["model.layers.0.self_attn.o_proj"][1])


@pytest.mark.parametrize("body, message", [
    (b"\x80\x04K\x01.", "not JSON"),
    (b"[1, 2]", "must be an object"),
    (b'{"tensors": []}', "keys must be exactly"),
    (b'{"flush": true, "tensors": [], "code": "x"}', "keys must be exactly"),
    (b'{"flush": 1, "tensors": []}', "flush must be true or false"),
    (b'{"flush": true, "tensors": {}}', "tensors must be a list"),
    (b'{"flush": true, "tensors": [["w", [2], "object"]]}', "unknown dtype 'object'"),
    (b'{"flush": true, "tensors": [["w", [2], "torch.float32"]]}', "unknown dtype 'torch.float32'"),
    (b'{"flush": true, "tensors": [["w", "2", "float32"]]}', "shape must be a list of integers >= 0"),
    (b'{"flush": true, "tensors": [["w", [-1], "float32"]]}', "shape must be a list of integers >= 0"),
    (b'{"flush": true, "tensors": [["w", [true], "float32"]]}', "shape must be a list of integers >= 0"),
    (b'{"flush": true, "tensors": [[7, [2], "float32"]]}', "name must be a string"),
    (b'{"flush": true, "tensors": [["w", [2]]]}', r"must be \[name, shape, dtype\]"),
    (b'{"flush": false, "adapters_follow": true, "tensors": []}', "only on a bucket with flush true"),
    (b'{"flush": true, "adapters_follow": 1, "tensors": []}', "adapters_follow must be true or false"),
    (b'{"lora_scaling": -2, "tensors": []}', "lora_scaling must be a finite number > 0"),
    (b'{"lora_scaling": true, "tensors": []}', "lora_scaling must be a finite number > 0"),
    (b'{"lora_scaling": 2, "flush": true, "tensors": []}', "keys must be exactly"),
    (b'{"lora_scaling": 2, "tensors": [["m.lora_B", [2], "float32"], ["m.lora_A", [2], "float32"]]}',
     "must be <module>.lora_A, <module>.lora_B pairs"),
    (b'{"lora_scaling": 2, "tensors": [["m.lora_A", [2], "float32"]]}', "must be <module>.lora_A, <module>.lora_B"),
])
def test_authentic_but_malformed_metadata_is_refused_with_the_reason(store, body, message):
    """A value under the right key that is not what a sink writes (a bug, or a sink of another
    version of this code) is refused by name before a buffer is sized from it."""
    signed_set(store, KEY, "v0/b0", body)
    engine = _Engine()
    with pytest.raises(WeightStoreError, match=f"weight store value 'v0/b0' is malformed: .*{message}"):
        WeightReceiver(_Receiving(_Wire()), store, engine, KEY).poll()
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
