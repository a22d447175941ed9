"""A user's agent program as the environment side of agent tasks: run once per episode against the rollout's
OpenAI-compatible endpoint, it returns the episode's reward.

Two forms (task.agent / task.agent_command, one of them):

- a Python callable `package.module:function`, called in a thread as
  `function(base_url=..., episode_id=..., task=...)` -> a reward (a number), or a dict with "reward" and more
  numbers (they reach the metrics as `agent/env/<key>`, as an environment's `info` does);
- a command (argv list), run per episode with the environment variables `OPENAI_BASE_URL`, `OPENAI_API_KEY`
  (a placeholder: the endpoint checks none), `MEGATRON_RL_EPISODE_ID`, `MEGATRON_RL_MODEL` (the model name
  to ask for) and `MEGATRON_RL_TASK` (the task row as JSON); its last non-empty stdout line is the reward: a
  number, or a JSON object with "reward".

Either must send the episode id with every call (`X-Episode-Id` header or the `user` field). Anything else is an
`AgentProgramError` naming what happened (the exception, the exit status and stderr's tail, a missing or
unreadable reward, the timeout): the episode is then not trained on, and counted.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
from typing import Any, Callable, Optional, Sequence


class AgentProgramError(RuntimeError):
    """The agent program failed to give a reward (its fault or its environment's, never the model's alone)."""


def load_agent_function(path: str) -> Callable[..., Any]:
    """`package.module:function`, imported; ValueError naming the path and the fix otherwise."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"task.agent={path!r} must be package.module:function (or give task.agent_command)")
    try:
        function = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"task.agent={path!r} cannot be loaded: {err}; is the module on PYTHONPATH?") from None
    if not callable(function):
        raise ValueError(f"task.agent={path!r} is not callable")
    return function


class AgentProgramHost:
    """The reward side of agent tasks played by a program (the role `EnvironmentHost` has for environments):
    holds the program and the run's OpenAI endpoint (made by the rollout, `megatron_rl.rollout.openai_episodes`),
    runs the program per episode."""

    def __init__(self, function: Optional[str], command: Optional[Sequence[str]], timeout_s: float, model: str,
                 port: int = 0, wait_s: float = 30.0) -> None:
        if (function is None) == (not command):
            raise ValueError("give one of task.agent (package.module:function) and task.agent_command (argv)")
        self.function = load_agent_function(function) if function else None
        self.command = list(command) if command else None
        self.timeout_s, self.model, self.port, self.wait_s = timeout_s, model, port, wait_s
        self.server: Any = None  # the OpenAI endpoint, started at the first rollout
        self.calls = self.errors = 0  # episodes run / lost

    def play(self, base_url: str, episode_id: str, task: dict[str, Any]) -> tuple[float, dict[str, float]]:
        """Run the program for one episode: (reward, the numbers it reported besides)."""
        if self.function is not None:
            try:
                result = self.function(base_url=base_url, episode_id=episode_id, task=task)
            except Exception as exc:  # the program's own failure, said in full
                raise AgentProgramError(f"the agent function raised {type(exc).__name__}: {exc}") from exc
            return _reward_of(result, "the agent function's return value")
        env = dict(os.environ, OPENAI_BASE_URL=base_url, OPENAI_API_KEY="megatron-rl",
                   MEGATRON_RL_EPISODE_ID=episode_id, MEGATRON_RL_MODEL=self.model,
                   MEGATRON_RL_TASK=json.dumps(task))
        try:
            proc = subprocess.run(self.command, env=env, capture_output=True, text=True, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            raise AgentProgramError(f"the agent command {self.command} ran past task.agent_timeout_s="
                                    f"{self.timeout_s:g}") from None
        except OSError as exc:
            raise AgentProgramError(f"the agent command {self.command} cannot start: {exc}") from None
        if proc.returncode != 0:
            raise AgentProgramError(f"the agent command {self.command} exited with status {proc.returncode}: "
                                    f"{proc.stderr[-1500:]}")
        lines = [line for line in proc.stdout.splitlines() if line.strip()]
        if not lines:
            raise AgentProgramError(f"the agent command {self.command} printed no reward (its last stdout line "
                                    "must be a number or a JSON object with \"reward\")")
        try:
            result = json.loads(lines[-1])
        except json.JSONDecodeError:
            raise AgentProgramError(f"the agent command's last stdout line {lines[-1][:200]!r} is not a number or "
                                    "a JSON object with \"reward\"") from None
        return _reward_of(result, "the agent command's last stdout line")

    async def score(self, items) -> list[float]:
        raise TypeError("agent programs score their own episodes (rollout/openai_episodes.py), not completions")

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server = None


def _reward_of(result: Any, where: str) -> tuple[float, dict[str, float]]:
    info: dict[str, float] = {}
    if isinstance(result, dict):
        info = {k: float(v) for k, v in result.items() if k != "reward" and isinstance(v, (int, float))}
        result = result.get("reward")
    if isinstance(result, bool) or not isinstance(result, (int, float)) or not math.isfinite(result):
        raise AgentProgramError(f"{where} gave reward {result!r}: a finite number is needed")
    return float(result), info
