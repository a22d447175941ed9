"""The sandbox verifiers' verdicts against a real server, and their "no verdict" when no server
answers: a reward nobody checked must not score 0 (the rollout collector leaves a NaN score
unscored, out of baselines and the loss), while what the candidate itself does stays a verdict."""

from __future__ import annotations

import asyncio
import math

import pytest

from megatron_rl.rewards import sandboxed
from tests.integration.sandbox_servers import runtime_args, start_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RUNTIME = "bwrap" if runtime_args("bwrap") else "process"  # verdicts, not isolation, are under test here

PROBLEM = {"numbers": [3, 5, 7], "target": 22}
COUNTDOWN = [(PROBLEM, "3*5+7"), (PROBLEM, "3+5+7"), (PROBLEM, "__import__('os')")]  # right, wrong, unscreened
TASK = {"files": {}, "solution_path": "sol.py", "tests": [
    {"name": "adds", "argv": ["python3", "-c", "from sol import add; assert add(2, 3) == 5"]},
    {"name": "zero", "argv": ["python3", "-c", "from sol import add; assert add(0, 0) == 0"]}]}
RIGHT = "def add(a, b):\n    return a + b\n"
HALF = "def add(a, b):\n    return a * b\n"  # passes add(0, 0) only
LOOPS = "def add(a, b):\n    while True:\n        pass\n"
# an instruct model's answer: thinking, prose and a fenced block; only the block is the candidate file
CHATTY = f"<think>maybe a * b?</think>Here is the function:\n```python\n{RIGHT}```\nIt adds its arguments."


def _score(address: str, deadline_s: float) -> tuple[list[float], list[float], int]:
    from megatron_rl_sandbox.client import SandboxClient

    async def go():
        async with SandboxClient([address], deadline_s=deadline_s) as client:
            countdown = sandboxed.CountdownVerifier(client, deadline_s=deadline_s)
            tests = sandboxed.TestsVerifier(client, deadline_s=deadline_s, limits={"wall_time_s": 2})
            untested = dict(TASK, tests=[])
            got = (await countdown.score(COUNTDOWN),
                   await tests.score([(TASK, c) for c in (RIGHT, HALF, LOOPS, CHATTY)] + [(untested, RIGHT)]))
            return (*got, countdown.errors + tests.errors)
    return asyncio.run(go())


def test_a_verification_no_server_answered_is_no_verdict():
    server = start_server(RUNTIME, "--capacity", "2")
    try:
        countdown, tests, errors = _score(server.address, deadline_s=60)
    finally:
        server.stop()
    # the candidates' own outcomes are verdicts: wrong answers, failed tests and a loop killed by its limit score 0
    assert countdown == [1.0, 0.0, 0.0] and tests[:4] == [1.0, 0.5, 0.0, 1.0]
    assert math.isnan(tests[4]) and errors == 1  # a task without tests judges nothing

    countdown, tests, errors = _score(server.address, deadline_s=2)  # the server is gone
    assert math.isnan(countdown[0]) and math.isnan(countdown[1])
    assert countdown[2] == 0.0  # screened out before any sandbox call: still the candidate's own 0
    assert all(math.isnan(t) for t in tests)
    assert errors == 1 + 5  # one countdown batch, five verifications


def test_the_code_examples_references_pass_their_tests():
    """docs/examples/code.jsonl (the qwen3_8b_code recipe's format): every reference, as a fenced response,
    passes all of its tests through the verifier the recipe uses."""
    import json
    from pathlib import Path

    from megatron_rl_sandbox.client import SandboxClient

    rows = [json.loads(line) for line in
            (Path(__file__).parents[2] / "docs" / "examples" / "code.jsonl").read_text().splitlines()]
    server = start_server(RUNTIME, "--capacity", "2")

    async def go():
        async with SandboxClient([server.address], deadline_s=60) as client:
            verifier = sandboxed.TestsVerifier(client, deadline_s=60)
            tasks = [{"files": {}, "tests": r["tests"], "solution_path": r["solution_path"]} for r in rows]
            return await verifier.score([(t, r["response"]) for t, r in zip(tasks, rows)])
    try:
        scores = asyncio.run(go())
    finally:
        server.stop()
    assert scores == [1.0] * len(rows)


