"""Checksums and delta sync of disaggregated mode's weight path (megatron_rl/disagg/weights.py,
megatron_rl/weight_sync/checksum.py).

Every bucket's digest goes with its metadata; the generator hashes what arrived and answers in the store, and only
a bucket every generator verified is loaded. Faults are made at the channel boundary (the broadcast the process
group would carry): a flipped byte, a delivery that never arrives, a link that keeps corrupting. With delta, an
unchanged bucket is announced and not broadcast, and a generator that does not hold it gets it anyway. Expected
digests come from hashlib directly, expected bytes from the buckets' sizes by hand, and the engine's weights after
a delta sync are compared bit for bit with those after a full sync.
(Real models, frozen layers and LoRA: tests/distributed/test_delta_sync.py.)
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.disagg.weights import BroadcastSink, WeightReceiver
from megatron_rl.parallel.dist import free_port, weight_update_store
from megatron_rl.weight_sync.checksum import bucket_digest
from megatron_rl.weight_sync.stream import pack_bucket
from tests.unit.test_disagg_weights import KEY, Channel, _client, announced, in_thread, send_version


class StateEngine:
    """An engine's weights as a dict, updated by name as an engine in another process applies a bucket."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.loads: list[tuple[list[str], int, bool]] = []  # (names, version, flush) of each update_weights
        self.weight_version = -1

    def update_weights(self, named_tensors, version: int, flush: bool = True) -> None:
        named = list(named_tensors)
        self.loads.append(([n for n, _ in named], version, flush))
        for name, tensor in named:
            self.weights[name] = tensor.clone()
        if flush:
            self.weight_version = version


@pytest.fixture
def store():
    return weight_update_store("127.0.0.1", free_port(), 2, is_master=True, timeout_s=10)


