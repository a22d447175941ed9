"""One generator process of disaggregated mode: it owns a rollout engine and a reward service
and turns prompt requests into scored groups for the experience buffer.

The same components as colocated mode: the engine comes from `rollout.factory` (`HFEngine` or
`SGLangEngine`, chosen by `rollout.backend`), the verifiers from the run's task (rewards are
computed as in `rollout.collect`: the decoded response and the prompt's meta go to
`RewardService.submit`). It loops:

    apply a pending weight update (if the trainer announced one)
    -> take the next request (the trainer owns the sampler and sends prompt batches)
    -> generate it in chunks of rollout.partial_rollout_tokens (updates applied between chunks)
    -> score -> put one ExperienceGroup per prompt into the buffer (blocks while it is full,
       still applying updates)

Every engine call, weight update, scoring and blocked put is written to
`<run_dir>/timeline/generator<i>.jsonl`; the log goes to `<run_dir>/logs/generator<i>.log`.
On CPU trainer rank 0 starts the generators with multiprocessing 'spawn'; see
megatron_rl/disagg/controller.py for the process picture on a GPU cluster.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import time
from pathlib import Path
from typing import Any

from megatron_rl.disagg.buffer import ExperienceGroup
from megatron_rl.disagg.events import EventLog
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
    num_local_trainer_ranks: int
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


def run_generator(spec: GeneratorSpec, requests: Any, experience: Any, stop: Any) -> None:
    """The process's main function (multiprocessing target)."""
    from megatron_rl.data.domains import make_task
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.disagg.weights import WeightReceiver
    from megatron_rl.observability import init_logger
    from megatron_rl.parallel.dist import WeightUpdateGroup, generator_device, weight_update_store
    from megatron_rl.rewards.service import RewardService
    from megatron_rl.rollout.factory import make_standalone_engine

    cfg, run_dir = spec.cfg, Path(spec.run_dir)
    init_logger(spec.index + 1, cfg.logging.level, run_dir / "logs" / f"generator{spec.index}.log")
    device = generator_device(cfg.cluster.device, spec.index, spec.num_local_trainer_ranks)
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    task = make_task(cfg, tokenizer)
    engine = make_standalone_engine(cfg, tokenizer, device=device, index=spec.index, work_dir=run_dir)
    rewards = RewardService(task.verifier_factory(spec.sandbox_addresses))
    events = EventLog(run_dir / "timeline" / f"generator{spec.index}.jsonl")
    world = 1 + spec.num_generators
    store = weight_update_store(spec.store_host, spec.store_port, world, is_master=False)
    while not store.check([GO_KEY]):  # the trainer's warm start runs meanwhile
        if stop.is_set():
            return
        time.sleep(0.2)
    group = WeightUpdateGroup(store, spec.index + 1, world, device)
    receiver = WeightReceiver(group, store, engine,
                              on_update=lambda v, s, e: events.write("weights", s, e, version=v))
    receiver.receive(int(store.get(GO_KEY)))
    logger.info("generator %d ready on %s with weights v%d", spec.index, device, receiver.version)
    experience.cancel_join_thread()  # at shutdown, groups nobody will train on may be dropped

    def between_chunks() -> None:
        if stop.is_set():
            raise _Stopped
        receiver.poll()

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    try:
        while not stop.is_set():
            receiver.poll()
            try:
                request = requests.get(timeout=0.05)
            except queue.Empty:
                continue
            for item in _serve(spec, request, engine, rewards, decode, between_chunks, events):
                _put(experience, item, receiver, stop, events)
    except _Stopped:
        pass
    finally:
        logger.info("generator %d stops at weights v%d", spec.index, receiver.version)
        rewards.close()
        events.close()
        engine.shutdown()


def _serve(spec: GeneratorSpec, request: Request, engine: Any, rewards: Any, decode, between_chunks,
           events: EventLog) -> list[ExperienceGroup]:
    from megatron_rl.rollout.collect import Rollout
    from megatron_rl.rollout.partial import generate_partial

    start = time.time()
    gens = generate_partial(engine, [tokens for tokens, _ in request.prompts], request.params,
                            spec.cfg.rollout.partial_rollout_tokens, between_chunks,
                            on_chunk=lambda s, e, v, n: events.write("generate", s, e, version=v, sequences=n,
                                                                     request=request.request_id))
    end = time.time()
    metas = [request.prompts[g.prompt_index][1] for g in gens]
    try:
        scores = rewards.submit([(meta, decode(g.output_ids)) for meta, g in zip(metas, gens)]).result(timeout=300)
    except concurrent.futures.TimeoutError:
        logger.warning("request %d: rewards timed out; its samples score 0", request.request_id)
        scores = [0.0] * len(gens)  # a late reward is a 0 reward, as in rollout.collect
    events.write("score", end, time.time(), request=request.request_id)
    n, out = request.params.n, []
    for p, (tokens, meta) in enumerate(request.prompts):
        mine = list(zip(gens[p * n:(p + 1) * n], scores[p * n:(p + 1) * n]))
        rollouts = [Rollout(p, list(tokens), g.output_ids, g.logprobs, g.finish_reason, g.weight_version,
                            reward=float(score), domain=meta.get("domain", ""),
                            source_index=request.source_indices[p]) for g, score in mine]
        out.append(ExperienceGroup(request.request_id, rollouts, [g.token_versions for g, _ in mine], spec.index,
                                   (start, end)))
    return out


def _put(experience: Any, item: ExperienceGroup, receiver: Any, stop: Any, events: EventLog) -> None:
    """Put one group into the buffer; while it is full, keep applying weight updates."""
    start = time.time()
    while not stop.is_set():
        try:
            experience.put(item, timeout=0.1)
        except queue.Full:
            receiver.poll()
            continue
        if time.time() - start > 0.1:
            events.write("buffer_full", start, time.time(), request=item.request_id)
        return
