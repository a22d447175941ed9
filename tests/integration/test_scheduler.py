"""Asynchronous episodes (rollout/scheduler.py): generation overlaps environment waits,
stragglers are cut once enough groups are complete, results equal the lockstep driver's
on a real sandbox task, and the timeline exports a Chrome trace."""

from __future__ import annotations

import json
import re
import time

import pytest

from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.envs import make_environment
from megatron_rl.observability.timeline import Timeline
from megatron_rl.rollout.base import Generation, SamplingParams
from megatron_rl.rollout.multiturn import EpisodeLimits, TurnFormat, run_episodes
from megatron_rl.rollout.scheduler import run_episodes_async
from megatron_rl.rollout.scripted import ScriptedPolicy

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.timeout(300)]
LIMITS = EpisodeLimits(max_turns=8, max_tokens=4096, wall_time_s=60)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin:char")


class SlowScript(ScriptedPolicy):
    """A scripted policy whose generate call takes `cost_s` per call (like a model)."""

    def __init__(self, *args, cost_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.cost_s, self.calls, self.sizes = cost_s, 0, []

    def generate(self, prompts, params):
        time.sleep(self.cost_s)
        self.calls += 1
        self.sizes.append(len(prompts))
        return super().generate(prompts, params)


def _tasks(num, latency_s=None):
    """Synthetic tasks; latency_s {task index: seconds} fixes a task's tool latency (a straggler)."""
    fixed = latency_s or {}
    return [{"id": f"t{i}", "instruction": f"task {i}", "answer": "done",
             **({"latency_s": fixed[i]} if i in fixed else {})} for i in range(num)]


def _fast_env():
    return make_environment("synthetic", min_latency_s=0.05, max_latency_s=0.05, turns=2)


def test_generation_overlaps_environment_waits(tokenizer, loop):
    fmt = TurnFormat(tokenizer, "sys")
    policy = SlowScript(tokenizer, ["step", "step", "done"], end_of_turn=fmt.end_of_turn, cost_s=0.05)
    timeline = Timeline()
    env = lambda: make_environment("synthetic", min_latency_s=0.2, max_latency_s=0.4, turns=3)  # noqa: E731
    episodes, stats = run_episodes_async(policy, _tasks(8), 2, SamplingParams(max_new_tokens=64), env, fmt,
                                         LIMITS, loop, max_concurrency=16, timeline=timeline)
    assert len(episodes) == 16 and all(e.status == "submitted" and e.reward == 1.0 for e in episodes)
    assert [e.prompt_index for e in episodes] == sorted(e.prompt_index for e in episodes)
    # Sequentially, 16 episodes x 3 tool calls of >= 0.2 s take >= 9.6 s; concurrently about 3 x 0.4 s.
    assert stats["sched/wall_s"] < 4.0
    assert max(policy.sizes) > 1 and policy.calls < 16 * 3  # requests were batched
    generate = [e for e in timeline.events if e["track"] == "engine"]
    waiting = [e for e in timeline.events if e["name"] == "environment"]
    overlaps = [g for g in generate if any(w["start"] < g["start"] < w["end"] for w in waiting)]
    assert overlaps, "no generation ran while an environment call was pending"
    trace = json.loads(_trace(timeline))
    assert {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"} >= {"generate", "environment", "reward"}


def test_lockstep_metrics_show_the_engine_idle_while_environments_run(tokenizer, loop):
    """The lockstep driver's `sched/...` metrics (`scheduler_stats`, as the async scheduler's): 4
    episodes of 3 turns are 3 engine calls of 4 sequences (0.1 s each), each followed by the 4
    environment steps together (0.2 s); the engine is busy for the calls only, never while an
    environment runs, so its busy fraction is about 0.3 s of >= 0.9 s."""
    from megatron_rl.rollout.multiturn import scheduler_stats

    fmt = TurnFormat(tokenizer, "sys")
    policy = SlowScript(tokenizer, ["step", "step", "done"], end_of_turn=fmt.end_of_turn, cost_s=0.1)
    env = lambda: make_environment("synthetic", min_latency_s=0.2, max_latency_s=0.2, turns=3)  # noqa: E731
    timeline, start = Timeline(), time.perf_counter()
    episodes = run_episodes(policy, _tasks(2), 2, SamplingParams(max_new_tokens=64), env, fmt, LIMITS, loop,
                            timeline=timeline)
    wall = time.perf_counter() - start
    stats = scheduler_stats(episodes, timeline, start, wall)
    assert [e.status for e in episodes] == ["submitted"] * 4 and policy.sizes == [4, 4, 4]
    generate = [e for e in timeline.events if e["track"] == "engine"]
    environment = [e for e in timeline.events if e["name"] == "environment"]
    assert [e["args"]["batch"] for e in generate] == [4, 4, 4] and len(environment) == 3
    assert not any(w["start"] < g["start"] < w["end"] for g in generate for w in environment)
    busy = sum(e["end"] - e["start"] for e in generate)
    assert 0.3 <= busy < 0.6 and wall >= 0.3 + 3 * 0.2
    assert stats["sched/wall_s"] == wall and stats["sched/engine_busy"] == pytest.approx(busy / wall)
    assert stats["sched/engine_busy"] < 0.5
    assert stats["sched/aborted"] == stats["sched/deadline"] == stats["sched/partial"] == 0
    assert stats["agent/submitted"] == 4 and stats["agent/turns_mean"] == 3


def _trace(timeline):
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp()) / "trace.json"
    timeline.to_chrome_trace(path)
    return path.read_text()


def test_stragglers_are_cut_when_enough_groups_finished(tokenizer, loop):
    fmt = TurnFormat(tokenizer, "sys")
    policy = SlowScript(tokenizer, ["a", "b"], end_of_turn=fmt.end_of_turn, cost_s=0.0)
    start = time.monotonic()
    episodes, stats = run_episodes_async(policy, _tasks(3, {2: 5.0}), 2, SamplingParams(max_new_tokens=16), _fast_env,
                                         fmt, LIMITS, loop, target_groups=2)  # task 2 is the long tail
    assert time.monotonic() - start < 4.0  # did not wait for the 2 x 5 s straggler
    assert [e.status for e in episodes] == ["submitted"] * 4 + ["aborted"] * 2
    assert stats["sched/aborted"] == 2.0


def test_async_and_lockstep_agree_on_a_sandbox_task(tokenizer, loop):
    from megatron_rl.config import TaskConfig
    from megatron_rl.data.agent_tasks import function_tasks
    from megatron_rl.data.tasks import Task
    from megatron_rl.envs.tools import format_tool_call
    from megatron_rl.rewards.service import RewardService
    from tests.integration.sandbox_servers import runtime_args, start_server

    if runtime_args("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    server = start_server("bwrap")
    service = RewardService(Task(TaskConfig(type="agent", num_train=1, num_eval=0), tokenizer)
                            .verifier_factory([server.address]))
    try:
        tasks = function_tasks(3, seed=1)  # three different functions: the instruction tells them apart
        fmt = TurnFormat(tokenizer, "sys")
        solve = lambda conv: next(format_tool_call("write", path=p, content=c)  # noqa: E731
                                  for t in tasks if t["instruction"] in conv for p, c in t["reference"].items())
        turns = [solve, format_tool_call("test"), format_tool_call("submit")]
        params = SamplingParams(max_new_tokens=1 << 16)
        lockstep = run_episodes(ScriptedPolicy(tokenizer, turns, end_of_turn=fmt.end_of_turn), tasks, 2, params,
                                service.verifier.make_env, fmt, LIMITS, service.loop)
        concurrent, _ = run_episodes_async(ScriptedPolicy(tokenizer, turns, end_of_turn=fmt.end_of_turn), tasks, 2,
                                           params, service.verifier.make_env, fmt, LIMITS, service.loop)
    finally:
        service.close()
        server.stop()
    assert [e.reward for e in lockstep] == [e.reward for e in concurrent] == [1.0] * 6

    def model_tokens(episode):
        return [t for t, m in zip(episode.output_ids, episode.model_mask, strict=True) if m]

    def timeless(episode):  # unittest reports its running time ("Ran 1 test in 0.001s"): a clock, not behaviour
        return re.sub(r" in \d+\.\d+s", " in <t>s", tokenizer.decode(episode.output_ids))

    assert [model_tokens(e) for e in lockstep] == [model_tokens(e) for e in concurrent]
    assert [timeless(e) for e in lockstep] == [timeless(e) for e in concurrent]
    assert all(" in <t>s" in timeless(e) for e in lockstep)  # the test tool's output is in the episodes


@pytest.mark.parametrize("nproc", [1, 2], ids=["one_engine", "dp2"])
def test_rl_loop_with_async_agent_rollouts_oversampling_and_traces(tmp_path, nproc):
    """task.type=agent with rollout.agent_scheduler=async and 50% over-sampling: every step
    trains on exactly global_batch_size / n complete groups, the cut groups are counted, and
    the step's Chrome trace holds the colocation phases, generation batches and episodes. At
    DP=2 each rank's engine plays its share: the scheduler metrics cover both engines (the cut
    episodes they count are those of all ranks' episodes; only rank 0's were counted before)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "megatron_rl.train", "+experiment=demo_countdown", "task.type=agent",
            "task.environment=synthetic", "task.num_train=16", "task.num_eval=0", "task.sft_warmup_steps=0",
            "task.max_episode_tokens=500", "task.system_prompt=Use tools.", "num_steps=2", "global_batch_size=8",
            "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=16", "rollout.agent_scheduler=async",
            "rollout.oversample=0.5", "logging.trace_every=1", "logging.progress=false", "sandbox.runtime=process",
            "sandbox.allow_unisolated=true", f"run_dir={run_dir}", f"cluster.nproc={nproc}"]
    proc = subprocess.run(args, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo)),
                          capture_output=True, text=True, timeout=250)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # no held-out prompts: no evaluation at step 0
    for r in rows:
        assert r["filter/kept_samples"] == 8  # 4 complete groups of 2, every step
        assert r["sched/groups_cut"] == 2 and 0 < r["sched/engine_busy"] <= 1
        assert r["sched/aborted"] == r["agent/aborted"] > 0  # from the schedulers vs from all the episodes
    trace = json.loads((run_dir / "traces" / "step_00000001.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"phases", "engine"} <= names and any(n.startswith("episode") for n in names)
    phases = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"sync_weights", "generate", "train", "environment", "reward"} <= phases


def test_step_deadline_keeps_what_completed_and_backpressure_holds_new_episodes(tokenizer, loop):
    fmt = TurnFormat(tokenizer, "sys")
    policy = SlowScript(tokenizer, ["a", "b"], end_of_turn=fmt.end_of_turn, cost_s=0.0)

    start = time.monotonic()
    episodes, stats = run_episodes_async(policy, _tasks(3, {1: 10.0}), 2, SamplingParams(max_new_tokens=16),
                                         _fast_env, fmt, LIMITS, loop, deadline_s=1.5)
    assert time.monotonic() - start < 4.0
    assert [e.status for e in episodes] == ["submitted", "submitted", "deadline", "deadline", "submitted",
                                            "submitted"]
    assert stats["sched/deadline"] == 2.0 and stats["agent/deadline"] == 2.0

    opened = time.monotonic() + 0.6

    async def backpressure():  # the sandbox reports a full queue for the first 0.6 s
        return 1.0 if time.monotonic() < opened else 0.1

    episodes, stats = run_episodes_async(policy, _tasks(2), 1, SamplingParams(max_new_tokens=16), _fast_env, fmt,
                                         LIMITS, loop, backpressure=backpressure)
    assert all(e.status == "submitted" for e in episodes) and stats["sched/backpressure_wait_s"] >= 0.5


def test_stragglers_can_be_kept_as_partial_rollouts(tokenizer, loop):
    """straggler_policy=partial: the cut episodes keep what they generated, get the reward of
    their environment as it stands, and their groups stay in the batch."""
    fmt = TurnFormat(tokenizer, "sys")
    policy = SlowScript(tokenizer, ["step", "done"], end_of_turn=fmt.end_of_turn, cost_s=0.0)

    start = time.monotonic()
    episodes, stats = run_episodes_async(policy, _tasks(3, {2: 5.0}), 2, SamplingParams(max_new_tokens=16),
                                         _fast_env, fmt, LIMITS, loop, target_groups=2, keep_partial=True)
    assert time.monotonic() - start < 4.0
    assert [e.status for e in episodes] == ["submitted"] * 4 + ["partial"] * 2
    partial = episodes[4:]
    assert all(e.num_turns == 1 and e.finish_reason == "length" and e.reward == 0.0 for e in partial)
    assert all(sum(e.model_mask) > 0 for e in partial) and stats["sched/partial"] == 2.0


def test_episodes_still_waiting_for_a_slot_at_the_deadline_are_counted(tokenizer, loop):
    """At most 2 episodes at once; task 0's two take >= 2 x 3 s of tool calls, so at the 1 s
    deadline they are running and the other four have not started: all six are "deadline"
    (none left without a status, which the step would train on as empty 0-reward responses)."""
    fmt = TurnFormat(tokenizer, "sys")
    policy = SlowScript(tokenizer, ["a", "b"], end_of_turn=fmt.end_of_turn, cost_s=0.0)
    episodes, stats = run_episodes_async(policy, _tasks(3, {0: 3.0}), 2, SamplingParams(max_new_tokens=16),
                                         _fast_env, fmt, LIMITS, loop, max_concurrency=2, deadline_s=1.0)
    assert [e.status for e in episodes] == ["deadline"] * 6 and all(e.reward == 0.0 for e in episodes)
    assert stats["sched/deadline"] == 6.0 and stats["agent/deadline"] == 6.0


def test_a_cut_group_is_left_out_whole(tokenizer, loop):
    """Task 1's first episode finishes long before task 0's group completes (target 1 group);
    its second one is slow and cut: the whole of group 1 is aborted, the finished episode too."""
    fmt = TurnFormat(tokenizer, "sys")
    policy = SlowScript(tokenizer, ["a", "b"], end_of_turn=fmt.end_of_turn, cost_s=0.0)
    made = []

    def make_env():  # made in episode order: the fourth (task 1's second) waits 5 s per tool call
        made.append(None)
        latency = 5.0 if len(made) == 4 else 0.05
        return make_environment("synthetic", min_latency_s=latency, max_latency_s=latency, turns=2)

    episodes, stats = run_episodes_async(policy, _tasks(2, {0: 0.5}), 2, SamplingParams(max_new_tokens=16),
                                         make_env, fmt, LIMITS, loop, target_groups=1)
    assert [e.status for e in episodes] == ["submitted", "submitted", "aborted", "aborted"]
    assert stats["sched/aborted"] == 2.0


class _Tracked(SlowScript):
    """Records when each generate call starts and ends."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.spans: list[list[float]] = []

    def generate(self, prompts, params):
        span = [time.monotonic()]
        self.spans.append(span)
        try:
            return super().generate(prompts, params)
        finally:
            span.append(time.monotonic())


def test_a_deadline_stops_generation(tokenizer, loop):
    """A slow engine (0.5 s a call, one request each) and a 0.8 s deadline: the requests of the
    cut episodes are not generated, the call in flight is waited for (the scripted engine has
    nothing to abort), and after run_episodes_async returns the engine is never called again and
    the front end's worker thread is gone (the caller may now release the engine's memory)."""
    import threading

    fmt = TurnFormat(tokenizer, "sys")
    policy = _Tracked(tokenizer, ["a", "b"], end_of_turn=fmt.end_of_turn, cost_s=0.5)
    start = time.monotonic()
    episodes, _ = run_episodes_async(policy, _tasks(6), 1, SamplingParams(max_new_tokens=16), _fast_env, fmt,
                                     LIMITS, loop, max_batch=1, deadline_s=0.8)
    returned = time.monotonic()
    assert returned - start < 2.5  # the deadline, the call in flight, slack (draining the queue took 3.5 s)
    assert all(len(span) == 2 and span[1] <= returned for span in policy.spans)  # no call in flight
    assert not any(t.name == "batching-engine" and t.is_alive() for t in threading.enumerate())
    calls = len(policy.spans)
    time.sleep(1.0)
    assert len(policy.spans) == calls
    assert all(e.status == "deadline" for e in episodes)


class _Abortable(SlowScript):
    """An engine whose generate call takes 20 s unless aborted (as SGLang's: abort() ends the
    requests in flight, which come back with finish_reason "abort")."""

    def __init__(self, *args, **kwargs):
        import threading

        super().__init__(*args, **kwargs)
        self.aborted = threading.Event()

    def generate(self, prompts, params):
        self.calls += 1
        if self.aborted.wait(timeout=20):
            return [Generation(i, [], [], "abort", 0) for i in range(len(prompts))]
        return ScriptedPolicy.generate(self, prompts, params)

    def abort(self):
        self.aborted.set()


def test_a_deadline_aborts_the_generate_call_in_flight(tokenizer, loop):
    fmt = TurnFormat(tokenizer, "sys")
    policy = _Abortable(tokenizer, ["a", "b"], end_of_turn=fmt.end_of_turn, cost_s=0.0)
    start = time.monotonic()
    episodes, stats = run_episodes_async(policy, _tasks(2), 1, SamplingParams(max_new_tokens=16), _fast_env, fmt,
                                         LIMITS, loop, deadline_s=0.5)
    assert time.monotonic() - start < 5.0  # not the 20 s of the call
    assert policy.aborted.is_set() and policy.calls == 1
    assert [e.status for e in episodes] == ["deadline"] * 2 and stats["sched/deadline"] == 2.0
