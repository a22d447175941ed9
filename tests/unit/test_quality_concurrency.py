"""`python -m megatron_rl.quality --concurrency N`: N tasks are verified at once (their
verifications overlap in time; with N = 1 none do), the verdicts come back in task order and
equal a one-at-a-time run's, and a task whose verification fails ends the run with that error,
leaving no verification running. The real runner on countdown tasks (no sandbox), each
verification held for a moment so that overlap shows."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from megatron_rl.data.agent_tasks import countdown_tasks
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.envs.countdown import CountdownEnvironment
from megatron_rl.quality.__main__ import parse_args, verdicts_in_order
from megatron_rl.quality.runner import Runner

HOLD_S = 0.1


class _Held:
    """make_env for the runner: countdown environments whose evaluate() takes HOLD_S longer and
    records (task id, start, end); a task named in `failing` fails in reset()."""

    def __init__(self, failing: str = "") -> None:
        self.spans: list[tuple[str, float, float]] = []
        self.failing = failing
        self.lock = threading.Lock()

    def __call__(self) -> CountdownEnvironment:
        env = CountdownEnvironment()
        reset, evaluate = env.reset, env.evaluate
        task_id = []

        async def held_reset(task):
            if task["id"] == self.failing:
                raise ValueError(f"task {task['id']} is broken")
            task_id.append(task["id"])
            return await reset(task)

        async def held_evaluate() -> float:
            start = time.monotonic()
            await asyncio.sleep(HOLD_S)
            reward = await evaluate()
            with self.lock:
                self.spans.append((task_id[0], start, time.monotonic()))
            return reward

        env.reset, env.evaluate = held_reset, held_evaluate
        return env


def _run(tasks, concurrency: int, make_env: _Held) -> list:
    runner = Runner([], load_tokenizer("builtin:char"), environment="countdown", attempts=1)
    runner.service.verifier.make_env = make_env
    try:
        return list(verdicts_in_order(runner, tasks, 2, concurrency))
    finally:
        runner.close()


def _overlapping_tasks(spans) -> bool:
    return any(a[0] != b[0] and a[1] < b[2] and b[1] < a[2] for a in spans for b in spans)


def test_tasks_are_verified_concurrently_and_reported_in_order():
    tasks = countdown_tasks(6, seed=3)
    one, three = _Held(), _Held()
    in_turn, at_once = _run(tasks, 1, one), _run(tasks, 3, three)
    assert not _overlapping_tasks(one.spans) and _overlapping_tasks(three.spans)
    assert [(v.reference, v.bad) for v in at_once] == [(v.reference, v.bad) for v in in_turn]
    assert [v.reference for v in at_once] == [[1.0, 1.0]] * 6 and [v.bad for v in at_once] == [[0.0, 0.0]] * 6
    assert sorted({s[0] for s in three.spans}) == sorted(t["id"] for t in tasks)


def test_a_failing_task_ends_the_run_with_its_error_and_nothing_left_running():
    tasks = countdown_tasks(8, seed=3)
    make_env = _Held(failing=tasks[2]["id"])
    runner = Runner([], load_tokenizer("builtin:char"), environment="countdown", attempts=1)
    runner.service.verifier.make_env = make_env
    got = []
    try:
        with pytest.raises(ValueError, match=f"task {tasks[2]['id']} is broken"):
            for verdicts in verdicts_in_order(runner, tasks, 2, 2):
                got.append(verdicts)
        settled = len(make_env.spans)
        time.sleep(3 * HOLD_S)
        assert len(make_env.spans) == settled  # no verification still running after the error
    finally:
        runner.close()
    assert len(got) == 2  # the tasks before the failing one were reported
    assert {s[0] for s in make_env.spans} < {t["id"] for t in tasks}  # and the later ones were not all started


def test_concurrency_below_one_is_refused(tmp_path, capsys):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("")
    with pytest.raises(SystemExit):
        parse_args([str(tasks), "--concurrency", "0"])
    assert "--concurrency must be >= 1" in capsys.readouterr().err
