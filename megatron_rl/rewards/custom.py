"""User reward functions selected by path: `task.reward=package.module:function`.

The function scores one completion:

    def my_reward(completion: str, sample: dict) -> float          # or
    async def my_reward(completion: str, sample: dict) -> float

`sample` is the prompt's data: every column of its dataset row (type=dataset), or the generated
problem's fields (countdown: numbers, target; math: answer). The function is the user's own,
trusted code running in the trainer's reward thread; model output it executes is not sandboxed by
this path (use reward=tests or an environment for that).

A synchronous function runs on a thread pool, so a slow one does not hold up the reward loop;
each call has a deadline (`task.reward_timeout_s`), counted from when it starts to run (calls
queued behind a busy pool do not lose theirs). A call that raises, returns something other than a
finite number, or misses its deadline is no verdict: the verifier returns NaN for it, which the
rollout collector turns into an unscored sample (left out of baselines and the loss, counted in
`reward/unscored`), and it is counted in `reward/verifier_errors` (the first failure is logged
with its traceback): one odd completion must not end a long run, nor score 0 as if it were wrong.
A thread whose call never returns cannot be stopped; it keeps its pool slot.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import logging
import math
import numbers
from typing import Any, Callable, Optional, Sequence

logger = logging.getLogger(__name__)


NO_VERDICT = float("nan")  # a verifier's score for an item it could not judge (rollout.collect: unscored)


class _NotAReward(TypeError):
    pass


def is_reward_path(name: str) -> bool:
    """A `task.reward` value naming a function (`module:function`) rather than a built-in verifier."""
    return ":" in name


def load_reward_function(path: str) -> Callable[..., Any]:
    """The function `package.module:function`; ValueError naming the path when it cannot be
    imported, is not callable or does not take (completion, sample)."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"task.reward={path!r} is invalid: a reward function is given as package.module:function")
    try:
        fn = importlib.import_module(module)
        for part in attr.split("."):
            fn = getattr(fn, part)
    except Exception as err:  # noqa: BLE001  (the user's module may fail in any way while importing)
        raise ValueError(f"task.reward={path!r} cannot be loaded: {type(err).__name__}: {err}") from None
    if not callable(fn):
        raise ValueError(f"task.reward={path!r} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind("completion", {})
    except TypeError as err:
        raise ValueError(f"task.reward={path!r} must accept (completion: str, sample: dict): {err}") from None
    except ValueError:  # builtins without a signature: accept, a wrong one fails per call
        pass
    return fn


class CustomVerifier:
    """Scores completions with a user function (see the module docstring)."""

    def __init__(self, path: str, timeout_s: float = 60.0, max_workers: int = 8) -> None:
        self.path = path
        self.fn = load_reward_function(path)
        self.is_async = inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(
            getattr(self.fn, "__call__", None))
        self.timeout_s = timeout_s
        self.pool = None if self.is_async else concurrent.futures.ThreadPoolExecutor(
            max_workers, thread_name_prefix="reward-fn")
        self.max_workers = max_workers
        self._slots: Optional[asyncio.Semaphore] = None  # made on the reward loop, in score()
        self.calls = 0
        self.errors = 0
        self._logged = False

    async def score(self, items: Sequence[tuple[dict, str]]) -> list[float]:
        """items: (sample, completion text) -> rewards."""
        self.calls += 1
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_workers)
        return list(await asyncio.gather(*(self._one(sample, completion) for sample, completion in items)))

    async def _one(self, sample: dict, completion: str) -> float:
        try:
            async with self._slots:  # the deadline starts when the call does, not while it waits for a slot
                if self.is_async:
                    value = await asyncio.wait_for(self.fn(completion, sample), self.timeout_s)
                else:
                    call = asyncio.get_running_loop().run_in_executor(self.pool, self.fn, completion, sample)
                    value = await asyncio.wait_for(call, self.timeout_s)
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise _NotAReward(f"returned {value!r}; a reward is a finite number (bool counts as 0/1)")
            return float(value)
        except Exception as err:  # noqa: BLE001  (any failure of the user's function: no verdict, counted)
            self.errors += 1
            if isinstance(err, asyncio.TimeoutError):
                err = TimeoutError(f"no reward within task.reward_timeout_s={self.timeout_s}")
            if not self._logged:
                self._logged = True
                logger.warning("reward function %s failed (no verdict: the sample is left unscored; later failures "
                               "are only counted in reward/verifier_errors): %s: %s", self.path, type(err).__name__,
                               err, exc_info=err if not isinstance(err, (TimeoutError, _NotAReward)) else None)
            return NO_VERDICT

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
