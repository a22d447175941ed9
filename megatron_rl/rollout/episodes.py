"""A step's agent episodes over the data-parallel ranks: which rank plays which prompts on which engine, the
lockstep driver (`multiturn.run_episodes`) or the asynchronous scheduler (`scheduler.run_episodes_async`) to
play them, and every rank's episodes and scheduler metrics gathered on every rank.

It sits above both drivers, which share the episode format of `multiturn` (the scheduler imports it; nothing
here is imported back by either).
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

from megatron_rl.envs.agent_program import AgentProgramHost
from megatron_rl.observability.timeline import Timeline
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.multiturn import (Episode, EpisodeLimits, TurnFormat, episode_metrics, run_episodes,
                                           scheduler_stats)
from megatron_rl.rollout.scheduler import combine_engines, run_episodes_async


def _episode_share(engine: Any, num_prompts: int, groups: Any) -> tuple[bool, list[int], Any]:
    """(whether this rank plays episodes, which prompts, the engine it drives them with).

    One engine per rank (rollout.tp=1): its data-parallel share, on its first model-parallel
    rank. An engine shared by a block of ranks (`rollout.spmd.BlockEngine`, rollout.tp > 1):
    the block's leader plays the shares of every first model-parallel rank of its block on its
    own engine, and the block's other ranks none. An episode's turns are calls that come as the
    environment answers, not rounds the whole block takes part in, so one rank drives each
    engine; every prompt is still played exactly once (each rank is in one block).
    """
    from megatron_rl.rollout.collect import _share

    block = getattr(engine, "block", None)
    if block is None or block.size == 1:
        return first_mp_rank(groups), list(_share(num_prompts, groups.dp_size, groups.dp_rank)), engine
    import torch.distributed as dist

    members: list[Any] = [None] * block.size
    dist.all_gather_object(members, (groups.dp_rank, first_mp_rank(groups)), group=block.group)
    if not block.is_leader:
        return False, [], None
    dp_ranks = sorted({dp for dp, first in members if first})
    return True, [i for dp in dp_ranks for i in _share(num_prompts, groups.dp_size, dp)], engine.engine


def first_mp_rank(groups: Optional[Any]) -> bool:
    return groups is None or groups.is_first_model_parallel_rank


def collect_episodes(engine: Any, prompts: Sequence[Any], params: SamplingParams, reward_service: Any, groups: Any,
                     fmt: TurnFormat, limits: EpisodeLimits, scheduler: str = "lockstep", max_concurrency: int = 64,
                     target_groups: Optional[int] = None, timeline: Any = None, deadline_s: Optional[float] = None,
                     keep_partial: bool = False) -> tuple[list[Episode], dict[str, float]]:
    """`collect()` for agent tasks: each data-parallel rank runs its share of the episodes
    (prompt.meta is the task), on its first model-parallel rank; everyone gets all of them.
    With an engine shared by a block of ranks (rollout.tp > 1) its leader plays the block's
    shares (`_episode_share`). scheduler="async" runs them concurrently (rollout/scheduler.py);
    with `target_groups` (over-sampling), the groups still incomplete when that many are done
    are cut."""
    from megatron_rl.rollout.collect import gather_rollouts_with

    plays, mine, engine = _episode_share(engine, len(prompts), groups)
    start = time.perf_counter()
    local: list[Episode] = []
    stats: dict[str, float] = {}
    if plays and mine:
        verifier = reward_service.verifier
        tasks = [prompts[i].meta for i in mine]
        if isinstance(verifier, AgentProgramHost):  # a black-box agent program against the OpenAI endpoint
            from megatron_rl.rollout.openai_episodes import run_program_episodes

            local = run_program_episodes(engine, verifier, fmt.tokenizer, tasks, params.n, params, limits,
                                         max_concurrency)
        elif scheduler == "async":
            local_target = None if target_groups is None else -(-target_groups * len(mine) // len(prompts))
            client = getattr(verifier, "client", None)
            local, stats = run_episodes_async(engine, tasks, params.n, params, verifier.make_env, fmt, limits,
                                              reward_service.loop, max_concurrency=max_concurrency,
                                              target_groups=local_target, timeline=timeline, deadline_s=deadline_s,
                                              backpressure=getattr(client, "backpressure", None),
                                              keep_partial=keep_partial)
        else:
            timeline = timeline or Timeline()
            begun = time.perf_counter()
            local = run_episodes(engine, tasks, params.n, params, verifier.make_env, fmt, limits, reward_service.loop,
                                 timeline=timeline)
            stats = scheduler_stats(local, timeline, begun, time.perf_counter() - begun)
        for episode in local:
            episode.prompt_index = mine[episode.prompt_index]
        if not isinstance(verifier, AgentProgramHost):  # the host counts its own
            verifier.calls += len(local)
            verifier.errors += sum(e.status == "dropped" for e in local)
    elapsed = time.perf_counter() - start
    # every engine's scheduler metrics travel with the episodes, combined on every rank
    merged, engines = gather_rollouts_with(local if plays else None,
                                           {k: v for k, v in stats.items() if k.startswith("sched/")})
    return merged, {"time/episodes": elapsed, **combine_engines(engines), **episode_metrics(merged)}
