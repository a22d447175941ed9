"""The reward-hacking guard on planted series: training reward up with held-out accuracy flat
is flagged; both rising, flat rewards, or too little history are not."""

from __future__ import annotations

import pytest

from megatron_rl.rewards.hacking import DomainMonitor


def _feed(monitor: DomainMonitor, name: str, rewards, evals: dict[int, float]) -> dict[int, list[str]]:
    """Train reward of step i (steps done i + 1) and evaluations at the given steps; flags by step."""
    flags = {}
    if 0 in evals:
        flags[0] = monitor.record_eval(0, {name: evals[0]})
    for i, r in enumerate(rewards):
        monitor.record_train(i + 1, {name: r})
        if i + 1 in evals:
            flags[i + 1] = monitor.record_eval(i + 1, {name: evals[i + 1]})
    return flags


def test_reward_up_and_held_out_flat_is_flagged_at_the_first_evaluation_a_window_later():
    monitor = DomainMonitor(window=20, min_reward_gain=0.2, max_eval_gain=0.02)
    rewards = [0.1 + 0.02 * i for i in range(40)]  # 0.10 -> 0.88
    flags = _feed(monitor, "code", rewards, {0: 0.30, 10: 0.31, 20: 0.30, 30: 0.31, 40: 0.30})
    # step 10: no evaluation at or before 10 - 20; step 20: baseline = eval at 0 (0.30), smoothing k = 5:
    # reward over steps 16..20 = mean(0.40..0.48) = 0.44, over steps 1..5 = mean(0.10..0.18) = 0.14,
    # gain 0.30 > 0.2 while accuracy gained 0.00 < 0.02 -> flagged at 20.
    assert flags == {0: [], 10: [], 20: ["code"], 30: [], 40: []}
    evidence = monitor.flagged["code"]
    assert evidence["reward_gain"] == pytest.approx(0.30) and evidence["eval_gain"] == pytest.approx(0.0)
    assert (evidence["step"], evidence["since_step"]) == (20.0, 0.0)


def test_reward_up_with_held_out_up_is_healthy_learning():
    monitor = DomainMonitor(window=20, min_reward_gain=0.2, max_eval_gain=0.02)
    rewards = [0.1 + 0.02 * i for i in range(40)]
    flags = _feed(monitor, "math", rewards, {0: 0.30, 10: 0.33, 20: 0.38, 30: 0.45, 40: 0.50})
    assert all(v == [] for v in flags.values()) and monitor.flagged == {}


def test_flat_or_noisy_reward_is_not_flagged():
    monitor = DomainMonitor(window=8, min_reward_gain=0.2, max_eval_gain=0.02)
    rewards = [0.5, 0.2, 0.6, 0.3, 0.5, 0.4, 0.7, 0.2, 0.5, 0.4, 0.6, 0.3, 0.5, 0.4, 0.45, 0.35]  # no trend
    flags = _feed(monitor, "a", rewards, {0: 0.4, 8: 0.4, 16: 0.4})
    assert monitor.flagged == {} and flags[16] == []


def test_domains_are_judged_separately():
    monitor = DomainMonitor(window=4, min_reward_gain=0.1, max_eval_gain=0.05)
    monitor.record_eval(0, {"a": 0.5, "b": 0.5})
    for step, (ra, rb) in enumerate([(0.1, 0.1), (0.2, 0.1), (0.3, 0.1), (0.4, 0.1)], start=1):
        monitor.record_train(step, {"a": ra, "b": rb})
    assert monitor.record_eval(4, {"a": 0.5, "b": 0.5}) == ["a"]  # k = 1: a 0.4 - 0.1, b 0.1 - 0.1


def test_state_round_trip_gives_the_same_decisions():
    rewards = [0.1 + 0.02 * i for i in range(40)]
    evals = {0: 0.30, 10: 0.31, 20: 0.30, 30: 0.31, 40: 0.30}
    a = DomainMonitor(window=25, min_reward_gain=0.2, max_eval_gain=0.02)
    _feed(a, "x", rewards[:15], {k: v for k, v in evals.items() if k <= 15})
    b = DomainMonitor(window=25, min_reward_gain=0.2, max_eval_gain=0.02)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        for i in range(15, 40):
            m.record_train(i + 1, {"x": rewards[i]})
            if i + 1 in evals:
                m.record_eval(i + 1, {"x": evals[i + 1]})
    assert a.flagged == b.flagged and "x" in a.flagged and a.state_dict() == b.state_dict()


def test_window_must_be_positive():
    with pytest.raises(ValueError, match="window=0 is invalid"):
        DomainMonitor(window=0, min_reward_gain=0.2, max_eval_gain=0.02)
