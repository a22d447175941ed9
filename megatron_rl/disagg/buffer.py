"""The experience buffer between generators and trainer, and its staleness bound.

Generators put one `ExperienceGroup` (the n samples of one prompt, scored) at a time into a
bounded multiprocessing queue; a full queue blocks them (back-pressure). The trainer takes
groups until its batch is full. A group is as old as its oldest token: generated from weight
version v, it may be trained on at trainer version t only if t - v <= max_staleness; older
groups are dropped and counted (`buffer/dropped_stale`), and the trainer asks for their
prompts again. With dynamic sampling the trainer also refuses groups without reward variance
(`accept`), up to a limit per step, and asks for new prompts in their place. Which prompts are
in flight, and when they were asked for, is the controller's business
(megatron_rl/disagg/controller.py). A group also carries its share of the generator's
rollout-scheduler statistics (`scheduler_shares`), which the trainer sums over a step's groups
into colocated mode's `sched/...` metrics (`scheduler_metrics`).
"""

from __future__ import annotations

import dataclasses
import queue
import time
from typing import Any, Callable, Optional, Sequence

from megatron_rl.rollout.collect import Rollout


@dataclasses.dataclass
class ExperienceGroup:
    """One prompt's samples, scored, with the weight version of every generated token."""

    request_id: int
    rollouts: list[Rollout]  # Rollout.weight_version: the version of its first token
    token_versions: list[list[int]]  # per rollout: one per output token (an episode: one per model turn)
    generator: int
    generated: tuple[float, float]  # wall-clock start and end of its generation (and scoring) in its request
    sched: dict[str, float] = dataclasses.field(default_factory=dict)  # its `scheduler_shares` (agent episodes)
    # the reward counts of its request (`reward/verifier_calls`, `reward/unscored`...): on the request's first
    # group, the others empty, so that summing over groups counts each request once (`reward_counts`)
    rewards: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def version(self) -> int:
        """The oldest weight version any of its tokens was sampled with."""
        return min(min(v, default=r.weight_version) for r, v in zip(self.rollouts, self.token_versions))

    @property
    def versions(self) -> list[int]:
        return sorted({x for r, v in zip(self.rollouts, self.token_versions) for x in (v or [r.weight_version])})


class ExperienceBuffer:
    """The trainer's side of the queue."""

    def __init__(self, source: Any, max_staleness: int) -> None:
        self.source = source  # a queue: multiprocessing.Queue across processes, queue.Queue in tests
        self.max_staleness = max_staleness
        self.dropped_total = 0

    def take(self, num_groups: int, trainer_version: int, on_drop: Callable[[ExperienceGroup], None],
             check_alive: Callable[[], None] = lambda: None, poll_s: float = 1.0,
             accept: Optional[Callable[[ExperienceGroup], bool]] = None,
             on_reject: Callable[[ExperienceGroup], None] = lambda group: None, max_rejects: int = 0
             ) -> tuple[list[ExperienceGroup], dict[str, float]]:
        """`num_groups` groups fresh enough for `trainer_version` (blocks until there are);
        `on_drop` gets each stale one, `check_alive` runs while waiting (raises if a generator died).
        With `accept` (dynamic sampling), fresh groups it refuses go to `on_reject`, up to
        `max_rejects` of them; after that the next fresh groups fill the batch as they come."""
        kept: list[ExperienceGroup] = []
        seen: list[ExperienceGroup] = []  # kept, dropped or rejected: each carries its request's reward counts
        dropped = rejected = 0
        start = time.perf_counter()
        while len(kept) < num_groups:
            try:
                group = self.source.get(timeout=poll_s)
            except queue.Empty:
                check_alive()
                continue
            seen.append(group)
            if trainer_version - group.version > self.max_staleness:
                dropped += 1
                on_drop(group)
                continue
            if accept is not None and rejected < max_rejects and not accept(group):
                rejected += 1
                on_reject(group)
                continue
            kept.append(group)
        self.dropped_total += dropped
        staleness = [trainer_version - g.version for g in kept]
        stats = {"buffer/dropped_stale": float(dropped), "buffer/dropped_stale_total": float(self.dropped_total),
                 "buffer/size": float(_size(self.source)), "async/wait_s": time.perf_counter() - start,
                 "async/staleness_mean": sum(staleness) / max(len(staleness), 1),
                 "async/staleness_max": float(max(staleness, default=0)),
                 "async/partial_groups": float(sum(len(g.versions) > 1 for g in kept))}
        if accept is not None:
            stats.update({"dynamic_sampling/rejected": float(rejected),
                          "dynamic_sampling/exhausted": float(rejected >= max_rejects)})
        stats.update(reward_counts(seen))
        return kept, stats


