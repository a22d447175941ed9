"""`megatron_rl.quality`'s runner when the sandbox loses verifications: a lost one (an episode
"dropped", a `Verify` call that failed) is no verdict, so it is replayed and never counted; a
task whose verdicts are all lost is `unverified`, not flaky or unsolvable; the policy's pass
rate is over scored samples only. The environment is countdown's (no sandbox), with an
infrastructure failure injected at the environment boundary."""

from __future__ import annotations

import json
import types

import pytest

from megatron_rl.data.agent_tasks import countdown_tasks
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.envs.base import InfrastructureError
from megatron_rl.envs.countdown import CountdownEnvironment
from megatron_rl.quality import checks
from megatron_rl.quality.runner import Runner, until_scored
from megatron_rl.rollout.scripted import ScriptedPolicy


class _LosesTheFirst:
    """make_env for the runner: the first `num_lost` environments made fail at evaluate() with an
    InfrastructureError (the sandbox died under them), the rest are plain countdown environments."""

    def __init__(self, num_lost: int) -> None:
        self.num_lost, self.made = num_lost, 0

    def __call__(self) -> CountdownEnvironment:
        env = CountdownEnvironment()
        self.made += 1
        if self.made <= self.num_lost:
            async def lost() -> float:
                raise InfrastructureError("sandbox server went away")
            env.evaluate = lost
        return env


@pytest.fixture
def runner():
    run = Runner([], load_tokenizer("builtin:char"), environment="countdown", attempts=3)
    yield run
    run.close()


def test_a_dropped_reference_episode_is_replayed_not_counted_as_a_verdict(runner, monkeypatch):
    task = countdown_tasks(1, seed=5)[0]
    make_env = _LosesTheFirst(2)  # two of the three reference episodes of the first round
    monkeypatch.setattr(runner.service.verifier, "make_env", make_env)
    verdicts = runner.verdicts(task, 3)
    assert (verdicts.reference, verdicts.bad) == ([1.0, 1.0, 1.0], [0.0, 0.0, 0.0])
    assert verdicts.lost == {"reference": 2, "known_bad": 0}
    assert make_env.made == 3 + 2 + 3  # round 1, the 2 replays, the known-bad candidate
    assert checks.verdict_flags(verdicts.reference, verdicts.bad) == (0.0, [])  # neither flaky nor unsolvable


def test_a_task_whose_verdicts_are_all_lost_is_unverified(runner, monkeypatch):
    task = countdown_tasks(1, seed=5)[0]
    make_env = _LosesTheFirst(10 ** 6)  # the sandbox is down
    monkeypatch.setattr(runner.service.verifier, "make_env", make_env)
    verdicts = runner.verdicts(task, 2)
    assert (verdicts.reference, verdicts.bad) == ([], [])
    assert verdicts.lost == {"reference": 6, "known_bad": 6} and make_env.made == 12  # 3 rounds of 2, each
    assert checks.verdict_flags(verdicts.reference, verdicts.bad) == (0.0, ["unverified"])


def test_the_pass_rate_leaves_dropped_episodes_out(runner, monkeypatch):
    task = countdown_tasks(1, seed=5)[0]
    monkeypatch.setattr(runner.service.verifier, "make_env", _LosesTheFirst(1))
    solver = ScriptedPolicy(runner.tokenizer, [task["reference"]], end_of_turn=runner.fmt.end_of_turn)
    assert runner.pass_rate(task, solver, samples=3, max_new_tokens=64, seed=0) == 1.0
    monkeypatch.setattr(runner.service.verifier, "make_env", _LosesTheFirst(10 ** 6))
    assert runner.policy_rewards(task, solver, samples=3, max_new_tokens=64, seed=0) == ([], 9)
    assert runner.pass_rate(task, solver, samples=3, max_new_tokens=64, seed=0) is None


