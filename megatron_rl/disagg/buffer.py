"""The experience buffer between generators and trainer, and its staleness bound.

Generators put one `ExperienceGroup` (the n samples of one prompt, scored) at a time into a
bounded multiprocessing queue; a full queue blocks them (back-pressure). The trainer takes
groups until its batch is full. A group is as old as its oldest token: generated from weight
version v, it may be trained on at trainer version t only if t - v <= max_staleness; older
groups are dropped and counted (`buffer/dropped_stale`), and the trainer asks for their
prompts again. With dynamic sampling the trainer also refuses groups without reward variance
(`accept`), up to a limit per step, and asks for new prompts in their place. Which prompts are
in flight, and when they were asked for, is the controller's business
(megatron_rl/disagg/controller.py).
"""

from __future__ import annotations

import dataclasses
import queue
import time
from typing import Any, Callable, Optional

from megatron_rl.rollout.collect import Rollout


@dataclasses.dataclass
class ExperienceGroup:
    """One prompt's samples, scored, with the weight version of every generated token."""

    request_id: int
    rollouts: list[Rollout]  # Rollout.weight_version: the version of its first token
    token_versions: list[list[int]]  # per rollout: one per output token (an episode: one per model turn)
    generator: int
    generated: tuple[float, float]  # wall-clock start and end of its generation (and scoring) in its request

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
        dropped = rejected = 0
        start = time.perf_counter()
        while len(kept) < num_groups:
            try:
                group = self.source.get(timeout=poll_s)
            except queue.Empty:
                check_alive()
                continue
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
        return kept, stats


def _size(source: Any) -> int:
    try:
        return source.qsize()
    except NotImplementedError:  # multiprocessing queues on macOS
        return -1
