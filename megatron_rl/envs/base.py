"""The environment contract of multi-turn agent tasks, and the registry that selects an
environment by name per task.

    obs = await env.reset(task)          # the first observation (the task's instruction)
    obs, done = await env.step(action)   # the model's turn text -> the tool's result
    reward = await env.evaluate()        # after the episode: verification, reward in [0, 1]
    await env.close()

Environments are asynchronous because their work happens elsewhere (a sandbox server);
the multi-turn rollout drives many at once. Two kinds of failure are kept apart, because
only one of them is the policy's fault:

- the model's: a malformed tool call, a command that fails; answered with an observation
  and counted in `env.model_errors`;
- the infrastructure's: a sandbox server that does not answer; raised as
  `InfrastructureError` from `reset` / `step` / `evaluate`, after the environment's own
  recovery (`recover`) failed. The rollout retries or drops the episode and counts it.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable


class InfrastructureError(RuntimeError):
    """The sandbox (not the model) failed and the environment could not recover."""


@runtime_checkable
class Environment(Protocol):
    model_errors: int
    info: dict[str, Any]  # what evaluate() found (for metrics and the reward audit)

    async def reset(self, task: dict[str, Any]) -> str: ...

    async def step(self, action: str) -> tuple[str, bool]: ...

    async def evaluate(self) -> float: ...

    async def close(self) -> None: ...


# The built-in environments by `module:Class`, imported when selected: this module imports none of them (they
# import it), so the registry has no import circle.
BUILTIN_ENVIRONMENTS = {
    "countdown": "megatron_rl.envs.countdown:CountdownEnvironment",
    "repo": "megatron_rl.envs.repo:RepoEnvironment",
    "synthetic": "megatron_rl.envs.synthetic:SyntheticEnvironment",
}
ENVIRONMENTS: dict[str, Callable[..., Environment]] = {}  # registered with `register_environment`


def register_environment(name: str) -> Callable[[Callable[..., Environment]], Callable[..., Environment]]:
    """Class decorator: make an environment selectable as `task.environment=<name>`."""
    def add(factory: Callable[..., Environment]) -> Callable[..., Environment]:
        if name in BUILTIN_ENVIRONMENTS:
            raise ValueError(f"environment {name!r} is already registered (a built-in environment, "
                             f"{BUILTIN_ENVIRONMENTS[name]})")
        if name in ENVIRONMENTS:
            raise ValueError(f"environment {name!r} is already registered (by {ENVIRONMENTS[name].__qualname__})")
        ENVIRONMENTS[name] = factory
        return factory
    return add


def environment_names() -> list[str]:
    """Every name `task.environment` takes: the built-in environments and the registered ones."""
    return sorted({*BUILTIN_ENVIRONMENTS, *ENVIRONMENTS})


def environment_factory(name: str) -> Callable[..., Environment]:
    """An environment class by built-in or registered name, or by `package.module:Class` (imported lazily,
    so a user's environment needs no change to this package)."""
    import importlib

    path = BUILTIN_ENVIRONMENTS.get(name, name if ":" in name and name not in ENVIRONMENTS else None)
    if path is not None:
        module, _, attr = path.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"environment {name!r} cannot be loaded: {err}") from None
    if name not in ENVIRONMENTS:
        raise ValueError(f"environment {name!r} is not registered: registered ones are "
                         f"{', '.join(environment_names())}")
    return ENVIRONMENTS[name]


def make_environment(name: str, **kwargs: Any) -> Environment:
    return environment_factory(name)(**kwargs)


def reference_turns(name: str, task: dict[str, Any]) -> list[str]:
    """The model turns that play `task`'s reference solution in the environment `name` (its
    class's static `reference_turns(task)`; the agent warm start plays them)."""
    return _scripted_turns(name, "reference_turns", task, "cannot play reference solutions",
                           "set task.sft_warmup_steps=0")


def known_bad_turns(name: str, task: dict[str, Any]) -> list[str]:
    """The model turns of a candidate the environment `name` must reject for `task` (its class's
    static `known_bad_turns(task)`; the quality checks play them)."""
    return _scripted_turns(name, "known_bad_turns", task, "names no known-bad candidate",
                           "the verifier's rejection cannot be checked")


def _scripted_turns(name: str, hook: str, task: dict[str, Any], missing: str, consequence: str) -> list[str]:
    factory = environment_factory(name)
    if not callable(getattr(factory, hook, None)):
        raise ValueError(f"environment {name!r} {missing} (its class has no {hook}(task)): {consequence}")
    return list(getattr(factory, hook)(task))


def system_prompt(name: str) -> str:
    """The environment's default system message (its class's `system_prompt`; the tool-call
    instructions when it has none); task.system_prompt replaces it."""
    from megatron_rl.envs.tools import TOOL_INSTRUCTIONS

    return getattr(environment_factory(name), "system_prompt", None) or TOOL_INSTRUCTIONS
