"""A reward-hacking guard for multi-domain runs: flags a domain whose training reward climbs
while its held-out accuracy does not follow (the policy found a way to please the verifier
that does not transfer), so the run can stop drawing that domain's prompts.

`DomainMonitor` is fed each step's mean training reward per domain (divided by the domain's
`task.reward_scale`, so that thresholds are in the same units as accuracy) and each
evaluation's held-out accuracy per domain, and decides at every evaluation. Steps are counted
as steps done: the reward of RL step i (0-based) is recorded at i + 1, the evaluation after
k steps at k (the warm-start evaluation at 0 is the first baseline).

At an evaluation at step t, with s the latest earlier evaluation at or before t - window:

    reward_gain = mean train reward over steps (t - k, t]  -  mean over steps (s, s + k]
    eval_gain   = accuracy at t - accuracy at s                 (k = max(1, window // 4))

and the domain is flagged when reward_gain > min_reward_gain and eval_gain < max_eval_gain.
Averaging k steps at each end keeps one lucky step from flagging a domain. A flagged domain
stays flagged (the checkpoint keeps it); the decision is only a guard against a pattern, not
a proof of hacking, and is logged loudly so that a person looks at the domain's samples.
Pure Python, no collectives: every rank sees the same metrics and decides the same.
"""

from __future__ import annotations

from typing import Any, Mapping


class DomainMonitor:
    def __init__(self, window: int, min_reward_gain: float, max_eval_gain: float) -> None:
        if window < 1:
            raise ValueError(f"window={window} is invalid: must be >= 1 (0 means no monitor: do not build one)")
        self.window = window
        self.smooth = max(1, window // 4)
        self.min_reward_gain = min_reward_gain
        self.max_eval_gain = max_eval_gain
        self.train: dict[str, list[tuple[int, float]]] = {}  # domain -> [(step, mean reward)]
        self.evals: dict[str, list[tuple[int, float]]] = {}  # domain -> [(step, accuracy)]
        self.flagged: dict[str, dict[str, float]] = {}  # domain -> the evidence when flagged

    def record_train(self, step: int, rewards: Mapping[str, float]) -> None:
        """Mean training reward per domain (in accuracy units) of the step that ends at `step`."""
        for name, value in rewards.items():
            self.train.setdefault(name, []).append((step, float(value)))

    def record_eval(self, step: int, accuracy: Mapping[str, float]) -> list[str]:
        """Held-out accuracy per domain after `step` steps; the domains newly flagged by it."""
        newly = []
        for name, value in accuracy.items():
            self.evals.setdefault(name, []).append((step, float(value)))
            evidence = self._judge(name, step)
            if evidence is not None and name not in self.flagged:
                self.flagged[name] = evidence
                newly.append(name)
        return newly

    def _judge(self, name: str, t: int) -> dict[str, float] | None:
        evals = self.evals[name]
        earlier = [(s, a) for s, a in evals[:-1] if s <= t - self.window]
        if not earlier:
            return None
        s, baseline = earlier[-1]
        after = [r for step, r in self.train.get(name, []) if s < step <= s + self.smooth]
        recent = [r for step, r in self.train.get(name, []) if t - self.smooth < step <= t]
        self._forget(name, s)
        if not after or not recent:
            return None
        reward_gain = sum(recent) / len(recent) - sum(after) / len(after)
        eval_gain = evals[-1][1] - baseline
        if reward_gain > self.min_reward_gain and eval_gain < self.max_eval_gain:
            return {"step": float(t), "since_step": float(s), "reward_gain": reward_gain, "eval_gain": eval_gain}
        return None

    def _forget(self, name: str, baseline_step: int) -> None:
        """Later evaluations only look at baselines at or after this one: drop what came before."""
        self.evals[name] = [(s, a) for s, a in self.evals[name] if s >= baseline_step]
        self.train[name] = [(s, r) for s, r in self.train.get(name, []) if s > baseline_step]

    def state_dict(self) -> dict[str, Any]:
        return {"train": {n: list(v) for n, v in self.train.items()},
                "evals": {n: list(v) for n, v in self.evals.items()},
                "flagged": {n: dict(v) for n, v in self.flagged.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.train = {n: [tuple(x) for x in v] for n, v in state["train"].items()}
        self.evals = {n: [tuple(x) for x in v] for n, v in state["evals"].items()}
        self.flagged = {n: dict(v) for n, v in state["flagged"].items()}