def _version(seed: int, changed: tuple[int, ...] = (0, 1, 2)) -> list[list[tuple[str, torch.Tensor]]]:
    """Three buckets (SIZES: 156, 80 and 96 bytes); bucket i draws from seed `seed` if i in `changed`, else seed 0."""
    def bucket(i: int) -> list[tuple[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed if i in changed else 0)
        return [[("l0.w", torch.randn(6, 6, generator=g)), ("l0.b", torch.randn(6, generator=g).bfloat16())],
                [("l1.w", torch.randn(20, generator=g))],
                [("l2.w", torch.randn(4, 3, generator=g).double()), ("l2.steps", torch.arange(0, dtype=torch.int64))]
                ][i]
    return [bucket(i) for i in range(3)]


SIZES = [36 * 4 + 6 * 2, 20 * 4, 12 * 8]


def _sync(store, versions, delta: bool, tamper=None, max_resends: int = 3, before=None):
    """Send `versions` (each a list of buckets) through a sink and a receiver; returns (engine, sink, channel)."""
    channel, engine = Channel(tamper), StateEngine()
    sink = BroadcastSink(channel.end(0), store, KEY, delta=delta, max_resends=max_resends)
    peer = _client(store)
    receiver = WeightReceiver(channel.end(1), peer, engine, KEY)
    for version, buckets in enumerate(versions):
        if before is not None:
            before(version, receiver)
        sending = send_version(sink, buckets, version)
        announced(peer, version)
        assert receiver.poll() and receiver.version == version
        sending.result(timeout=20)
    return engine, sink, channel


def _bits(weights: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {name: pack_bucket([(name, t)])[1].numpy().tobytes() for name, t in weights.items()}


def test_the_digest_is_blake2b_of_each_chunk_then_of_the_length_and_leaves_on_any_thread_count():
    flat = torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    data = flat.numpy().tobytes()

    def h(b: bytes) -> hashlib.blake2b:
        return hashlib.blake2b(b, digest_size=16, person=b"mrl-bucket")
    want = h((1000).to_bytes(8, "little") + b"".join(h(data[i:i + 300]).digest() for i in range(0, 1000, 300)))
    assert {bucket_digest(flat, chunk_bytes=300, num_threads=n) for n in (1, 3, 8)} == {want.hexdigest()}
    assert bucket_digest(flat) != bucket_digest(flat[:-1]) != bucket_digest(torch.zeros(0, dtype=torch.uint8))
    with pytest.raises(ValueError, match="1-D uint8"):
        bucket_digest(flat.view(10, 100))


def test_a_bucket_corrupted_in_transit_is_refused_resent_and_loaded_once(store):
    def flip(n: int, sent: torch.Tensor):
        if n == 1:  # bucket 1's first delivery: one bit of its last byte
            sent[-1] ^= 1
        return sent
    versions = [_version(1)]
    engine, sink, channel = _sync(store, versions, delta=False, tamper=flip)
    assert channel.sent == [SIZES[0], SIZES[1], SIZES[1], SIZES[2]]
    assert [names for names, _, _ in engine.loads] == [["l0.w", "l0.b"], ["l1.w"], ["l2.w", "l2.steps"]]
    assert _bits(engine.weights) == _bits(dict(t for bucket in versions[0] for t in bucket))
    assert sink.metrics() == {"weight_sync/bytes_full": sum(SIZES), "weight_sync/bytes_sent": sum(SIZES) + SIZES[1],
                              "weight_sync/buckets": 3, "weight_sync/buckets_sent": 4, "weight_sync/resends": 1,
                              "weight_sync/hash_seconds": pytest.approx(sink.last_counts.hash_seconds)}


def test_a_bucket_that_never_arrives_is_resent(store):
    engine, sink, channel = _sync(store, [_version(1)], delta=False, tamper=lambda n, sent: None if n == 0 else sent)
    assert channel.sent == [SIZES[0], SIZES[0], SIZES[1], SIZES[2]] and sink.last_counts.resends == 1
    assert _bits(engine.weights) == _bits(dict(t for bucket in _version(1) for t in bucket))


def test_a_link_that_keeps_corrupting_fails_loudly_on_both_ends_and_nothing_of_the_bucket_is_loaded(store):
    def corrupt_bucket_1(n: int, sent: torch.Tensor):
        if sent.numel() == SIZES[1]:
            sent[0] ^= 0xFF
        return sent
    channel, engine = Channel(corrupt_bucket_1), StateEngine()
    sink = BroadcastSink(channel.end(0), store, KEY, max_resends=2)
    receiver = WeightReceiver(channel.end(1), _client(store), engine, KEY)
    sending = send_version(sink, _version(1), 0)
    with pytest.raises(RuntimeError, match=r"bucket 1: the trainer gave up after 3 broadcasts .*last answer: corrupt"):
        receiver.receive(0)
    with pytest.raises(RuntimeError, match=r"v0, bucket 1 \(1 tensors from l1.w, 80 bytes\): after 3 broadcasts the "
                                           r"generators still answer generator 0: corrupt"):
        sending.result(timeout=20)
    assert channel.sent == [SIZES[0]] + [SIZES[1]] * 3
    assert engine.loads == [(["l0.w", "l0.b"], 0, False)] and receiver.version == -1 and sink.weight_version == -1


def test_delta_sends_only_the_changed_buckets_and_the_engine_ends_bit_identical_to_a_full_sync(store):
    versions = [_version(0), _version(2, changed=(1,)), _version(3, changed=(0, 1))]
    full, full_sink, full_channel = _sync(store, versions, delta=False)
    other = weight_update_store("127.0.0.1", free_port(), 2, is_master=True, timeout_s=10)
    delta, delta_sink, delta_channel = _sync(other, versions, delta=True)
    assert _bits(delta.weights) == _bits(full.weights) == _bits(dict(t for b in versions[-1] for t in b))
    assert delta.weight_version == full.weight_version == 2
    # version 1: bucket 1 only; version 2: buckets 0 and 1 (bucket 2 never changed after version 0)
    assert delta_channel.sent == SIZES + [SIZES[1]] + [SIZES[0], SIZES[1]]
    assert full_channel.sent == SIZES * 3
    assert (delta_sink.last_counts.bytes_sent, delta_sink.last_counts.bytes_full) == (SIZES[0] + SIZES[1], sum(SIZES))
    assert (full_sink.last_counts.bytes_sent, full_sink.last_counts.bytes_full) == (sum(SIZES), sum(SIZES))
    # the unchanged last bucket still completes the version: an empty flushing update
    assert delta.loads[-2:] == [(["l1.w"], 2, False), ([], 2, True)]


def test_a_generator_that_does_not_hold_an_unchanged_bucket_answers_missing_and_gets_it(store):
    def forget(version: int, receiver: WeightReceiver) -> None:
        if version == 1:
            receiver.held.pop(2)  # as if bucket 2 of version 0 had never reached this engine
    versions = [_version(0), _version(2, changed=(0,))]
    engine, sink, channel = _sync(store, versions, delta=True, before=forget)
    assert channel.sent == SIZES + [SIZES[0], SIZES[2]]
    assert (sink.last_counts.resends, sink.last_counts.buckets_sent) == (1, 2)
    assert engine.loads[-2:] == [(["l0.w", "l0.b"], 1, False), (["l2.w", "l2.steps"], 1, True)]
    assert _bits(engine.weights) == _bits(dict(t for b in versions[-1] for t in b))


def test_a_forged_answer_is_refused_by_the_trainer(store):
    channel = Channel()
    sink = BroadcastSink(channel.end(0), store, KEY)
    attacker = _client(store)
    sending = send_version(sink, _version(1)[:1], 0)
    channel.wire.get(timeout=20)  # the broadcast went out; nobody verified it
    attacker.set("v0/b0/a0/g1", b"0" * 64 + b"\nok")
    with pytest.raises(Exception, match="'v0/b0/a0/g1' failed authentication"):
        sending.result(timeout=20)


def test_weight_sync_delta_is_a_disaggregated_setting_off_by_default():
    with pytest.raises(ConfigError, match="rollout.weight_sync_delta=true is invalid: is a disaggregated-mode setting"):
        load_config(["rollout.weight_sync_delta=true"], world_size=1)
    assert load_config(["rollout.mode=disaggregated", "rollout.weight_sync_delta=true"],
                       world_size=1).rollout.weight_sync_delta is True
    assert load_config([], world_size=1).rollout.weight_sync_delta is False
    with pytest.raises(ConfigError, match="rollout.weight_sync_delta=yes is invalid: must be true or false"):
        RolloutConfig(mode="disaggregated", weight_sync_delta="yes")
    with pytest.raises(ConfigError, match="rollout.weight_sync_bucket_mb=0 is invalid: must be > 0"):
        load_config(["rollout.weight_sync_bucket_mb=0"], world_size=1)


def test_a_generator_that_never_answers_is_found_by_the_liveness_check_not_the_store_timeout(store):
    class Died(RuntimeError):
        pass

    checks = []

    def alive() -> None:  # the controller's check: the generator process has exited
        checks.append(1)
        if len(checks) > 3:
            raise Died("generator 0 exited with code -9")
    channel = Channel()
    sink = BroadcastSink(channel.end(0), store, KEY, alive=alive, answer_timeout_s=60)
    sending = send_version(sink, _version(1)[:1], 0)
    channel.wire.get(timeout=20)  # the broadcast went out; the generator dies before it answers
    with pytest.raises(Died, match="exited with code -9"):
        sending.result(timeout=20)
    sink = BroadcastSink(Channel().end(0), store, KEY, answer_timeout_s=0.2)
    with pytest.raises(RuntimeError, match=r"generator 0 has not answered 'v5/b0/a0/g1' within 0.2s"):
        in_thread(lambda: sink.update_weights(_version(1)[0], 5)).result(timeout=20)


@pytest.mark.parametrize("change", ["name", "shape", "dtype"])
def test_a_bucket_whose_bytes_stay_but_whose_tensors_change_is_sent(store, change):
    """The digest covers a bucket's bytes only: a bucket of the same bytes under another name, shape or dtype (bucket
    boundaries moved, a layout change) is not 'unchanged' to delta sync, and the engine ends holding the new
    tensors, not the old ones."""
    first = _version(0)
    name, tensor = first[1][0]  # l1.w, 20 float32
    other = {"name": ("l1.v", tensor), "shape": (name, tensor.reshape(4, 5)),
             "dtype": (name, tensor.view(torch.int32))}[change]
    second = [first[0], [other], first[2]]
    assert pack_bucket(second[1])[1].equal(pack_bucket(first[1])[1])  # the very same bytes
    engine, sink, channel = _sync(store, [first, second], delta=True)
    assert channel.sent == SIZES + [SIZES[1]]  # version 1: bucket 1 alone
    held = engine.weights[other[0]]
    assert (held.shape, held.dtype) == (other[1].shape, other[1].dtype) and torch.equal(held, other[1])
