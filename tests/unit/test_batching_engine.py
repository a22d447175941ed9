"""The scheduler's continuous-batching front end (rollout/scheduler.py `BatchingEngine`): once
closed, or once an episode is cut, nothing more is generated for it, and close() returns only
when the worker has left the engine (the caller then releases its memory or updates weights)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from megatron_rl.rollout.base import Generation, SamplingParams
from megatron_rl.rollout.scheduler import BatchingEngine

PARAMS = SamplingParams(max_new_tokens=4)


class BlockingEngine:
    """An engine whose generate call blocks until released (or aborted, when `abortable`)."""

    def __init__(self, abortable: bool) -> None:
        self.calls: list[list[list[int]]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.aborts = 0
        if abortable:
            self.abort = self._abort

    def generate(self, prompts, params):
        self.calls.append([list(p) for p in prompts])
        self.entered.set()
        released = self.release.wait(timeout=10)
        finish = "stop" if released and not self.aborts else "abort"
        return [Generation(i, [1], [0.0], finish, 0) for i in range(len(prompts))]

    def _abort(self) -> None:
        self.aborts += 1
        self.release.set()


def _submit(batcher: BatchingEngine, loop, tokens: list[int]) -> concurrent.futures.Future:
    return asyncio.run_coroutine_threadsafe(batcher.generate(tokens, PARAMS), loop)


def _wait_queued(batcher: BatchingEngine, count: int) -> None:
    """Until `count` requests wait (what this thread submits or cancels reaches the loop on its turn)."""
    give_up = time.monotonic() + 5
    while len(batcher._pending) != count:
        assert time.monotonic() < give_up, "the requests were not queued"
        time.sleep(0.01)


def test_close_aborts_the_call_in_flight_and_cancels_queued_requests(loop):
    engine = BlockingEngine(abortable=True)
    batcher = BatchingEngine(engine, loop)
    first = _submit(batcher, loop, [1, 2])
    assert engine.entered.wait(timeout=5)
    queued = _submit(batcher, loop, [3, 4])  # waits while the worker is inside generate
    _wait_queued(batcher, 1)
    batcher.close()
    assert engine.aborts >= 1 and not batcher._thread.is_alive()
    assert engine.calls == [[[1, 2]]]  # the queued request was never generated
    assert first.result(timeout=5).finish_reason == "abort"
    with pytest.raises(concurrent.futures.CancelledError):
        queued.result(timeout=5)


def test_requests_of_cancelled_episodes_are_not_generated(loop):
    engine = BlockingEngine(abortable=False)
    batcher = BatchingEngine(engine, loop)
    first = _submit(batcher, loop, [1, 2])
    assert engine.entered.wait(timeout=5)
    cut = _submit(batcher, loop, [3, 4])
    kept = _submit(batcher, loop, [5, 6])
    _wait_queued(batcher, 2)
    cut.cancel()  # the episode was cut while its request waited
    _wait_queued(batcher, 1)
    engine.release.set()
    assert first.result(timeout=5).finish_reason == "stop" and kept.result(timeout=5).finish_reason == "stop"
    batcher.close()
    assert engine.calls == [[[1, 2]], [[5, 6]]]


def test_close_raises_when_the_call_in_flight_does_not_return(loop):
    engine = BlockingEngine(abortable=False)  # no abort(): generate runs to its end
    batcher = BatchingEngine(engine, loop)
    first = _submit(batcher, loop, [1, 2])
    assert engine.entered.wait(timeout=5)
    with pytest.raises(RuntimeError, match="did not return within"):
        batcher.close(timeout_s=0.3)
    engine.release.set()
    batcher.close()
    assert not batcher._thread.is_alive() and len(engine.calls) == 1
    assert first.result(timeout=5).finish_reason == "stop"  # the call was let finish, its result delivered
