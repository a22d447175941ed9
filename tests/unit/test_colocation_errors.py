"""ColocationController's error path: whatever fails after the trainer's offload, the engine
releases its memory and the trainer onloads before the error propagates; the weight version only
advances with a completed sync. (The phase order of successful rollouts is tested with real
trainers in tests/distributed/test_rollout_sync.py.)"""

from __future__ import annotations

import pytest

from megatron_rl.colocate import controller as colocate


class _Trainer:
    module = groups = model_cfg = None

    def __init__(self, log):
        self.log = log

    def offload(self):
        self.log.append("trainer.offload")

    def onload(self):
        self.log.append("trainer.onload")

    def onload_weights_for_sync(self, adapters_only=False):
        self.log.append("trainer.weights_on")

    def offload_weights_after_sync(self, adapters_only=False):
        self.log.append("trainer.weights_off")


class _Engine:
    def __init__(self, log, fail_release=False):
        self.log, self.fail_release = log, fail_release

    def resume_memory(self, tags):
        self.log.append(f"engine.resume {'+'.join(tags)}")

    def release_memory(self, tags):
        self.log.append("engine.release")
        if self.fail_release:
            raise RuntimeError("release failed")


def _controller(monkeypatch, fail_sync=False, fail_release=False):
    log: list[str] = []

    def sync(module, groups, model_cfg, engine, version, bucket_bytes):
        log.append(f"sync v{version}")
        if fail_sync:
            raise ConnectionError("sync failed")
    monkeypatch.setattr(colocate, "sync_weights", sync)
    return colocate.ColocationController(_Trainer(log), _Engine(log, fail_release)), log


def test_a_failed_generation_hands_the_memory_back(monkeypatch):
    ctl, log = _controller(monkeypatch)

    def generate():
        raise ValueError("generation failed")
    with pytest.raises(ValueError, match="generation failed"):
        ctl.rollout(generate)
    assert log[-2:] == ["engine.release", "trainer.onload"] and ctl.version == 1


def test_a_failed_sync_keeps_the_version_and_hands_the_memory_back(monkeypatch):
    ctl, log = _controller(monkeypatch, fail_sync=True)
    with pytest.raises(ConnectionError):
        ctl.rollout(lambda: None)
    assert log == ["trainer.offload", "engine.resume weights", "trainer.weights_on", "sync v1", "engine.release",
                   "trainer.onload"]
    assert ctl.version == 0


def test_a_failing_release_does_not_hide_the_rollouts_error_nor_skip_the_onload(monkeypatch):
    ctl, log = _controller(monkeypatch, fail_release=True)

    def generate():
        raise ValueError("generation failed")
    with pytest.raises(ValueError, match="generation failed"):
        ctl.rollout(generate)
    assert log[-1] == "trainer.onload"
    ctl, log = _controller(monkeypatch, fail_release=True)
    with pytest.raises(RuntimeError, match="release failed"):  # after a good rollout it is the error
        ctl.rollout(lambda: None)
    assert log[-1] == "trainer.onload" and ctl.version == 1


def test_the_memory_plan_names_the_engine_only_where_there_is_one(caplog):
    """A process without a rollout engine (disaggregated training without held-out prompts, ranks that own
    none) logs no engine weights or KV budget."""
    class Sized(_Trainer):
        def memory_plan(self):
            return {"params": 2e6, "grads": 2e6, "optimizer": 4e6}

    caplog.set_level("INFO", logger=colocate.logger.name)
    colocate.ColocationController(Sized([]), None).log_memory_plan()
    colocate.ColocationController(Sized([]), _Engine([])).log_memory_plan(kv_budget_bytes=3_000_000)
    plans = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory plan: trainer")]
    assert len(plans) == 2 and all("params 2.0 MB, grads 2.0 MB, optimizer 4.0 MB" in p for p in plans)
    assert "no rollout engine in this process" in plans[0] and "KV cache" not in plans[0]
    assert "KV cache budget 3.0 MB" in plans[1] and "no rollout engine" not in plans[1]
