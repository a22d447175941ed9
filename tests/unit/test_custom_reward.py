"""`task.reward=package.module:function`: loading (errors named before start-up), what the
function is given (the whole dataset row), sync and async functions, and failures that are a
counted 0 reward instead of a crashed run."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import textwrap
import threading
import time

import pytest

from megatron_rl.config import ConfigError, TaskConfig, load_config
from megatron_rl.data.tasks import Task
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.rewards.custom import CustomVerifier, load_reward_function
from megatron_rl.rewards.service import RewardService
from megatron_rl.config.checks.run import check_run

MODULE = textwrap.dedent('''
    import asyncio, math, threading, time

    calls = []

    def length_match(completion, sample):
        """1 when the completion is as long as the row says, with the row's weight."""
        calls.append(dict(sample))
        return sample["weight"] * float(len(completion) == sample["length"])

    async def async_upper(completion, sample):
        await asyncio.sleep(0)
        return completion.isupper()

    def broken(completion, sample):
        if completion == "boom":
            raise RuntimeError("boom")
        if completion == "nan":
            return math.nan
        if completion == "text":
            return "1.0"
        return 1.0

    def slow(completion, sample):
        time.sleep(float(completion))
        return threading.get_ident()

    def one_argument(completion):
        return 1.0

    NOT_A_FUNCTION = 3
''')


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)
    yield sys.modules.setdefault("my_rewards", __import__("my_rewards"))
    sys.modules.pop("my_rewards", None)


@pytest.mark.parametrize("path, message", [
    ("no_such_module_xyz:f", "cannot be loaded: ModuleNotFoundError"),
    ("my_rewards:missing", "cannot be loaded: AttributeError"),
    ("my_rewards:NOT_A_FUNCTION", "is a int, not a function"),
    ("my_rewards:one_argument", r"must accept \(completion: str, sample: dict\)"),
    ("my_rewards:", "package.module:function"),
])
def test_a_function_that_cannot_serve_is_named(user_module, path, message):
    with pytest.raises(ValueError, match=message):
        load_reward_function(path)


def test_the_run_checks_import_it_before_start_up(user_module):
    cfg = load_config(["mode=rl", "task.type=arithmetic", "task.reward=my_rewards:length_match"], world_size=1)
    check_run(cfg)
    with pytest.raises(ConfigError, match=r"^task.reward='my_rewards:missing' cannot be loaded"):
        load_config(["mode=rl", "task.type=arithmetic", "task.reward=my_rewards:missing"], world_size=1)
    with pytest.raises(ConfigError, match=r"^domains.a.task.reward='my_rewards:missing'"):
        load_config(["mode=rl", "+domains={a:{task:{type:arithmetic,num_train:4,num_eval:2,"
                     "reward:'my_rewards:missing'}},b:{task:{type:arithmetic,num_train:4,num_eval:2}}}"], world_size=1)
    with pytest.raises(ConfigError, match="agent tasks are scored by their environment"):
        load_config(["mode=rl", "task.type=agent", "task.reward=my_rewards:length_match"], world_size=1)


def test_the_function_gets_the_whole_row_and_its_reward_is_used(user_module, tmp_path):
    rows = [{"prompt": f"say {i} letters", "length": i, "weight": 0.5 * (i + 1), "answer": str(i)} for i in range(6)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = Task(TaskConfig(chat_template=False, name="t", type="dataset", path=str(path), num_eval=2, reward="my_rewards:length_match",
                           reward_scale=2.0), load_tokenizer("builtin:char"))
    assert task.reward_kind == "custom" and not task.needs_sandbox
    prompts = task.prompts("train")
    assert prompts[0].meta == rows[2] and prompts[0].reference == "\\boxed{2}"  # eval takes the first two rows
    service = RewardService(task.verifier_factory([]))
    try:
        items = [(p.meta, "x" * (p.meta["length"] if k % 2 == 0 else 1)) for k, p in enumerate(prompts)]
        rewards = service.submit(items).result(timeout=30)
    finally:
        service.close()
    # by hand: rows 2..5, even positions answer with the right length, odd ones with one letter; x reward_scale
    assert rewards == [2.0 * 0.5 * 3, 0.0, 2.0 * 0.5 * 5, 0.0]
    assert user_module.calls == [rows[i] for i in range(2, 6)]


def test_async_functions_and_bools(user_module):
    verifier = CustomVerifier("my_rewards:async_upper")
    assert verifier.is_async
    assert asyncio.run(verifier.score([({}, "ABC"), ({}, "abc")])) == [1.0, 0.0]
    assert verifier.errors == 0


def test_failures_are_no_verdict_and_the_rest_is_scored(user_module, caplog):
    """A call that raises or returns no number is no verdict (NaN: the collector leaves the sample
    unscored), counted; the others are scored."""
    verifier = CustomVerifier("my_rewards:broken")
    with caplog.at_level("WARNING"):
        rewards = asyncio.run(verifier.score([({}, c) for c in ("ok", "boom", "nan", "text", "ok")]))
    verifier.close()
    assert rewards[0] == rewards[4] == 1.0 and all(math.isnan(r) for r in rewards[1:4])
    assert verifier.errors == 3
    warnings = [r for r in caplog.records if "reward function my_rewards:broken failed" in r.getMessage()]
    assert len(warnings) == 1 and "boom" in warnings[0].getMessage()  # the first failure, then only counted


@pytest.mark.serial  # a wall-clock bound
def test_sync_functions_run_side_by_side_under_a_deadline(user_module):
    verifier = CustomVerifier("my_rewards:slow", timeout_s=1.0)
    start = time.monotonic()
    rewards = asyncio.run(verifier.score([({}, "0.4")] * 4 + [({}, "3")]))
    elapsed = time.monotonic() - start
    verifier.close()
    # four 0.4 s calls on their own threads: well under their 1.6 s in series; the 3 s call is cut at 1 s
    assert elapsed < 1.6, elapsed
    assert len(set(rewards[:4])) == 4 and threading.get_ident() not in rewards[:4]
    assert math.isnan(rewards[4]) and verifier.errors == 1


@pytest.mark.serial  # a wall-clock bound
def test_a_call_queued_behind_a_busy_pool_keeps_its_deadline(user_module):
    """Eight 0.3 s calls on two threads with a 0.5 s deadline: each runs well within it, though the last
    ones start about a second after they were submitted (the deadline counted queueing before)."""
    verifier = CustomVerifier("my_rewards:slow", timeout_s=0.5, max_workers=2)
    rewards = asyncio.run(verifier.score([({}, "0.3")] * 8))
    verifier.close()
    assert not any(math.isnan(r) for r in rewards) and verifier.errors == 0
