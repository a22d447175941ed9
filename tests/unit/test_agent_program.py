"""Agent programs (envs/agent_program.py) played through the endpoint by `run_program_episodes`: a Python
callable's return value and a command's last stdout line are the rewards; a program that raises, exits non-zero,
prints no reward or makes no call loses its episode (agent_failed, not trained on); and the config refuses what
the agent-program rollout does not do, naming the fix."""

from __future__ import annotations

import re
import sys
import textwrap
import threading
import time

import pytest

openai = pytest.importorskip("openai", reason="the agents here use the openai client: pip install -e '.[dev]'")

from megatron_rl.config import TaskConfig  # noqa: E402
from megatron_rl.envs.agent_program import AgentProgramError, AgentProgramHost  # noqa: E402
from megatron_rl.rollout.base import SamplingParams  # noqa: E402
from megatron_rl.rollout.multiturn import EpisodeLimits  # noqa: E402
from megatron_rl.rollout.openai_episodes import run_program_episodes  # noqa: E402

TASKS = [{"instruction": "1 2 -> 3", "target": 3}, {"instruction": "2 2 -> 4", "target": 4}]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6, n=2)
LIMITS = EpisodeLimits(max_turns=3, max_tokens=200)


def length_agent(base_url: str, episode_id: str, task: dict) -> dict:
    """One completions call; reward = the reply's length / 10 (so it is checkable against the recorded tokens)."""
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    reply = client.completions.create(model="policy", prompt=task["instruction"], user=episode_id)
    return {"reward": len(reply.choices[0].text) / 10, "target": task["target"]}


RELEASE = threading.Event()


def hanging_agent(base_url: str, episode_id: str, task: dict) -> float:
    RELEASE.wait(60)
    return 1.0


def failing_agent(base_url: str, episode_id: str, task: dict) -> float:
    if task["target"] == 4:
        raise KeyError("no tool")
    return 0.5  # and makes no call: nothing to train on


@pytest.fixture(scope="module")
def engine_and_tokenizer():
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.models.hf import build_hf_model, hub_state_dict
    from megatron_rl.rollout.hf_engine import HFEngine

    cfg = ModelConfig(num_layers=1, vocab_size=99)
    engine = HFEngine(cfg)
    engine.update_weights(hub_state_dict(build_hf_model(cfg, seed=1)).items(), version=1)
    return engine, load_tokenizer("builtin:char")


def test_a_python_callable_agents_reward_is_its_return_value(engine_and_tokenizer):
    engine, tokenizer = engine_and_tokenizer
    host = AgentProgramHost(f"{__name__}:length_agent", None, timeout_s=60, model="policy")
    try:
        episodes = run_program_episodes(engine, host, tokenizer, TASKS, 2, PARAMS, LIMITS)
    finally:
        host.close()
    assert [e.prompt_index for e in episodes] == [0, 0, 1, 1]
    for e in episodes:
        assert e.status == "submitted" and e.num_turns == 1
        assert e.prompt_tokens == tokenizer(TASKS[e.prompt_index]["instruction"])["input_ids"]
        assert e.model_mask == [1] * len(e.output_ids)
        assert e.reward == len(tokenizer.decode(e.output_ids, skip_special_tokens=True)) / 10
        assert e.info == {"target": float(TASKS[e.prompt_index]["target"])}
    assert (host.calls, host.errors) == (4, 0)


def test_failed_programs_lose_their_episodes(engine_and_tokenizer, tmp_path, caplog):
    engine, tokenizer = engine_and_tokenizer
    host = AgentProgramHost(f"{__name__}:failing_agent", None, timeout_s=60, model="policy")
    try:
        with caplog.at_level("WARNING"):
            episodes = run_program_episodes(engine, host, tokenizer, TASKS, 1, PARAMS, LIMITS)
    finally:
        host.close()
    assert [e.status for e in episodes] == ["agent_failed", "agent_failed"] and not any(e.scored for e in episodes)
    assert "made no call to the endpoint" in caplog.text and "raised KeyError: 'no tool'" in caplog.text
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent("""\
        import os, sys
        if os.environ["MEGATRON_RL_TASK"].count("4"):
            sys.exit("crashed on purpose")
        print("not a reward")
    """))
    command = AgentProgramHost(None, [sys.executable, str(script)], timeout_s=60, model="policy")
    with pytest.raises(AgentProgramError, match="exited with status 1: crashed on purpose"):
        command.play("http://127.0.0.1:9/v1", "e", TASKS[1])
    with pytest.raises(AgentProgramError, match="last stdout line 'not a reward' is not a number"):
        command.play("http://127.0.0.1:9/v1", "e", TASKS[0])


def test_a_function_past_its_timeout_loses_its_episode_and_is_not_waited_for(engine_and_tokenizer):
    engine, tokenizer = engine_and_tokenizer
    host = AgentProgramHost(f"{__name__}:hanging_agent", None, timeout_s=0.5, model="policy")
    start = time.monotonic()
    try:
        episodes = run_program_episodes(engine, host, tokenizer, TASKS[:1], 1, PARAMS, LIMITS)
    finally:
        RELEASE.set()
        host.close()
    assert time.monotonic() - start < 20 and [e.status for e in episodes] == ["agent_failed"]


@pytest.mark.parametrize("fields, message", [
    (dict(type="countdown", agent="m:f"), "task.agent=m:f is invalid: an agent program plays agent tasks"),
    (dict(type="agent", agent="m:f", agent_command=["x"]), "give task.agent (a Python function) or"),
    (dict(type="agent", agent="module_only"), "must be package.module:function"),
    (dict(type="agent", agent_command=[]), "must be a non-empty list"),
    (dict(type="agent", agent="m:f", agent_timeout_s=0), "task.agent_timeout_s"),
])
def test_the_config_refuses_bad_agent_settings(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TaskConfig(**fields)


def test_an_agent_function_that_does_not_import_is_named():
    with pytest.raises(ValueError, match="task.agent='no_such_module:f' cannot be loaded: No module named"):
        AgentProgramHost("no_such_module:f", None, timeout_s=1, model="policy")