def test_a_failed_verify_call_is_replayed_not_counted(runner, monkeypatch):
    """The tests kind: a Verify answer without a server (failed or timed out, as the client reports
    it) is lost; the candidate's next verification stands."""
    answers = iter([types.SimpleNamespace(reward=0.0, passed=0, total=1, server="")]
                   + [types.SimpleNamespace(reward=1.0, passed=1, total=1, server="s0")] * 2
                   + [types.SimpleNamespace(reward=0.0, passed=0, total=1, server="s0")] * 2)

    class Client:  # the sandbox client's `verify`, at the process boundary
        async def verify(self, files, tests, **_):
            return next(answers)

    monkeypatch.setattr(runner.service.verifier, "client", Client())
    task = {"id": "t", "prompt": "Write f.", "tests": [{"name": "t", "argv": ["python3", "-c", "pass"]}],
            "reference": "def f():\n    return 1\n"}
    verdicts = runner.verdicts(task, 2)
    assert (verdicts.reference, verdicts.bad, verdicts.lost) == ([1.0, 1.0], [0.0, 0.0],
                                                                 {"reference": 1, "known_bad": 0})


def test_until_scored_replays_a_bounded_number_of_rounds():
    calls = []

    def play(count, attempt):
        calls.append((count, attempt))
        return [None] * count  # every result lost
    assert until_scored(play, 4, 3, lambda r: r is None) == ([], 12)
    assert calls == [(4, 0), (4, 1), (4, 2)]
    results = iter([[1.0, None, None], [None, 0.0], [1.0]])
    assert until_scored(lambda count, _: next(results), 3, 5, lambda r: r is None) == ([1.0, 0.0, 1.0], 3)


@pytest.mark.parametrize("reference, bad, expected", [
    ([1.0, 1.0], [0.0, 0.0], (0.0, [])),
    ([0.0, 0.0], [0.0, 0.0], (0.0, ["unsolvable"])),
    ([1.0, 0.0], [0.0, 0.0], (0.5, ["flaky"])),
    ([1.0, 1.0], [1.0, 1.0], (0.0, ["accepts_bad_candidate"])),
    ([], [], (0.0, ["unverified"])),  # all lost: no verdict either way
    ([0.0], [0.0, 0.0], (0.0, ["unverified", "unsolvable"])),  # stability unmeasured, the verdict stands
])
def test_verdict_flags(reference, bad, expected):
    assert checks.verdict_flags(reference, bad) == expected


def test_the_report_lists_sandbox_failures_apart_and_keeps_unverified_tasks(tmp_path):
    """`unverified` says nothing against a task: it stays in filtered.jsonl, and the summary lists
    the sandbox's losses in a section of their own, not among the flaky verifiers."""
    from megatron_rl.quality.report import write_report

    rows = [{"id": "a", "flags": ["unverified"], "reference_rewards": [], "bad_rewards": [], "flip_rate": 0.0,
             "lost": {"reference": 6, "known_bad": 6}},
            {"id": "b", "flags": [], "reference_rewards": [1.0] * 3, "bad_rewards": [0.0] * 3, "flip_rate": 0.0,
             "lost": {"reference": 1, "known_bad": 0, "policy": 2}},
            {"id": "c", "flags": ["flaky"], "reference_rewards": [1.0, 0.0], "bad_rewards": [0.0, 0.0],
             "flip_rate": 0.5, "lost": {"reference": 0, "known_bad": 0}}]
    write_report(rows, [{"id": r["id"]} for r in rows], tmp_path)
    assert [json.loads(line)["id"] for line in (tmp_path / "filtered.jsonl").read_text().splitlines()] == ["a", "b"]
    summary = (tmp_path / "summary.md").read_text()
    failures = summary.split("## Sandbox failures (not verdicts)")[1].split("##")[0]
    assert "| a | 6 | 6 | 0 | yes |" in failures and "| b | 1 | 0 | 2 | no |" in failures and "| c |" not in failures
    assert "| unverified | 1 | no |" in summary
