"""Delta weight sync with a real Megatron model and the hf engine (rollout.weight_sync_delta, disaggregated mode).

One process trains (a tiny Qwen2 built by the trainer); the weight group of two (gloo) links it to a generator
thread of the same process whose `WeightReceiver` loads an `HFEngine` (engine A) with delta on. A second
`HFEngine` (B) gets a plain full sync of the same weights by name, as an engine in another process would. Between
versions only part of the model moves, as in the runs where delta pays:

- frozen layers: only the last layer's weights change (what an optimizer step leaves when layers 0-2 are frozen);
- LoRA with weight_sync=full, adapters on linear_qkv only: the merged W + (alpha / r) B A of the attention's
  QKV changes, every other weight does not.

Each version, engine A's weights equal engine B's bit for bit, and the bytes the sink broadcast equal the bytes of
the buckets in which some HF tensor differs from the previous version (found by comparing the tensors themselves,
recorded from B's sync, not by any digest).
"""

from __future__ import annotations

import threading

import pytest
import torch

from tests.distributed.launcher import run_spawned

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
KEY = b"d" * 32
BUCKET_BYTES = 40_000  # several buckets per layer of the tiny model


class _Recording:
    """Engine B by name (`update_weights` alone, as in another process), keeping each version's buckets."""

    def __init__(self, engine) -> None:
        self.engine, self.buckets = engine, []

    def update_weights(self, named_tensors, version, flush=True):
        named = [(n, t.detach().clone()) for n, t in named_tensors]
        self.buckets.append(named)
        self.engine.update_weights(named, version, flush)


def _changed_bytes(previous, current) -> int:
    """Bytes of the buckets of `current` that differ from `previous` (same bucket list shape) in any tensor."""
    total = 0
    for old, new in zip(previous, current):
        assert [n for n, _ in old] == [n for n, _ in new]
        if any(not torch.equal(a, b) for (_, a), (_, b) in zip(old, new)):
            total += sum(t.numel() * t.element_size() for _, t in new)
    return total


def _worker(rank, world, scenario, out):
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.disagg.weights import BroadcastSink, WeightReceiver
    from megatron_rl.models.lora import LoRAAdapter
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.parallel.dist import WeightUpdateGroup, free_port, weight_update_store
    from megatron_rl.rollout.hf_engine import HFEngine
    from megatron_rl.trainer.core import Trainer, TrainerOptions
    from megatron_rl.weight_sync.stream import sync_weights

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    lora = scenario == "lora"
    model_cfg = ModelConfig(num_layers=4, lora_rank=4 if lora else 0, lora_targets=["linear_qkv"])
    groups = state.initialize(1, 1)
    trainer = Trainer(model_cfg, OptimizerConfig(lr=1e-2), groups, TrainerOptions(micro_batch_tokens=256))
    trainer.initialize_weights()
    model = trainer.module

    def move(version: int) -> None:
        """What a step changes: the adapters' B (LoRA) or the last layer's weights (layers 0-2 frozen)."""
        gen = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for name, module in model.named_modules():
                if lora and isinstance(module, LoRAAdapter):
                    module.b.add_(0.01 * torch.randn(module.b.shape, generator=gen))
            if not lora:
                for name, param in model.named_parameters():
                    if ".layers.3." in name:
                        param.add_(0.01 * torch.randn(param.shape, generator=gen))

    port = free_port()
    store = weight_update_store("127.0.0.1", port, 2, is_master=True, timeout_s=60)
    engine_a, engine_b = HFEngine(model_cfg), HFEngine(model_cfg)
    errors: list[BaseException] = []
    versions = 3

    def generator() -> None:
        try:
            peer = weight_update_store("127.0.0.1", port, 2, is_master=False, timeout_s=60)
            receiver = WeightReceiver(WeightUpdateGroup(peer, 1, 2, torch.device("cpu"), 60), peer, engine_a, KEY)
            for version in range(versions):
                receiver.receive(version)
        except BaseException as exc:  # raised in the main thread below
            errors.append(exc)

    thread = threading.Thread(target=generator)
    thread.start()
    sink = BroadcastSink(WeightUpdateGroup(store, 0, 2, torch.device("cpu"), 60), store, KEY, delta=True)
    recording = _Recording(engine_b)
    sent, full, expected = [], [], []
    for version in range(versions):
        if version:
            move(version)
        recording.buckets = []
        sync_weights(model, groups, model_cfg, sink, version, BUCKET_BYTES)
        previous = None if version == 0 else this
        sync_weights(model, groups, model_cfg, recording, version, BUCKET_BYTES)
        this = recording.buckets
        sent.append(sink.last_counts.bytes_sent)
        full.append(sink.last_counts.bytes_full)
        expected.append(full[-1] if previous is None else _changed_bytes(previous, this))
    thread.join(timeout=120)
    if errors:
        raise errors[0]
    a, b = engine_a.model.state_dict(), engine_b.model.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    assert engine_a.health()["weight_version"] == versions - 1
    torch.save({"sent": sent, "full": full, "expected": expected, "buckets": len(this)}, out)


@pytest.mark.parametrize("scenario", ["frozen_layers", "lora"])
def test_delta_sends_only_the_changed_buckets_and_the_engine_is_bit_identical(tmp_path, scenario):
    out = tmp_path / "delta.pt"
    run_spawned(_worker, 1, scenario, str(out), timeout_s=240)
    got = torch.load(out)
    assert got["sent"] == got["expected"], got
    assert got["sent"][0] == got["full"][0]  # the first version: every bucket
    # most bytes stay put: a quarter of the layers, or the QKV of each layer, plus what shares their buckets
    assert all(0 < s < f * 0.6 for s, f in zip(got["sent"][1:], got["full"][1:])), got
