"""The multi-domain part of the RL step without processes: calibrated rewards for the
advantages, per-domain metrics against hand-computed values, held-out accuracy per domain
(rewards divided by the domain's scale), pausing a domain the monitor flags, checkpoint state."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.config import AlgorithmConfig, DomainConfig, TaskConfig
from megatron_rl.data.domains import MixtureSampler, MultiTask
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.rl_domains import JointDomains, make_joint
from megatron_rl.rollout.collect import Rollout


def _task(num_domains: int = 2) -> MultiTask:
    domains = {"a": DomainConfig(TaskConfig(chat_template=False, type="arithmetic", num_train=4, num_eval=2)),
               "b": DomainConfig(TaskConfig(chat_template=False, type="arithmetic", seed=1, num_train=4, num_eval=2, reward_scale=10.0))}
    return MultiTask(dict(list(domains.items())[:num_domains]), load_tokenizer("builtin:char"))


def _joint(**algo) -> JointDomains:
    task = _task()
    sampler = MixtureSampler.for_prompts(task.prompts("train"), task.weights, seed=0)
    return JointDomains(AlgorithmConfig(**algo), task, sampler)


def _rollouts(domains, rewards, groups=None) -> list[Rollout]:
    groups = groups or list(range(len(rewards)))
    return [Rollout(g, [1], [2], [0.0], "stop", 0, reward=r, domain=d) for d, r, g in zip(domains, rewards, groups)]


def test_calibrated_rewards_and_per_domain_metrics():
    joint = _joint(domain_calibration="running", domain_calibration_momentum=0.5)
    rollouts = _rollouts("aaaabbbb", [0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 10.0, 0.0], groups=[0, 0, 1, 1, 2, 2, 3, 3])
    rewards = torch.tensor([r.reward for r in rollouts])
    calibrated = joint.advantage_rewards(rewards, rollouts)
    # a: mean 0.75, std sqrt(0.75 - 0.5625) = 0.4330; b: mean 2.5, std sqrt(25 - 6.25) = 4.3301
    sa, sb = 0.1875 ** 0.5, 18.75 ** 0.5
    want = [-0.75 / sa, 0.25 / sa, 0.25 / sa, 0.25 / sa, -2.5 / sb, -2.5 / sb, 7.5 / sb, -2.5 / sb]
    assert calibrated.tolist() == pytest.approx(want, abs=1e-6)
    advantages = torch.tensor([-0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 1.0, -1.0])
    m = joint.step_metrics(0, rollouts, advantages)
    assert m["domain/a/count"] == 4 and m["domain/a/reward_mean"] == 0.75 and m["domain/b/reward_mean"] == 2.5
    # population std: a: sqrt((0.25 + 0.25) / 4); b: sqrt((1 + 1) / 4)
    assert m["domain/a/adv_mean"] == 0.0 and m["domain/a/adv_std"] == pytest.approx(0.125 ** 0.5)
    assert m["domain/b/adv_std"] == pytest.approx(0.5 ** 0.5) and m["domain/b/share"] == 0.5
    assert m["domain/a/calib_std"] == pytest.approx(sa) and m["domain/b/calib_mean"] == 2.5
    assert m["domain/a/paused"] == 0.0


def test_without_calibration_rewards_pass_through_and_a_missing_domain_counts_zero():
    joint = _joint()
    rollouts = _rollouts("aa", [0.0, 1.0])
    rewards = torch.tensor([0.0, 1.0])
    assert joint.advantage_rewards(rewards, rollouts) is rewards
    m = joint.step_metrics(0, rollouts, torch.tensor([-0.5, 0.5]))
    assert m["domain/b/count"] == 0 and "domain/b/adv_std" not in m and "domain/a/calib_std" not in m


def test_rollouts_without_a_domain_are_refused():
    with pytest.raises(RuntimeError, match=r"unknown domains \[''\].*Rollout.domain"):
        _joint(domain_calibration="running").advantage_rewards(torch.tensor([1.0]), _rollouts([""], [1.0]))


def _records(joint, rollouts):
    """The evaluation's records of `rollouts` (rl/evaluate.py builds them so)."""
    from megatron_rl.evaluation.records import records_from_rollouts

    return records_from_rollouts(joint.task.prompts("eval"), rollouts, joint.task.reward_scale_of)


