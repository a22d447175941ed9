"""Where an RL step's rollouts come from: one protocol, three implementations.

- colocated (`rollout.colocated.ColocatedSource`): this job's engine, time-shared with the trainer
  (offload, weight sync, generate, hand back), with dynamic sampling and over-sampling;
- disaggregated (`disagg.controller.DisaggregatedController`): generator processes fed with the
  published weights, groups taken from their experience buffer up to algorithm.max_staleness;
- replay (`rollout.replay.ReplaySource`): the samples a run dumped (logging.dump_rollouts), nothing
  generated (debugging a loss or a filter on fixed data).

The RL step asks for `rollouts(step, timeline)` and never branches on which one it holds.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class RolloutSource(Protocol):
    """A step's rollouts (group ids 0..G-1 in `prompt_index`, every rank the same list), their metrics
    (timings, weight-sync stats, scheduler and episode counts), the weight version they were generated
    with, and the state an exact resume needs."""

    @property
    def version(self) -> int:
        """The last weight version this source generated with (or published)."""

    def rollouts(self, step: int, timeline: Any) -> tuple[list, dict[str, float]]:
        """The rollouts of the step after `step` others, with their metrics; phases go on `timeline`."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the source (its keys sit at the top of the run's state)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from a checkpoint's run state (keys missing in older checkpoints default)."""

    def close(self) -> None:
        """Stop what the source started (idempotent)."""


class ControllerVersion:
    """For a source on this job's colocation controller (`self.controller`): the weight version is the
    controller's, the only state a checkpoint keeps of the source, and there is nothing to stop."""

    controller: Any

    @property
    def version(self) -> int:
        return self.controller.version

    def state_dict(self) -> dict[str, Any]:
        return {"weight_version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.controller.version = state.get("weight_version", 0)

    def close(self) -> None:
        pass
