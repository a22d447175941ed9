"""One generator process of disaggregated mode: it owns a rollout engine and a reward service
and turns prompt requests into scored groups for the experience buffer.

The same components as colocated mode: the engine comes from `rollout.factory` (`HFEngine` or
`SGLangEngine`, chosen by `rollout.backend`), the verifiers from the run's task (rewards are
computed as in `rollout.collect`: the decoded response and the prompt's meta go to
`RewardService.submit`). It loops:

    apply a pending weight update (if the trainer announced one)
    -> take the next request (the trainer owns the sampler and sends prompt batches)
    -> generate it in chunks of rollout.partial_rollout_tokens (updates applied between chunks)
       and score; an agent task's prompts are played as multi-turn episodes instead (as in
       colocated mode: rollout.multiturn / rollout.scheduler, this generator's environments;
       with partial rollouts, updates applied between turns)
    -> put one ExperienceGroup per prompt into the buffer (blocks while it is full, still
       applying updates); an agent task's groups carry their share of the
       scheduler's statistics (`buffer.scheduler_shares`), which become the trainer's `sched/...`
       metrics

Every engine call, weight update, scoring and blocked put is written to
`<run_dir>/timeline/generator<i>.jsonl`; the log goes to `<run_dir>/logs/generator<i>.log`.
Each of these steps, and each round of a wait, stamps the generator's progress clock
(`channel.Progress`), which its heartbeat reports: the trainer stops with an error when it
stands still for rollout.generator_progress_timeout_s (the loop hangs), not only when the
heartbeat stops (the process died).
Requests, experience and the stop signal come over the trainer's hub (megatron_rl/disagg/channel.py).
Slurm's stop signals (srun's USR1, the job's SIGTERM) reach the generators too; the trainer acts on
them, so a generator logs them and serves on until the trainer stops it (SIGINT or SIGKILL ends it at
once: `preemption.helper_defers_stop_signals`).
With `rollout.generator_nodes=0` trainer rank 0 starts the generators (multiprocessing 'spawn');
otherwise they are started separately, on any node that reaches the trainer:

    python -m megatron_rl.disagg.generator --run-dir RUN_DIR [--index I]

(the Slurm job's generator step does this on the last rollout.generator_nodes nodes; the index
defaults to SLURM_PROCID, the GPU to SLURM_LOCALID). See megatron_rl/disagg/controller.py for
the process picture.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import logging
import math
import os
import queue
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from megatron_rl.disagg.buffer import ExperienceGroup, scheduler_shares
from megatron_rl.disagg.events import EventLog
from megatron_rl.preemption import helper_defers_stop_signals
from megatron_rl.rollout.base import SamplingParams

logger = logging.getLogger(__name__)
GO_KEY = "go"  # set by the trainer (value: the first weight version) once it joins the group


@dataclasses.dataclass
class GeneratorSpec:
    index: int
    cfg: Any  # the run's TrainConfig
    run_dir: str
    store_host: str
    store_port: int
    num_generators: int
    num_local_trainer_ranks: int  # on the trainer's node: the GPUs before this generator's (0 elsewhere)
    sandbox_addresses: list[str]


@dataclasses.dataclass
class Request:
    """A batch of prompts to generate `params.n` samples each for (one group per prompt)."""

    request_id: int
    source_indices: list[int]  # each prompt's index in the training prompt list
    prompts: list[tuple[list[int], dict]]  # (token ids, the verifier's meta)
    params: SamplingParams


class _Stopped(Exception):
    pass


def run_local_generator(index: int, host: str, port: int, key: bytes) -> None:
    """Target of the generators trainer rank 0 spawns on its own node."""
    from megatron_rl.disagg.channel import connect

    run_generator(connect(host, port, key), index, local_index=index, hub_key=key)


def run_generator(hub: Any, index: int, local_index: int, hub_key: bytes) -> None:
    """The generator's main function: `hub` is its proxy of the trainer's `channel.Endpoint`,
    `hub_key` the key it connected with (it also authenticates the weight store's values);
    `local_index` picks the device among the GPUs of this node left to generators."""
    from megatron_rl.data.domains import make_task
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.disagg.channel import Progress, heartbeat
    from megatron_rl.observability import init_logger
    from megatron_rl.parallel.dist import generator_device
    from megatron_rl.rewards.service import RewardService
    from megatron_rl.rollout.factory import make_standalone_engine

    spec: GeneratorSpec = hub.spec(index)
    cfg, run_dir = spec.cfg, Path(spec.run_dir)
    init_logger(index + 1, cfg.logging.level, run_dir / "logs" / f"generator{index}.log")
    if threading.current_thread() is threading.main_thread():
        helper_defers_stop_signals(f"generator {index}")  # Slurm signals every process; the trainer acts on it
    device = generator_device(cfg.cluster.device, local_index, spec.num_local_trainer_ranks, cfg.rollout.tp)
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    hub.join(index, {"host": host, "pid": os.getpid(), "device": str(device)})
    beating, progress = threading.Event(), Progress()
    heartbeat(hub, index, beating, progress)
    logger.info("generator %d of %d on %s (pid %d, %s), trainer at %s", index, spec.num_generators, host,
                os.getpid(), device, spec.store_host)
    error = None
    try:
        tokenizer = load_tokenizer(cfg.model.tokenizer, cfg.model.trust_remote_code)
        task = make_task(cfg, tokenizer)
        progress.stamp()
        engine = make_standalone_engine(cfg, tokenizer, device=device, index=index, work_dir=run_dir)
        progress.stamp()
        rewards = RewardService(task.verifier_factory(spec.sandbox_addresses))
        events = EventLog(run_dir / "timeline" / f"generator{index}.jsonl")
        try:
            _loop(spec, index, hub, hub_key, engine, rewards, task, tokenizer, device, events, progress.stamp)
        finally:
            rewards.close()
            events.close()
            engine.shutdown()
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        logger.exception("generator %d failed", index)
        raise
    finally:
        beating.set()
        try:
            hub.stopped(index, error)  # a failure reaches the trainer at once, not after the heartbeat timeout
        except (OSError, EOFError):
            pass  # the trainer has gone already


def _loop(spec: GeneratorSpec, index: int, hub: Any, hub_key: bytes, engine: Any, rewards: Any, task: Any,
          tokenizer: Any, device: Any, events: EventLog, progress: Callable[[], None]) -> None:
    from megatron_rl.disagg.weights import WeightReceiver, read_start
    from megatron_rl.parallel.dist import WeightUpdateGroup, weight_update_store

    world = 1 + spec.num_generators
    timeout_s = spec.cfg.rollout.weight_update_timeout_s
    store = weight_update_store(spec.store_host, spec.store_port, world, is_master=False, timeout_s=timeout_s)
    hub.ready(index)
    while not store.check([GO_KEY]):  # the trainer's warm start runs meanwhile
        if hub.stopping():
            return
        progress()
        time.sleep(0.2)
    first_version = read_start(store, hub_key, GO_KEY)  # before joining the group: a forged signal is refused
    group = WeightUpdateGroup(store, index + 1, world, device, timeout_s)
    receiver = WeightReceiver(group, store, engine, hub_key,
                              on_update=lambda v, s, e: events.write("weights", s, e, version=v), progress=progress)
    receiver.receive(first_version)
    logger.info("generator %d ready on %s with weights v%d", index, device, receiver.version)

    def between_chunks() -> None:
        if hub.stopping():
            raise _Stopped
        progress()
        receiver.poll()

    try:
        while not hub.stopping():
            progress()
            receiver.poll()
            try:
                request = hub.get_request(timeout=0.05)
            except queue.Empty:
                continue
            for item in serve(spec.cfg, index, request, task, engine, rewards, tokenizer, between_chunks, events,
                              progress):
                _put(hub, item, receiver, events, progress)
    except _Stopped:
        pass
    finally:
        logger.info("generator %d stops at weights v%d", index, receiver.version)


def serve(cfg: Any, index: int, request: Request, task: Any, engine: Any, rewards: Any, tokenizer: Any,
          between_calls: Callable[[], None], events: EventLog,
          progress: Callable[[], None] = lambda: None) -> list[ExperienceGroup]:
    """One request's scored groups, one per prompt (in the request's order). Single-turn prompts
    are completed (`_complete`), an agent task's prompts played as episodes (`_play`); a joint
    run's request may hold both, each agent domain played with its own environments.
    `between_calls()` runs between engine calls that may take a weight update (partial rollouts);
    `progress()` before and after every engine call, and while rewards are awaited."""
    from megatron_rl.rewards.counts import VerifierCounts

    counts = VerifierCounts.of(rewards.verifier)
    faults = {"reward/timeouts": 0.0, "reward/failed_batches": 0.0}
    agents = {"": task.cfg} if task.is_agent else {d: task.tasks[d].cfg for d in getattr(task, "agent_domains", ())}
    shares: dict[Optional[str], list[int]] = {}  # agent domain ("": the agent task) or None: single-turn
    for p, (_, meta) in enumerate(request.prompts):
        domain = "" if task.is_agent else meta.get("domain", "")
        shares.setdefault(domain if domain in agents else None, []).append(p)
    samples: dict[int, list[tuple[Any, list[int]]]] = {}
    spans: dict[int, tuple[float, float]] = {}
    sched: dict[int, dict[str, float]] = {}
    for domain, positions in shares.items():
        start = time.time()
        if domain is None:
            got = _complete(cfg, request, positions, engine, rewards, tokenizer, between_calls, events, progress,
                            faults)
        else:
            host = rewards.verifier if task.is_agent else rewards.verifier.verifiers[domain]
            got, stats = _play(cfg, request, positions, agents[domain], engine, host, rewards.loop, tokenizer,
                               between_calls, events, progress)
            played = {p: [episode for episode, _ in got[p]] for p in positions}
            sched.update(scheduler_shares(stats, played, f"domain/{domain}/" if domain else ""))
        samples.update(got)
        spans.update({p: (start, time.time()) for p in positions})
    unscored = sum(r.status == "unscored" for p in samples for r, _ in samples[p])
    counted = {**counts.since(rewards.verifier), **faults, "reward/unscored": float(unscored)}
    out = []
    for p, (tokens, meta) in enumerate(request.prompts):
        for rollout, _ in samples[p]:
            rollout.prompt_index, rollout.source_index = p, request.source_indices[p]
            rollout.domain = meta.get("domain", "")
        out.append(ExperienceGroup(request.request_id, [r for r, _ in samples[p]], [v for _, v in samples[p]],
                                   index, spans[p], sched.get(p, {}), counted if p == 0 else {}))
    return out


def _complete(cfg: Any, request: Request, positions: list[int], engine: Any, rewards: Any, tokenizer: Any,
              between_chunks: Callable[[], None], events: EventLog, progress: Callable[[], None],
              faults: dict[str, float]) -> dict[int, list[tuple[Any, list[int]]]]:
    """Single-turn prompts: `params.n` completions each, generated in chunks of
    rollout.partial_rollout_tokens (updates applied between chunks), then scored; a late or failed reward batch
    is counted in `faults` (`reward/timeouts`, `reward/failed_batches`)."""
    from megatron_rl.rollout.collect import Rollout
    from megatron_rl.rollout.partial import generate_partial

    prompts = [request.prompts[p] for p in positions]
    gens = generate_partial(_LoggedEngine(engine, lambda: None, events, request.request_id, progress),
                            [tokens for tokens, _ in prompts], request.params, cfg.rollout.partial_rollout_tokens,
                            between_chunks)
    end = time.time()
    metas = [prompts[g.prompt_index][1] for g in gens]
    texts = [tokenizer.decode(g.output_ids, skip_special_tokens=True) for g in gens]
    status = ""
    try:
        scores = _result(rewards.submit(list(zip(metas, texts))), 300.0, progress)
    except Exception as exc:  # noqa: BLE001  (late or failed: unscored, as in rollout.collect)
        late = isinstance(exc, concurrent.futures.TimeoutError)
        logger.warning("request %d: rewards %s; its samples are left out of the update", request.request_id,
                       "timed out" if late else f"failed: {exc!r}")
        scores, status = [0.0] * len(gens), "unscored"
        faults["reward/timeouts" if late else "reward/failed_batches"] += 1.0
    events.write("score", end, time.time(), request=request.request_id)
    out: dict[int, list[tuple[Any, list[int]]]] = {}
    for g, score in zip(gens, scores):
        p = positions[g.prompt_index]
        lost = math.isnan(score)  # the verifier's "no verdict" (rewards/custom.py: NO_VERDICT)
        rollout = Rollout(p, list(request.prompts[p][0]), g.output_ids, g.logprobs, g.finish_reason,
                          g.weight_version, reward=0.0 if lost else float(score), status="unscored" if lost else status,
                          routing=g.routing)
        out.setdefault(p, []).append((rollout, g.token_versions))
    return out


def _play(cfg: Any, request: Request, positions: list[int], task_cfg: Any, engine: Any, host: Any, loop: Any,
          tokenizer: Any, between_turns: Callable[[], None], events: EventLog,
          progress: Callable[[], None]) -> tuple[dict[int, list[tuple[Any, list[int]]]], dict[str, float]]:
    """An agent task's prompts: `params.n` episodes each, as colocated mode plays them
    (rollout.agent_scheduler: lockstep or async, the task's turn format and episode limits) on
    this generator's engine and environments. With partial rollouts (rollout.partial_rollout_tokens
    > 0) a pending weight update is applied before any turn, so an episode may span versions (its
    turns keep theirs: `Episode.turn_versions`); otherwise updates wait for the whole request.
    Also returns the scheduler's statistics (`scheduler_stats`), its engine-busy fraction
    counting generation only: the updates ran inside its engine calls."""
    from megatron_rl.envs.agent_program import AgentProgramHost
    from megatron_rl.observability.timeline import Timeline
    from megatron_rl.rollout.multiturn import (EpisodeLimits, TurnFormat, run_episodes, scheduler_stats,
                                               task_system_prompt)
    from megatron_rl.rollout.scheduler import run_episodes_async

    r = cfg.rollout
    turns = _LoggedEngine(engine, between_turns if r.partial_rollout_tokens else (lambda: None), events,
                          request.request_id, progress)
    fmt, limits = TurnFormat(tokenizer, task_system_prompt(task_cfg)), EpisodeLimits.of(task_cfg)
    tasks = [request.prompts[p][1] for p in positions]
    version = engine.weight_version  # of the episodes that end before their first turn
    stats: dict[str, float] = {}
    if r.agent_scheduler == "async":
        client = getattr(host, "client", None)
        episodes, stats = run_episodes_async(turns, tasks, request.params.n, request.params, host.make_env, fmt,
                                             limits, loop, max_concurrency=r.max_concurrent_episodes,
                                             backpressure=getattr(client, "backpressure", None))
    else:
        timeline, begun = Timeline(), time.perf_counter()
        episodes = run_episodes(turns, tasks, request.params.n, request.params, host.make_env, fmt, limits, loop,
                                timeline=timeline)
        stats = scheduler_stats(episodes, timeline, begun, time.perf_counter() - begun)
    wall = stats["sched/wall_s"]
    busy = max(stats["sched/engine_busy"] * wall - turns.before_s, 0.0)
    stats["sched/engine_busy"] = busy / max(wall, 1e-9)
    if not isinstance(host, AgentProgramHost):  # as colocated mode counts episodes (rollout/episodes.py)
        host.calls += len(episodes)
        host.errors += sum(e.status == "dropped" for e in episodes)
    out: dict[int, list[tuple[Any, list[int]]]] = {}
    for episode in episodes:
        if not episode.turn_versions:
            episode.weight_version = version
        out.setdefault(positions[episode.prompt_index], []).append((episode, episode.turn_versions or [version]))
    return out, stats


class _LoggedEngine:
    """The engine as a request's generation sees it: each call goes to the timeline (`generate`
    events); `before()` runs before each call (episodes with partial rollouts: a pending weight
    update; it raises when the trainer stops), `before_s` sums its time; `progress()` runs before
    and after each call (a call that never returns stops the generator's progress clock)."""

    def __init__(self, engine: Any, before: Callable[[], None], events: EventLog, request_id: int,
                 progress: Callable[[], None] = lambda: None) -> None:
        self.engine, self.before, self.events, self.request_id = engine, before, events, request_id
        self.progress = progress
        self.before_s = 0.0

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list:
        called = time.time()
        self.before()
        start = time.time()
        self.before_s += start - called
        self.progress()
        gens = self.engine.generate(prompts, params)
        self.progress()
        self.events.write("generate", start, time.time(), version=int(self.engine.weight_version),
                          sequences=len(gens), request=self.request_id)
        return gens


def _result(future: Any, timeout_s: float, progress: Callable[[], None], poll_s: float = 1.0) -> Any:
    """`future.result(timeout_s)`, waited for in rounds of `poll_s` that stamp progress: a bounded
    wait is not a hang (concurrent.futures.TimeoutError after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        progress()
        try:
            return future.result(timeout=max(min(poll_s, deadline - time.monotonic()), 0.0))
        except concurrent.futures.TimeoutError:
            if time.monotonic() >= deadline:
                raise


def _put(hub: Any, item: ExperienceGroup, receiver: Any, events: EventLog,
         progress: Callable[[], None] = lambda: None) -> None:
    """Put one group into the buffer; while it is full, keep applying weight updates (waiting on
    the trainer's back-pressure is progress)."""
    start = time.time()
    while not hub.stopping():
        progress()
        try:
            hub.put_experience(item, timeout=0.1)
        except queue.Full:
            receiver.poll()
            continue
        if time.time() - start > 0.1:
            events.write("buffer_full", start, time.time(), request=item.request_id)
        return


def main(argv: Optional[Sequence[str]] = None) -> int:
    """A generator started separately (rollout.generator_nodes > 0): connect with the run
    directory's hub file and serve until the trainer stops."""
    from megatron_rl.disagg.channel import connect_with_file

    parser = argparse.ArgumentParser(prog="python -m megatron_rl.disagg.generator", description=main.__doc__)
    parser.add_argument("--run-dir", required=True, help="the training run's directory (shared with the trainer)")
    parser.add_argument("--index", type=int, default=int(os.environ.get("SLURM_PROCID", "0")),
                        help="this generator's index in [0, rollout.num_generators) (default: $SLURM_PROCID)")
    parser.add_argument("--local-index", type=int, default=int(os.environ.get("SLURM_LOCALID", "0")),
                        help="picks this node's GPU (default: $SLURM_LOCALID)")
    parser.add_argument("--wait-s", type=float, default=1800.0,
                        help="how long to wait for the trainer's hub (the trainer loads its model first)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s generator %(levelname)s %(message)s")
    hub, key = connect_with_file(args.run_dir, args.wait_s)
    num = hub.spec(0).num_generators
    if not 0 <= args.index < num:
        logger.error("--index %d: the trainer expects %d generator(s) (rollout.num_generators)", args.index, num)
        return 2
    run_generator(hub, args.index, args.local_index, key)
    return 0


if __name__ == "__main__":
    sys.exit(main())