def test_eval_accuracy_per_domain_divides_out_the_scale():
    joint = _joint()  # held-out prompts of domains a, a, b, b
    rollouts = [Rollout(i, [1], [2], [0.0], "stop", 0, reward=r) for i, r in [(0, 1.0), (1, 0.0), (2, 10.0),
                                                                              (3, 10.0)]]
    assert joint.eval_metrics(0, _records(joint, rollouts)) == {"eval/a/accuracy": 0.5, "eval/b/accuracy": 1.0}
    # prompt 0 right twice, prompt 1 wrong once (its second sample lost): each prompt weighs alike, 0.5, as the
    # offline evaluation's accuracy (not 2/3 over the samples)
    lost = Rollout(1, [1], [2], [0.0], "stop", 0, reward=0.0, status="unscored")
    again = Rollout(0, [1], [2], [0.0], "stop", 0, reward=1.0)
    assert joint.eval_metrics(1, _records(joint, [*rollouts, again, lost]))["eval/a/accuracy"] == 0.5


def test_a_flagged_domain_is_paused_loudly_but_never_the_last_one(caplog):
    joint = _joint(domain_pause_window=2, domain_pause_min_reward_gain=0.2, domain_pause_max_eval_gain=0.02)

    def evaluate(step, acc_a, acc_b):
        rollouts = [Rollout(i, [1], [2], [0.0], "stop", 0, reward=r)
                    for i, r in enumerate([acc_a, acc_a, 10.0 * acc_b, 10.0 * acc_b])]
        return joint.eval_metrics(step, _records(joint, rollouts))

    evaluate(0, 0.5, 0.5)
    # a's training reward climbs 0.2 -> 0.9 (b's: 2 -> 9 on its scale of 10, the same climb); at step 2
    # a's held-out accuracy has not moved, b's rose by 0.5
    for step, (ra, rb) in enumerate([(0.2, 2.0), (0.9, 9.0)]):
        joint.step_metrics(step, _rollouts("ab", [ra, rb]), torch.zeros(2))
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rl_domains"):
        evaluate(2, 0.5, 1.0)
    assert joint.sampler.paused == ["a"] and "DOMAIN PAUSED: a" in caplog.text
    assert joint.step_metrics(2, _rollouts("b", [9.0]), torch.zeros(1))["domain/a/paused"] == 1.0
    # b then shows the same pattern, but it is the last active domain: it keeps training
    for step, rb in [(3, 9.0), (4, 10.0)]:
        joint.step_metrics(step, _rollouts("b", [rb]), torch.zeros(1))
    joint.monitor.min_reward_gain = -1.0  # force the pattern for b
    with caplog.at_level(logging.ERROR, logger="megatron_rl.rl_domains"):
        evaluate(4, 0.5, 1.0)
    assert joint.sampler.paused == ["a"] and "last active domain: NOT paused" in caplog.text


def test_state_travels_and_a_single_task_checkpoint_is_refused():
    a = _joint(domain_calibration="running", domain_pause_window=3)
    a.advantage_rewards(torch.tensor([0.0, 1.0, 10.0]), _rollouts("aab", [0.0, 1.0, 10.0]))
    a.step_metrics(0, _rollouts("aab", [0.0, 1.0, 10.0]), torch.zeros(3))
    b = _joint(domain_calibration="running", domain_pause_window=3)
    b.load_state_dict(a.state_dict())
    assert b.calibrator.stats == a.calibrator.stats and b.monitor.state_dict() == a.monitor.state_dict()
    with pytest.raises(ValueError, match="written by a single-task run"):
        b.load_state_dict(None)


def test_make_joint_only_for_a_multi_task():
    assert make_joint(SimpleNamespace(algorithm=AlgorithmConfig()), object(), None) is None
    assert isinstance(make_joint(SimpleNamespace(algorithm=AlgorithmConfig()), _task(), None), JointDomains)
