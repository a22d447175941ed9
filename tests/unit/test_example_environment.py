"""The custom environment package in docs/examples/guess_env plays by the environment contract: selected by
`task.environment=package.module:Class`, its reference turns solve every shipped task, a wrong or malformed
turn is answered and counted, and a run's config and task rows take it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
TASKS = EXAMPLES / "guess_env" / "tasks.jsonl"
NAME = "guess_env:GuessNumberEnvironment"


@pytest.fixture
def factory(monkeypatch):
    from megatron_rl.envs.base import environment_factory

    monkeypatch.syspath_prepend(str(EXAMPLES))
    return environment_factory(NAME)


def _play(env, task, turns):
    async def go():
        seen = [await env.reset(task)]
        for turn in turns:
            observation, done = await env.step(turn)
            seen.append(observation)
            if done:
                break
        return seen, await env.evaluate()
    return asyncio.run(go())


def test_the_reference_turns_solve_every_shipped_task(factory):
    tasks = [json.loads(line) for line in TASKS.read_text().splitlines()]
    assert len(tasks) == 10
    for task in tasks:
        turns = factory.reference_turns(task)
        seen, reward = _play(factory(), task, turns)
        assert reward == 1.0 and seen[-1] == "Correct." and len(turns) <= 6
        _, bad = _play(factory(), task, factory.known_bad_turns(task))
        assert bad == 0.0


def test_wrong_and_malformed_turns_are_answered_and_counted(factory):
    task = {"instruction": "1 to 8", "answer": "5", "low": 1, "high": 8}
    env = factory(max_turns=3)
    seen, reward = _play(env, task, ["2", "no idea", "7", "5"])
    assert seen[1:] == ["Higher.", "Answer with an integer.", "Lower."] and reward == 0.0  # 3 turns, not solved
    assert env.model_errors == 1 and env.info == {"turns": 3, "solved": False}


def test_a_run_config_and_its_task_rows_take_it(monkeypatch):
    from megatron_rl.config import compose, to_typed
    from megatron_rl.data.tasks import Task
    from megatron_rl.data.tokenizer import load_tokenizer

    monkeypatch.syspath_prepend(str(EXAMPLES))
    cfg = to_typed(compose(["+experiment=demo_agent_countdown", f"task.environment={NAME}", f"task.path={TASKS}",
                            "task.num_eval=2"]))
    prompts = Task(cfg.task, load_tokenizer("builtin:char")).prompts("train")
    assert len(prompts) == 8 and prompts[0].meta["answer"] == json.loads(TASKS.read_text().splitlines()[2])["answer"]
