"""The weight path of disaggregated mode across processes: a trainer-side `BroadcastSink` fed
bucket by bucket (as `sync_weights` feeds an engine) and a generator-side `WeightReceiver`
joined over a `WeightUpdateGroup` built on its own TCPStore (gloo). The generator's engine
receives every tensor bit for bit (fp32, bf16, int64), in the same buckets, with the flush
flag on the last bucket of each version only; `poll()` applies a version only once it is
announced; the store keys of an update are deleted once the next one is complete.

The end-to-end check that the generator's weights equal the trainer's is in
tests/integration/test_disaggregated.py (log-prob mismatch ~0 at staleness 0).
"""

from __future__ import annotations

import datetime

import pytest
import torch

from megatron_rl.parallel.dist import free_port
from tests.distributed.launcher import run_spawned

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
KEY = b"k" * 32  # the hub's key, which authenticates the bucket metadata in the store


def _buckets(version: int) -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(version)
    return [[("a.weight", torch.randn(3, 4, generator=g)), ("a.bias", torch.randn(4, generator=g).bfloat16())],
            [("b.weight", torch.randn(5, generator=g).bfloat16())],
            [("steps", torch.arange(6, dtype=torch.int64) + version)]][: 3 if version == 0 else 1]


class RecordingEngine:
    def __init__(self) -> None:
        self.weight_version = -1
        self.calls: list[tuple[list[tuple[str, torch.Tensor]], int, bool]] = []

    def update_weights(self, named_tensors, version: int, flush: bool = True) -> None:
        self.calls.append(([(n, t.clone()) for n, t in named_tensors], version, flush))
        if flush:
            self.weight_version = version


def _worker(rank: int, world: int, port: int) -> None:
    from megatron_rl.disagg.weights import BroadcastSink, WeightReceiver
    from megatron_rl.parallel.dist import WeightUpdateGroup, weight_update_store

    store = weight_update_store("127.0.0.1", port, world, is_master=rank == 0, timeout_s=60)
    group = WeightUpdateGroup(store, rank, world, torch.device("cpu"), timeout_s=60)
    if rank == 0:
        sink = BroadcastSink(group, store, KEY)
        for version in (0, 1):
            buckets = _buckets(version)
            for i, bucket in enumerate(buckets):
                sink.update_weights(bucket, version, flush=i == len(buckets) - 1)
        assert sink.weight_version == 1
        assert not store.check(["v0/b0"]) and not store.check(["v0/b2"]) and store.check(["v1/b0"])
        store.wait(["received"], datetime.timedelta(seconds=60))
        return
    engine = RecordingEngine()
    receiver = WeightReceiver(group, store, engine, KEY)
    receiver.receive(0)
    store.wait(["v1/b0"], datetime.timedelta(seconds=60))
    assert receiver.poll() and receiver.version == 1
    assert not receiver.poll()  # nothing announced beyond version 1
    expected = [(bucket, version, i == len(_buckets(version)) - 1)
                for version in (0, 1) for i, bucket in enumerate(_buckets(version))]
    assert len(engine.calls) == len(expected) == 4
    for (got, version, flush), (want, want_version, want_flush) in zip(engine.calls, expected):
        assert (version, flush) == (want_version, want_flush)
        assert [n for n, _ in got] == [n for n, _ in want]
        for (_, a), (_, b) in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert engine.weight_version == 1
    store.set("received", "1")


def test_broadcast_sink_to_receiver_is_bit_exact_per_bucket_and_version():
    run_spawned(_worker, 2, free_port(), timeout_s=120)
