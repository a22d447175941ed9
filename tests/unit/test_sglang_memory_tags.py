"""`SGLangEngine.release_memory` / `resume_memory` send SGLang only the regions whose state changes: on GPU,
torch_memory_saver ends the scheduler process when a region is paused twice (the colocation controller's
hand-back releases everything after a rollout that failed before the KV cache was resumed). A release that
the engine sends while it is not paused first waits for SGLang's scheduler to be idle (a flush with a timeout):
SGLang asserts idleness in `release_memory_occupation` and answers requests before it retires their batch. The
engine's bookkeeping is checked against a recording transport (no SGLang process)."""

from __future__ import annotations

from megatron_rl.rollout.base import TAG_KV_CACHE, TAG_WEIGHTS
from megatron_rl.rollout.sglang_engine import IDLE_WAIT_S, SGLangEngine


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self.flushes: list[tuple[int, float]] = []  # (number of calls before it, wait)

    def call(self, name: str, payload: dict) -> dict:
        self.calls.append((name, list(payload["tags"])))
        return {}

    def flush_cache(self, wait_s: float) -> None:
        self.flushes.append((len(self.calls), wait_s))


def _engine() -> tuple[SGLangEngine, _Recorder]:
    engine = SGLangEngine.__new__(SGLangEngine)  # no engine process: only the tag bookkeeping runs
    engine._transport, engine._released, engine._paused = _Recorder(), set(), False
    return engine, engine._transport


def test_a_failed_rollouts_hand_back_releases_only_what_was_resumed():
    engine, sent = _engine()
    engine.release_memory([TAG_WEIGHTS, TAG_KV_CACHE])  # after start-up
    engine.resume_memory([TAG_WEIGHTS])  # the rollout resumed the weights, then its sync failed
    engine.release_memory([TAG_WEIGHTS, TAG_KV_CACHE])  # the controller's hand-back
    assert sent.calls == [("release_memory_occupation", [TAG_WEIGHTS, TAG_KV_CACHE]),
                          ("resume_memory_occupation", [TAG_WEIGHTS]),
                          ("release_memory_occupation", [TAG_WEIGHTS])]
    engine.release_memory()  # everything released already: nothing sent
    engine.resume_memory([TAG_KV_CACHE])
    engine.resume_memory([TAG_WEIGHTS, TAG_KV_CACHE])  # only the weights are still released
    assert sent.calls[3:] == [("resume_memory_occupation", [TAG_KV_CACHE]),
                              ("resume_memory_occupation", [TAG_WEIGHTS])]
    engine.resume_memory()
    assert len(sent.calls) == 5 and engine._released == set()


def test_a_release_waits_for_the_scheduler_to_be_idle_unless_paused():
    engine, sent = _engine()
    engine.release_memory([TAG_KV_CACHE])
    engine.release_memory([TAG_KV_CACHE])  # nothing to release: no flush either
    engine.resume_memory([TAG_KV_CACHE])
    engine._paused = True
    engine.release_memory([TAG_WEIGHTS, TAG_KV_CACHE])
    assert [name for name, _ in sent.calls] == ["release_memory_occupation", "resume_memory_occupation",
                                                 "release_memory_occupation"]
    assert sent.flushes == [(0, IDLE_WAIT_S)]  # before the first release only
