"""ColocationController with weight_sync="adapters" (rollout.weight_sync=adapters): which weights each rollout
pushes and which memory the engine gives back. The base weights go once, with the adapters; later rollouts
push the adapters alone and the engine keeps its weights (only the KV cache is released); weights loaded into
the trainer again (a checkpoint, an HF export) or a failed rollout make the next rollout push the base again.
(Parity of what arrives: tests/distributed/test_adapter_sync.py.)"""

from __future__ import annotations

import pytest

from megatron_rl.colocate import controller as colocate
from megatron_rl.weight_sync.stream import SyncStats


class _Trainer:
    module = groups = model_cfg = None

    def __init__(self, log):
        self.log, self.weights_loaded = log, 0

    def offload(self):
        pass

    def onload(self):
        pass

    def onload_weights_for_sync(self, adapters_only=False):
        self.log.append("params on" + (" (adapters)" if adapters_only else ""))

    def offload_weights_after_sync(self, adapters_only=False):
        self.log.append("params off" + (" (adapters)" if adapters_only else ""))


class _Engine:
    def __init__(self, log):
        self.log = log

    def resume_memory(self, tags):
        self.log.append(f"resume {'+'.join(tags)}")

    def release_memory(self, tags):
        self.log.append(f"release {'+'.join(tags)}")


def _controller(monkeypatch, weight_sync="adapters"):
    log: list[str] = []

    def sync(module, groups, model_cfg, engine, version, bucket_bytes, merged=True):
        log.append(f"weights v{version}" + ("" if merged else " base"))
        return SyncStats(version, 10, 1000, 1, 0.0)

    def sync_adapters(module, groups, model_cfg, engine, version):
        log.append(f"adapters v{version}")
        return SyncStats(version, 4, 10, 1, 0.0)
    monkeypatch.setattr(colocate, "sync_weights", sync)
    monkeypatch.setattr(colocate, "sync_adapters", sync_adapters)
    trainer = _Trainer(log)
    return colocate.ColocationController(trainer, _Engine(log), weight_sync=weight_sync), trainer, log


def _rollout(ctl, log) -> list[str]:
    log.clear()
    ctl.rollout(lambda: None)
    return list(log)


def test_the_base_goes_once_then_the_adapters_alone(monkeypatch):
    ctl, _, log = _controller(monkeypatch)
    assert _rollout(ctl, log) == ["resume weights", "params on", "weights v1 base", "adapters v1", "params off",
                                  "resume kv_cache", "release kv_cache"]
    assert (ctl.last_sync.num_tensors, ctl.last_sync.num_bytes) == (14, 1010)  # both parts counted
    for version in (2, 3):
        # the trainer brings back its adapters alone, the engine keeps its weights
        assert _rollout(ctl, log) == ["params on (adapters)", f"adapters v{version}", "params off (adapters)",
                                      "resume kv_cache", "release kv_cache"]
    assert (ctl.last_sync.num_bytes, ctl.version) == (10, 3)


def test_weights_loaded_into_the_trainer_send_the_base_again(monkeypatch):
    ctl, trainer, log = _controller(monkeypatch)
    _rollout(ctl, log)
    trainer.weights_loaded += 1  # e.g. evaluation loading the next checkpoint
    assert _rollout(ctl, log)[:4] == ["resume weights", "params on", "weights v2 base", "adapters v2"]
    assert _rollout(ctl, log)[:2] == ["params on (adapters)", "adapters v3"]


def test_a_failed_rollout_releases_everything_and_the_next_sends_the_base(monkeypatch):
    ctl, _, log = _controller(monkeypatch)
    _rollout(ctl, log)
    log.clear()

    def generate():
        raise ValueError("generation failed")
    with pytest.raises(ValueError, match="generation failed"):
        ctl.rollout(generate)
    assert log == ["params on (adapters)", "adapters v2", "params off (adapters)", "resume kv_cache",
                   "release weights+kv_cache"]
    assert _rollout(ctl, log)[:4] == ["resume weights", "params on", "weights v3 base", "adapters v3"]


def test_full_sync_is_unchanged(monkeypatch):
    ctl, _, log = _controller(monkeypatch, weight_sync="full")
    for version in (1, 2):
        assert _rollout(ctl, log) == ["resume weights", "params on", f"weights v{version}", "params off",
                                      "resume kv_cache", "release weights+kv_cache"]
    with pytest.raises(ValueError, match="weight_sync='lora'"):
        colocate.ColocationController(_Trainer([]), None, weight_sync="lora")
