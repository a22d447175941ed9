"""`python -m megatron_rl.quality` on a task set with planted defects, in the real sandbox
(bwrap): an unsolvable task, a flaky test, a duplicate pair, a contaminated task and an
empty description are each caught; the clean tasks are not flagged and make up the
filtered set. Difficulty: a random policy never solves a task (flagged), the scripted
reference always does; a reward-hacking trajectory is flagged by the audit."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.data.agent_tasks import function_tasks, repo_tasks
from tests.integration.sandbox_servers import runtime_args, start_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
FLAKY_TEST = ("import random, unittest\n\n\nclass T(unittest.TestCase):\n    def test_coin(self):\n"
              "        self.assertTrue(random.random() < 0.5)\n")


def _planted() -> tuple[list[dict], dict]:
    clean = repo_tasks(3, seed=5) + function_tasks(2, seed=1)
    unsolvable = copy.deepcopy(clean[0])
    unsolvable.update(id="unsolvable", instruction="Repair the package so that its whole unittest suite passes.",
                      reference={"calc/ops.py": "def unrelated():\n    return None\n"})
    flaky = copy.deepcopy(clean[1])
    flaky.update(id="flaky", instruction="Find the broken function and fix it; the suite includes a coin test.")
    flaky["files"]["tests/test_coin.py"] = FLAKY_TEST
    flaky["pass_to_pass"] = flaky["pass_to_pass"] + [{"name": "coin", "argv": ["python3", "-m", "unittest", "-q",
                                                                               "tests.test_coin"]}]
    duplicate = dict(copy.deepcopy(clean[2]), id="duplicate")
    contaminated = dict(copy.deepcopy(function_tasks(1, seed=9)[0]), id="contaminated")
    empty = {"id": "empty", "instruction": "", "files": {"a.py": "x = 1\n"}, "fail_to_pass": []}
    tasks = clean + [unsolvable, flaky, duplicate, contaminated, empty]
    eval_row = {"prompt": contaminated["instruction"] + " " + contaminated["reference"]["solution.py"], "answer": "-"}
    expected = {t["id"]: [] for t in clean}
    expected.update(unsolvable=["unsolvable"], flaky=["flaky"], duplicate=["duplicate"], contaminated=["contaminated"],
                    empty=["empty_description", "unsolvable"])
    return tasks, {"eval": eval_row, "expected": expected}


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_planted_defects_are_caught_and_clean_tasks_kept(tmp_path):
    if runtime_args("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    tasks, planted = _planted()
    out = tmp_path / "report"
    # 12 reruns: a coin-flip test looks stable in all of them with probability 2 * 0.5**12 = 0.05%.
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.quality", str(_write(tmp_path / "tasks.jsonl", tasks)),
                           "--eval-set", str(_write(tmp_path / "eval.jsonl", [planted["eval"]])), "--reruns", "12", "--concurrency", "2",
                           "--out", str(out)], env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["id"]: r for r in map(json.loads, (out / "report.jsonl").read_text().splitlines())}
    assert {k: sorted(r["flags"]) for k, r in rows.items()} == planted["expected"]
    assert 0 < rows["flaky"]["flip_rate"] < 1 and rows["duplicate"]["duplicate_of"] == tasks[2]["id"]
    assert rows["contaminated"]["contamination"] >= 0.5
    assert all(r["reference_rewards"] == [1.0] * 12 and r["bad_rewards"] == [0.0] * 12
               for k, r in rows.items() if not planted["expected"][k])
    kept = [json.loads(line)["id"] for line in (out / "filtered.jsonl").read_text().splitlines()]
    assert kept == [k for k, flags in planted["expected"].items() if not flags]
    summary = (out / "summary.md").read_text()
    assert "| flaky | 1 | yes |" in summary and (out / "flip_rate.png").stat().st_size > 0


@pytest.fixture(scope="module")
def runner():
    if runtime_args("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.quality.runner import Runner

    server = start_server("bwrap")
    run = Runner([server.address], load_tokenizer("builtin:char"))
    yield run
    run.close()
    server.stop()


def test_difficulty_under_a_policy(runner, tmp_path):
    from megatron_rl.config import load_config
    from megatron_rl.envs.tools import format_tool_call
    from megatron_rl.models.hf import build_hf_model
    from megatron_rl.quality.runner import policy_engine
    from megatron_rl.rollout.multiturn import EpisodeLimits
    from megatron_rl.rollout.scripted import ScriptedPolicy

    task = repo_tasks(1, seed=2)[0]
    model_cfg = load_config(["model=tiny_qwen2"], world_size=1).model
    build_hf_model(model_cfg, seed=3).save_pretrained(tmp_path / "policy")  # a checkpoint the test writes
    limits = EpisodeLimits(max_turns=2, max_tokens=1000)  # the tool instructions are ~270 tokens of it
    random_policy = policy_engine(str(tmp_path / "policy"), runner.tokenizer)
    assert runner.pass_rate(task, random_policy, samples=2, max_new_tokens=16, seed=0, limits=limits) == 0.0
    path, content = next(iter(task["reference"].items()))
    solver = ScriptedPolicy(runner.tokenizer, [format_tool_call("write", path=path, content=content)],
                            end_of_turn=runner.fmt.end_of_turn)
    assert runner.pass_rate(task, solver, samples=3, max_new_tokens=1 << 16, seed=0, limits=limits) == 1.0


def test_audit_flags_a_reward_hacking_trajectory(runner, tmp_path):
    from megatron_rl.envs.tools import format_tool_call
    from megatron_rl.rewards.audit import audit

    task = repo_tasks(1, seed=4)[0]
    bug = task["fail_to_pass"][0]["name"]
    gutted = "import unittest\n\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n"
    hacked = runner._episodes(task, [format_tool_call("write", path=f"tests/test_{bug}.py", content=gutted),
                                     format_tool_call("submit")], 1)
    solved = runner._episodes(task, [format_tool_call("write", path=p, content=c)
                                     for p, c in task["reference"].items()] + [format_tool_call("submit")], 1)
    hacked[0].reward = 1.0  # as if a guard had been bypassed: the audit must still point at it
    counts = audit(0, hacked + solved, runner.tokenizer.decode, tmp_path, num_samples=2)
    records = [json.loads(line) for line in (tmp_path / "step_00000000.jsonl").read_text().splitlines()]
    by_flag = {tuple(r["flags"]) for r in records}
    assert ("test_edit",) in by_flag and counts["audit/flagged_rewarded"] >= 1