def test_a_restarted_server_adds_to_its_log(tmp_path):
    """A requeued job starts its sandbox servers again with the same log file: the first start's lines stay,
    and each start is marked."""
    log = tmp_path / "sandbox-server.log"
    for _ in range(2):
        server = start_server(RUNTIME, "--capacity", "1", log=log)
        server.stop()
    text = log.read_text()
    assert text.count("=== sandbox server starting at") == 2
    first, second = text.split("=== sandbox server starting at")[1:]
    assert all("serving on" in start and "stopped" in start for start in (first, second))  # each start's lines


def test_when_every_server_is_gone_calls_fail_fast_instead_of_at_their_deadline():
    """A sandbox step that died leaves the clients a list of dead addresses. After every server has refused
    connections for ALL_UNREACHABLE_S, a call is no verdict at once, not after its (here 60 s) deadline."""
    import time

    from megatron_rl_sandbox.client import SandboxClient

    server = start_server(RUNTIME, "--capacity", "1")

    async def go():
        async with SandboxClient([server.address], deadline_s=60) as client:
            client.ALL_UNREACHABLE_S = 3.0
            assert (await client.execute(["true"])).exit_code == 0
            server.stop()
            took = []
            for _ in range(2):
                start = time.monotonic()
                result = await client.execute(["true"])  # answered by nobody: a TIMEOUT result, no server named
                took.append(time.monotonic() - start)
                assert not result.server and "no sandbox server has accepted a connection" in result.message
            return took
    first, second = asyncio.run(go())
    assert first < 15 and second < 1.0, (first, second)  # the deadline would have been 60 s each


def test_a_server_back_on_its_address_is_used_again_within_seconds():
    """A restarted sandbox step serves on its predecessor's address. The client's channel to it must reconnect
    within seconds, not after gRPC's default reconnect backoff (up to 120 s), during which every call fails at
    once: a restarted server went unused for the rest of a run on a loaded CI box."""
    import time

    from megatron_rl_sandbox.client import SandboxClient

    first = start_server(RUNTIME, "--capacity", "1")
    port = first.address.rsplit(":", 1)[1]

    async def go():
        async with SandboxClient([first.address], deadline_s=30) as client:
            assert (await client.execute(["true"])).exit_code == 0
            first.stop()
            for _ in range(6):  # calls while it is down grow the channel's reconnect backoff
                await client.execute(["true"], deadline_s=2)
            await asyncio.sleep(8)
            second = start_server(RUNTIME, "--capacity", "1", "--address", f"127.0.0.1:{port}")
            try:
                start = time.monotonic()
                result = await client.execute(["true"], deadline_s=20)
                return result, time.monotonic() - start
            finally:
                second.stop()
    result, took = asyncio.run(go())
    assert result.exit_code == 0 and result.server, result
    assert took < 5, f"the client needed {took:.1f}s to use the server again"


def test_a_fresh_channel_leaves_the_calls_on_the_old_one_to_end():
    """The health check replaces the channel of a server that refused connections (`_Server.reconnect`); a call
    another coroutine still had on the old channel was cancelled by its close, and CancelledError, not a failover,
    reached the verifier (CI saw a verification batch crash). The old channel now closes once its calls end."""
    from megatron_rl_sandbox.client import SandboxClient

    server = start_server(RUNTIME, "--capacity", "1")

    async def go():
        async with SandboxClient([server.address], deadline_s=30) as client:
            call = asyncio.ensure_future(client.execute(["sleep", "1"]))
            await asyncio.sleep(0.5)  # the call is running on the server, on the channel about to be replaced
            await client.servers[0].reconnect()
            result = await call
            return result, await client.execute(["true"])
    try:
        slept, after = asyncio.run(go())
    finally:
        server.stop()
    assert slept.exit_code == 0 and after.exit_code == 0, (slept, after)