BUSY_S, WALL_S = "sched/engine_busy_s", "sched/generator_wall_s"


def scheduler_shares(stats: dict[str, float], episodes: dict[int, list[Any]],
                     prefix: str = "") -> dict[int, dict[str, float]]:
    """What each group of one scheduler run sends along (`ExperienceGroup.sched`): `stats` are the
    scheduler's (`rollout.multiturn.scheduler_stats`, lockstep or async) for the run (one per request and agent
    domain) that
    played `episodes` (group -> its episodes). Every quantity is one that adds up over groups:
    the run's engine-busy, wall and back-pressure seconds in equal shares per group (its groups
    have n episodes each and were played concurrently on one engine, so no group's own part of
    the engine's time can be told apart), and the group's own episodes counted by status.
    `prefix`: `domain/<d>/` for a joint run's agent domain, as colocated mode names its metrics.
    Without stats (no scheduler ran) the groups carry nothing."""
    if not stats:
        return {g: {} for g in episodes}
    wall = stats["sched/wall_s"]
    seconds = {BUSY_S: stats["sched/engine_busy"] * wall, WALL_S: wall,
               "sched/backpressure_wait_s": stats["sched/backpressure_wait_s"]}
    out: dict[int, dict[str, float]] = {}
    for g, mine in episodes.items():
        share = {key: value / len(episodes) for key, value in seconds.items()}
        share.update({f"sched/{status}": float(sum(e.status == status for e in mine))
                      for status in ("aborted", "deadline", "partial")})
        out[g] = {prefix + key: value for key, value in share.items()}
    return out


def scheduler_metrics(groups: Sequence[ExperienceGroup]) -> dict[str, float]:
    """The generators' scheduler metrics of the groups a step trains on, under colocated mode's
    keys (`domain/<d>/` before them for a joint run's agent domain). Each group's shares
    (`scheduler_shares`) are summed over the step's groups, so over requests and generators:

    - `sched/aborted`, `sched/deadline`, `sched/partial`: episodes that ended so (counts; 0 here
      unless the scheduler cuts episodes: the settings that do are colocated-only);
    - `sched/backpressure_wait_s`: seconds episodes were held back by the sandbox's
      back-pressure, summed as one scheduler sums them over its episodes;
    - `sched/engine_busy`: summed engine-busy seconds / summed wall seconds, i.e. the mean of the
      scheduler runs' busy fractions weighted by the wall seconds each brings to the step (its
      wall time x the fraction of its groups trained at this step); with one run per step it is
      that run's fraction, as in colocated mode. Busy means generating, as in colocated mode:
      weight updates applied between turns (partial rollouts) are left out;
    - `sched/generator_wall_s`, not colocated mode's `sched/wall_s`: the schedulers' wall seconds
      for the step's groups, summed over generators. Colocated `sched/wall_s` is how long the step
      waited for its episodes on one engine; here the episodes were played by several generators
      while earlier steps trained, so no such per-step wall time exists (the trainer's wait is
      `async/wait_s`) and the sum, up to num_generators times any wall time, gets a name of its own.

    A step's groups may come from part of a run (its other groups trained at another step, or
    dropped as stale): each step gets the shares of the groups it trained on."""
    totals: dict[str, float] = {}
    for group in groups:
        for key, value in group.sched.items():
            totals[key] = totals.get(key, 0.0) + value
    out: dict[str, float] = {}
    for key, value in totals.items():
        if key.endswith(BUSY_S):
            prefix = key[:-len(BUSY_S)]
            out[prefix + "sched/engine_busy"] = value / max(totals[prefix + WALL_S], 1e-9)
        else:
            out[key] = value
    return out


def reward_counts(groups: Sequence[ExperienceGroup]) -> dict[str, float]:
    """The generators' reward counts (their verifiers' calls, errors and answers; unscored samples, late and
    failed reward batches), summed over `groups`: every group a step took from the buffer, kept, dropped as
    stale or refused by dynamic sampling (a request whose rewards failed has no verdict to keep it by), since
    the trainer's own verifier scores none of them. A request counts, whole, at the step that takes its first
    group."""
    totals: dict[str, float] = {}
    for group in groups:
        for key, value in group.rewards.items():
            totals[key] = totals.get(key, 0.0) + value
    return totals


def _size(source: Any) -> int:
    try:
        return source.qsize()
    except NotImplementedError:  # multiprocessing queues on macOS
        return -1
