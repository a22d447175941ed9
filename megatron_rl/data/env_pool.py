"""The environment pool during training: which tasks are live, how each one fares, and
`gc_and_refresh` to retire tasks that became trivial or turned out flaky and to inject new
ones from a queue.

The pool has fixed slots (the training prompt list the sampler indexes): a retired task's
slot is refilled in place from the queue, so the sampler, its resume state and the
prompt indices stay valid. When the queue is empty a retired slot keeps its task and the
log says so (the sampler cannot shrink mid-epoch without breaking exact resume).

Per task it keeps the rewards of its recent samples (a window) and counts of
contradictory verdicts: a task whose identical completions got different rewards (the
same response text scored 1 and 0) is flaky by observation, no rerun needed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from typing import Any, Callable, Optional, Sequence

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TaskStats:
    task_id: str
    rewards: deque = dataclasses.field(default_factory=lambda: deque(maxlen=64))
    verdicts: dict = dataclasses.field(default_factory=dict)  # response hash -> set of rewards seen
    retired: str = ""  # why, when retired

    @property
    def pass_rate(self) -> float:
        return sum(r >= 1.0 for r in self.rewards) / len(self.rewards) if self.rewards else 0.0

    @property
    def contradictions(self) -> int:
        return sum(len(seen) > 1 for seen in self.verdicts.values())


class EnvPool:
    """Slots of live tasks. `items[i]` is what the sampler's index i stands for (e.g. a Prompt);
    `task_id(item)` names it; `queue` holds items that can replace retired ones."""

    def __init__(self, items: list[Any], task_id: Callable[[Any], str], queue: Sequence[Any] = (),
                 trivial_pass_rate: float = 0.95, min_samples: int = 32, max_contradictions: int = 1) -> None:
        self.items = items
        self.task_id = task_id
        self.queue = deque(queue)
        self.trivial_pass_rate = trivial_pass_rate
        self.min_samples = min_samples
        self.max_contradictions = max_contradictions
        self.stats = [TaskStats(task_id(item)) for item in items]
        self.history: list[dict[str, Any]] = []

    def observe(self, slot: int, reward: float, response_key: Optional[str] = None) -> None:
        """One scored sample of the task in `slot` (`response_key`: e.g. a hash of the response)."""
        stats = self.stats[slot]
        stats.rewards.append(float(reward))
        if response_key is not None:
            stats.verdicts.setdefault(response_key, set()).add(round(float(reward), 6))

    def _why_retire(self, stats: TaskStats) -> str:
        if stats.contradictions >= self.max_contradictions:
            return f"flaky ({stats.contradictions} responses scored differently on different runs)"
        if len(stats.rewards) >= self.min_samples and stats.pass_rate >= self.trivial_pass_rate:
            return f"trivial (pass rate {stats.pass_rate:.2f} over {len(stats.rewards)} samples)"
        return ""

    def gc_and_refresh(self, step: int) -> list[dict[str, Any]]:
        """Retire what is trivial or flaky, refill those slots from the queue; returns (and logs)
        the changes: [{"step", "slot", "retired", "why", "injected"}]."""
        changes = []
        for slot, stats in enumerate(self.stats):
            why = self._why_retire(stats)
            if not why:
                continue
            if not self.queue:
                if not stats.retired:
                    logger.warning("env pool: task %s is %s but the queue is empty; it stays", stats.task_id, why)
                    stats.retired = why
                continue
            new = self.queue.popleft()
            change = {"step": step, "slot": slot, "retired": stats.task_id, "why": why, "injected": self.task_id(new)}
            self.items[slot] = new
            self.stats[slot] = TaskStats(self.task_id(new))
            changes.append(change)
            logger.info("env pool: retired %s (%s), injected %s", change["retired"], why, change["injected"])
        self.history += changes
        return changes

    def metrics(self) -> dict[str, float]:
        rates = [s.pass_rate for s in self.stats if s.rewards]
        return {"env_pool/retired_total": float(len(self.history)), "env_pool/queue": float(len(self.queue)),
                "env_pool/mean_pass_rate": sum(rates) / len(rates) if rates else 0.0,
                "env_pool/flaky_suspects": float(sum(s.contradictions > 0 for s in self.stats))}

    def state_dict(self) -> dict[str, Any]:
        """What exact resume needs: which task is in each slot, the queue, and the statistics."""
        return {"slots": [self.task_id(i) for i in self.items], "queue": [self.task_id(q) for q in self.queue],
                "stats": [(list(s.rewards), {k: sorted(v) for k, v in s.verdicts.items()}, s.retired)
                          for s in self.stats], "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any], catalogue: Optional[dict[str, Any]] = None) -> None:
        """Restore into a pool built as the saved one was (same items and queue at the start);
        `catalogue` maps task ids to items, by default this pool's items and queue."""
        catalogue = catalogue or {self.task_id(i): i for i in [*self.items, *self.queue]}
        self.items[:] = [catalogue[t] for t in state["slots"]]
        self.queue = deque(catalogue[t] for t in state["queue"])
        self.stats = []
        for task_id, (rewards, verdicts, retired) in zip(state["slots"], state["stats"]):
            stats = TaskStats(task_id, retired=retired)
            stats.rewards.extend(rewards)
            stats.verdicts = {k: set(v) for k, v in verdicts.items()}
            self.stats.append(stats)
        self.history = list(state["history"])


def make_env_pool(cfg: Any, task: Any, train: list[Any]) -> Optional[EnvPool]:
    """The run's pool over its training prompts (None when task.pool_refresh_every=0); the
    queue holds generated tasks of another seed, or task.pool_queue_path's rows."""
    from megatron_rl.data.tasks import Task

    c = cfg.task
    if not c.pool_refresh_every:
        return None
    queue: list[Any] = []
    if c.pool_queue_path is not None:
        queue_cfg = dataclasses.replace(c, path=c.pool_queue_path, eval_path=None, num_eval=0, num_train=10**9)
        queue = Task(queue_cfg, task.tokenizer).prompts("train")
    elif c.pool_queue:
        queue_cfg = dataclasses.replace(c, seed=c.seed + 1000, num_train=c.pool_queue)
        queue = Task(queue_cfg, task.tokenizer).prompts("train")
    return EnvPool(train, prompt_id, queue, trivial_pass_rate=c.pool_trivial_pass_rate, min_samples=c.pool_min_samples)


def prompt_id(prompt: Any) -> str:
    """A task's identity: its id when it has one (agent tasks), else its prompt text."""
    return str(prompt.meta.get("id") or prompt.text) if isinstance(prompt.meta, dict) else prompt.text
