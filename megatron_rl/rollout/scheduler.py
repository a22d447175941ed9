"""Asynchronous multi-turn rollouts: every episode is its own task, so while some wait on a
tool call or a reward the engine generates for the others.

- `BatchingEngine` puts a continuous-batching front end on an engine: episodes `await`
  single-turn requests; a worker thread takes whatever is queued (up to `max_batch`, after a
  short linger so that concurrent requests meet), orders it by prompt length (less padding),
  runs one `generate` call and hands each episode its turn. SGLang batches continuously
  inside the engine; this front end gives the hf engine the same property and keeps one
  code path. Time inside `generate` is the engine's busy time.
- `run_episodes_async` runs up to `max_concurrency` episodes at once (a per-engine limit).
  Over-sampling with an early cut: with `target_groups`, as soon as that many groups have
  all their episodes finished, the remaining (straggler) episodes are aborted: their
  environments are closed, they are returned with status "aborted" and left out of the
  batch, and counted; or, with `keep_partial`, kept as partial rollouts (what they generated
  so far, rewarded by verifying the environment as it stands; status "partial").
- A step deadline stops the episodes still running or waiting to start (status "deadline",
  counted); the sandbox's back-pressure (its queue fill) holds new episodes back while it is high.
- A cut or a deadline stops generation too: the stopped episodes' queued requests are dropped,
  the call in flight is aborted (`engine.abort()`) and waited for, so that when
  `run_episodes_async` returns the engine is idle (its memory may be released, its weights
  updated).
- Sampling seeds: a batch is seeded from its first request's seed; which requests share a
  batch depends on timing, so sampled tokens are not reproducible run to run in this mode
  (the lockstep driver in multiturn.py is, and stays the default).

Every generation batch, environment step and reward lands on the step's `Timeline`
(engine busy / idle fractions in the metrics, a Chrome trace on request).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Optional, Sequence

from megatron_rl.observability.timeline import Timeline
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.multiturn import (Episode, EpisodeLimits, TurnFormat, after_step, end_if_full,
                                           room_left, scheduler_stats, take_turn, turn_sampling)

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Request:
    tokens: list[int]
    params: SamplingParams
    future: asyncio.Future


class BatchingEngine:
    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, max_batch: int = 64, linger_s: float = 0.002,
                 timeline: Optional[Timeline] = None) -> None:
        self.engine, self.loop, self.max_batch, self.linger_s = engine, loop, max_batch, linger_s
        self.timeline = timeline or Timeline()
        self._pending: list[_Request] = []
        self._cond = threading.Condition()
        self._closed = False
        self._in_flight = False  # the worker is inside engine.generate
        self.batches = 0
        self._thread = threading.Thread(target=self._work, name="batching-engine", daemon=True)
        self._thread.start()

    async def generate(self, tokens: list[int], params: SamplingParams):
        request = _Request(list(tokens), params, self.loop.create_future())
        with self._cond:
            if self._closed:
                raise RuntimeError("generate on a closed BatchingEngine")
            self._pending.append(request)
            self._cond.notify()
        try:
            return await request.future
        except asyncio.CancelledError:  # the episode was cut while queued: its turn is not generated
            with self._cond:
                self._pending = [r for r in self._pending if r is not request]
            raise

    def close(self, timeout_s: float = 600.0) -> None:
        """Stop generating: queued requests are cancelled, a generate call in flight is aborted
        (`engine.abort()`, where the engine has one) and waited for. Returns only once the worker
        has left the engine, so that the caller may release the engine's memory or change its
        weights; raises RuntimeError if the call in flight has not returned within `timeout_s`."""
        with self._cond:
            self._closed = True
            dropped, self._pending = self._pending, []
            self._cond.notify()
        for r in dropped:
            self.loop.call_soon_threadsafe(_cancel, r.future)
        abort = getattr(self.engine, "abort", None)
        give_up = time.monotonic() + timeout_s
        while self._thread.is_alive():
            # Again each round: an abort that reached the engine before the call's requests did aborts nothing.
            if self._in_flight and abort is not None:
                try:
                    abort()
                except Exception as exc:  # e.g. a server that died: its generate call fails on its own
                    logger.warning("aborting the generate call in flight: %s", exc)
            left = give_up - time.monotonic()
            if left <= 0:
                how = "abort() did not stop it" if abort is not None else "it has no abort()"
                raise RuntimeError(f"the engine's generate call did not return within {timeout_s:g} s of closing the "
                                   f"batching front end ({type(self.engine).__name__}: {how}); it is still "
                                   "generating, so its memory cannot be released nor its weights updated")
            self._thread.join(timeout=min(1.0, left))

    def _take(self) -> list[_Request]:
        """The oldest live request's compatible requests (same sampling parameters but the seed);
        requests whose episode is gone (future already done: cancelled) are dropped."""
        self._pending = [r for r in self._pending if not r.future.done()]
        if not self._pending:
            return []
        key = dataclasses.replace(self._pending[0].params, seed=None)
        batch = [r for r in self._pending if dataclasses.replace(r.params, seed=None) == key][:self.max_batch]
        taken = {id(r) for r in batch}
        self._pending = [r for r in self._pending if id(r) not in taken]
        return sorted(batch, key=lambda r: len(r.tokens))

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                full = len(self._pending) >= self.max_batch
            if not full:
                time.sleep(self.linger_s)
            with self._cond:
                if self._closed:
                    return
                batch = self._take()
                self._in_flight = bool(batch)
            if not batch:
                continue
            start = time.perf_counter()
            try:
                gens = self.engine.generate([r.tokens for r in batch], batch[0].params)
                error = None
            except Exception as exc:  # handed to every waiting episode, never lost in this thread
                gens, error = [], exc
            finally:
                with self._cond:
                    self._in_flight = False
            self.timeline.add("generate", "engine", start, time.perf_counter(), batch=len(batch))
            self.batches += 1
            for i, r in enumerate(batch):
                self.loop.call_soon_threadsafe(_settle, r.future, None if error else gens[i], error)


def _cancel(future: asyncio.Future) -> None:
    future.cancel()


def _settle(future: asyncio.Future, result: Any, error: Optional[BaseException]) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def run_episodes_async(engine: Any, tasks: Sequence[dict[str, Any]], n: int, params: SamplingParams,
                       make_env: Callable[[], Any], fmt: TurnFormat, limits: EpisodeLimits,
                       loop: asyncio.AbstractEventLoop, max_concurrency: int = 64, max_batch: int = 64,
                       target_groups: Optional[int] = None, timeline: Optional[Timeline] = None,
                       deadline_s: Optional[float] = None, backpressure: Optional[Callable[[], Any]] = None,
                       max_backpressure: float = 0.8, keep_partial: bool = False, timeout_s: float = 3600.0
                       ) -> tuple[list[Episode], dict[str, float]]:
    """`n` episodes per task, concurrently; returns them all (dropped / aborted included) and
    the scheduling metrics (engine busy fraction, aborted count, episodes' wall time).

    `deadline_s`: episodes still running or not yet started then are stopped (status "deadline") and the step
    goes on with what completed. `backpressure`: an async callable returning the sandbox's
    load in [0, 1] (`SandboxClient.backpressure`); no new episode starts while it exceeds
    `max_backpressure` (episodes already running continue). `keep_partial`: stragglers cut at
    the early cut are kept as partial rollouts (status "partial": what they generated so far,
    rewarded by their environment's verification at that point) instead of being dropped."""
    timeline = timeline or Timeline()
    start = time.perf_counter()
    policy = _Admission(target_groups, deadline_s, backpressure, max_backpressure, keep_partial)
    episodes = asyncio.run_coroutine_threadsafe(
        _run_all(engine, tasks, n, params, make_env, fmt, limits, loop, max_concurrency, max_batch, policy,
                 timeline), loop).result(timeout_s)
    wall = time.perf_counter() - start
    return episodes, scheduler_stats(episodes, timeline, start, wall, policy.waited_s)


def combine_engines(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """One step's `sched/...` metrics from the schedulers of several engines (one per data-parallel
    rank, or per block of rollout.tp ranks; `{}` from ranks that drive none), which ran at the same
    time: the step waited for the slowest (`sched/wall_s`: the longest), `sched/engine_busy` is the
    engines' busy seconds over their wall seconds (their utilisation, weighted by wall time), counts
    and waits are summed. One engine's metrics come back as they are."""
    parts = [p for p in parts if p]
    if not parts:
        return {}
    keys = sorted({k for p in parts for k in p if k.startswith("sched/")})
    out = {k: sum(p.get(k, 0.0) for p in parts) for k in keys}
    walls = [p["sched/wall_s"] for p in parts]
    out["sched/wall_s"] = max(walls)
    out["sched/engine_busy"] = sum(p["sched/engine_busy"] * w for p, w in zip(parts, walls)) / max(sum(walls), 1e-9)
    return out


@dataclasses.dataclass
class _Admission:
    target_groups: Optional[int]
    deadline_s: Optional[float]
    backpressure: Optional[Callable[[], Any]]
    max_backpressure: float
    keep_partial: bool = False
    waited_s: float = 0.0
    deadline_hit: bool = False

    async def wait_for_room(self) -> None:
        if self.backpressure is None:
            return
        start, delay = time.perf_counter(), 0.05
        while await self.backpressure() > self.max_backpressure:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
        self.waited_s += time.perf_counter() - start


async def _run_all(engine, tasks, n, params, make_env, fmt, limits, loop, max_concurrency, max_batch,
                   policy: _Admission, timeline) -> list[Episode]:
    target_groups = policy.target_groups
    batcher = BatchingEngine(engine, loop, max_batch=max_batch, timeline=timeline)
    slots = asyncio.Semaphore(max_concurrency)
    done_per_group = [0] * len(tasks)
    complete = asyncio.Event()
    episodes = [Episode(g, fmt.encode(fmt.prompt(task["instruction"])), [], [], "stop", -1)
                for g, task in enumerate(tasks) for _ in range(n)]

    async def one(k: int, ep: Episode) -> None:
        async with slots:
            await policy.wait_for_room()
            await _episode(k, ep, tasks[ep.prompt_index], batcher, params, make_env, fmt, limits, timeline,
                           policy)
        if ep.status == "aborted":  # cancelled while it ran (`_episode` returns then): not a finished episode
            return
        done_per_group[ep.prompt_index] += 1
        if target_groups is not None and sum(c == n for c in done_per_group) >= target_groups:
            complete.set()

    runners = [asyncio.ensure_future(one(k, ep)) for k, ep in enumerate(episodes)]
    everything = asyncio.gather(*runners, return_exceptions=True)
    try:
        waiter = asyncio.ensure_future(complete.wait())
        await asyncio.wait([everything, waiter], timeout=policy.deadline_s, return_when=asyncio.FIRST_COMPLETED)
        late = not everything.done() and not complete.is_set()  # the deadline passed first
        policy.deadline_hit = late
        for r in runners:
            r.cancel()
        await asyncio.gather(*runners, return_exceptions=True)
        waiter.cancel()
        for ep in episodes:  # cancelled while running ("aborted") or while waiting to start (no status yet)
            if ep.status in ("", "aborted"):
                ep.status, ep.reward = "deadline" if late else "aborted", 0.0
    finally:
        await asyncio.to_thread(batcher.close)
    for ep, outcome in zip(episodes, [r.exception() if r.done() and not r.cancelled() else None for r in runners]):
        if outcome is not None:
            raise outcome
    for ep in episodes:  # a group cut short is left out whole (its baseline would be biased)
        incomplete = done_per_group[ep.prompt_index] < n or ep.status == "aborted"
        if target_groups is not None and ep.status != "deadline" and incomplete:
            ep.status, ep.reward = "aborted", 0.0
    return episodes


async def _episode(k: int, ep: Episode, task: dict[str, Any], batcher: BatchingEngine, params: SamplingParams,
                   make_env: Callable[[], Any], fmt: TurnFormat, limits: EpisodeLimits, timeline: Timeline,
                   policy: Optional[_Admission] = None) -> None:
    from megatron_rl.envs.base import InfrastructureError

    env, track, started = make_env(), f"episode {k:03d}", time.monotonic()
    reset = False
    try:
        with timeline.span("reset", track):
            await env.reset(task)
        reset = True
        while not ep.status and not end_if_full(ep, limits):
            seed = None if params.seed is None else params.seed * 1009 + k * 131 + ep.num_turns
            turn_params = turn_sampling(params, fmt, seed, room_left(ep, limits))
            with timeline.span("generate (queued + batched)", track):
                gen = await batcher.generate(ep.prompt_tokens + ep.output_ids, turn_params)
            closed, text = take_turn(ep, gen, fmt, limits)
            with timeline.span("environment", track):
                observation, done = await env.step(text)
            after_step(ep, observation, done, closed, fmt, limits, started)
        with timeline.span("reward", track):
            ep.reward = float(await env.evaluate())
        ep.info = dict(getattr(env, "info", {}))
    except InfrastructureError as err:
        logger.warning("episode %d of task %d dropped: %s", k, ep.prompt_index, err)
        ep.status, ep.reward = "dropped", 0.0
        ep.infra_errors += 1
    except asyncio.CancelledError:
        ep.status, ep.reward = "aborted", 0.0  # cut as a straggler: not trained on, counted
        keep = policy is not None and policy.keep_partial and not policy.deadline_hit
        if keep and reset and not ep.info:  # or kept as a partial rollout, verified as it stands
            try:
                with timeline.span("reward (partial)", track):
                    ep.reward = float(await env.evaluate())
                ep.status, ep.finish_reason, ep.info = "partial", "length", dict(getattr(env, "info", {}))
            except InfrastructureError:
                ep.status = "dropped"
    finally:
        ep.model_errors = getattr(env, "model_errors", 0)
        ep.infra_errors += getattr(env, "infra_errors", 0)
        try:
            await env.close()
        except Exception:  # closing a session of a dead server: nothing left to free
            pass
