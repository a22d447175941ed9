"""Multi-turn agent rollouts, token-in/token-out: model turns and tool results interleaved
in one token sequence per episode, with a loss mask over the model's tokens only.

Per episode:

    tokens = chat_template(system: tool instructions, user: instruction) + generation prompt
    repeat:  model turn   -> generated ids appended as they came (mask 1, engine log-probs)
             env.step     -> observation text wrapped in the template's tool turn, tokenized
                             ONCE here and appended (mask 0); never re-tokenized later
    until the model submits / answers, or a limit (turns, total tokens, wall time) is hit;
    then env.evaluate() -> reward.

Episodes advance in lockstep: each turn, the active episodes' sequences go to the engine in
one `generate` call (the engine batches them), then their environment steps run
concurrently on the reward service's event loop (sandbox calls overlap). A sandbox failure
the environment cannot recover from drops that episode (status "dropped", counted), never
the step. Engine calls, environment steps and rewards land on a `Timeline`, from which both
schedulers' `sched/...` metrics come (`scheduler_stats`): the lockstep driver's engine-busy
fraction is what an asynchronous scheduler would win back.

The observation wrapper comes from the tokenizer's own chat template: rendering a
conversation with and without one more `observation_role` message and taking the
difference, so any template (Qwen's `tool` role, a plain `user` turn) works unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Callable, Optional, Sequence

import torch

from megatron_rl.observability.timeline import Timeline
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.collect import Rollout
from megatron_rl.trainer.packing import Sample

logger = logging.getLogger(__name__)
_MARK = "\u2063OBSERVATION\u2063"
ENVIRONMENTS = "environments"  # the lockstep driver's timeline row for its environments' calls


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 6
    max_tokens: int = 1024  # prompt + every turn
    wall_time_s: float = 120.0

    @classmethod
    def of(cls, task_cfg: Any) -> "EpisodeLimits":
        """An agent task's limits: task.max_turns, max_episode_tokens, episode_wall_time_s."""
        return cls(task_cfg.max_turns, task_cfg.max_episode_tokens, task_cfg.episode_wall_time_s)


@dataclasses.dataclass
class Episode(Rollout):
    """A rollout whose response is several model turns with observations between them."""

    model_mask: list[int] = dataclasses.field(default_factory=list)  # per output token: 1 = model's
    num_turns: int = 0
    # submitted | max_turns | max_tokens | wall_time | dropped | aborted (cut) | deadline | partial; an agent
    # program's (rollout/openai_episodes.py): mismatch | sampling_mismatch | agent_failed
    status: str = ""
    model_errors: int = 0
    infra_errors: int = 0
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    turn_versions: list[int] = dataclasses.field(default_factory=list)  # the weight version of each model turn

    def sample(self, extras: dict[str, torch.Tensor]) -> Sample:
        """The trainer's sample; with the engine's routing (`take_turn`: its last turn's, which covers every
        token up to that turn's last), extras["routing"] [L-1, MoE layers * k], -1 on the positions after it
        (a final observation), which the trainer's routers route (`routing_replay.carried_routes`)."""
        tokens = torch.tensor(self.prompt_tokens + self.output_ids, dtype=torch.long)
        mask = torch.zeros(len(tokens) - 1)
        mask[len(self.prompt_tokens) - 1:] = torch.tensor(self.model_mask, dtype=torch.float)
        if self.routing is not None:
            routing = self.routing.reshape(len(self.routing), -1)
            padded = torch.full((len(tokens) - 1, routing.shape[1]), -1, dtype=routing.dtype)
            padded[:len(routing)] = routing
            extras = {**extras, "routing": padded}
        return Sample(tokens, mask, extras)


class TurnFormat:
    """The chat-template pieces of an agent conversation, rendered once per tokenizer."""

    def __init__(self, tokenizer: Any, system_prompt: str, observation_role: str = "tool") -> None:
        from megatron_rl.data.tasks import end_of_turn
        from megatron_rl.data.special_tokens import stop_ids

        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.end_of_turn = end_of_turn(tokenizer)
        # ids that end a model turn besides eos: the template's end-of-turn, the checkpoint's other eos ids
        self.stop_token_ids = stop_ids(tokenizer, self.encode(self.end_of_turn) if self.end_of_turn else [])
        base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"}]
        before = self.render(base)
        after = self.render(base + [{"role": observation_role, "content": _MARK}], add_generation_prompt=True)
        if not after.startswith(before) or _MARK not in after:
            raise ValueError("the tokenizer's chat template is not prefix-stable; multi-turn rollouts need one that is")
        head, self.observation_suffix = after[len(before):].split(_MARK)
        # What follows the end-of-turn token of the assistant turn (e.g. "\n"), then the tool turn's header.
        self.observation_prefix = before[before.rindex(self.end_of_turn) + len(self.end_of_turn):] + head \
            if self.end_of_turn else head

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt(self, instruction: str) -> str:
        return self.render([{"role": "system", "content": self.system_prompt},
                            {"role": "user", "content": instruction}], add_generation_prompt=True)

    def observation(self, text: str, turn_closed: bool) -> str:
        """The text appended after a model turn: the tool turn with `text`, then the next
        generation prompt (closing the model's turn first when it was cut by the token limit)."""
        return ("" if turn_closed else self.end_of_turn) + self.observation_prefix + text + self.observation_suffix


@dataclasses.dataclass
class _Live:
    episode: Episode
    env: Any
    started: float
    closed: bool = True  # the last model turn ended with its stop token
    text: str = ""  # the last model turn's text, for the environment


def run_episodes(engine: Any, tasks: Sequence[dict[str, Any]], n: int, params: SamplingParams,
                 make_env: Callable[[], Any], fmt: TurnFormat, limits: EpisodeLimits,
                 loop: asyncio.AbstractEventLoop, timeout_s: float = 600.0,
                 timeline: Optional[Timeline] = None) -> list[Episode]:
    """`n` episodes per task (group id = task index); returns them all, dropped ones included.
    Each turn's engine calls go on `timeline`'s `engine` track, the environments' resets, steps
    and rewards on its `environments` track (all episodes at once: they run together)."""
    def on_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)

    live: list[_Live] = []
    try:
        _play_lockstep(engine, tasks, n, params, make_env, fmt, limits, on_loop, live, timeline or Timeline())
    except BaseException:  # an engine failure or a stop: still close the environments (their sandbox sessions)
        try:
            asyncio.run_coroutine_threadsafe(_gather([x.env.close() for x in live]), loop).result(30)
        except Exception as exc:
            logger.warning("closing %d environments after a failed rollout: %s", len(live), exc)
        raise
    on_loop(_gather([x.env.close() for x in live]))
    return [x.episode for x in live]


def _play_lockstep(engine: Any, tasks: Sequence[dict[str, Any]], n: int, params: SamplingParams,
                   make_env: Callable[[], Any], fmt: TurnFormat, limits: EpisodeLimits, on_loop: Callable,
                   live: list[_Live], timeline: Timeline) -> None:
    """`run_episodes`' body: fills `live` as environments are made, plays every episode to its end."""
    for index, task in enumerate(tasks):
        for _ in range(n):
            prompt = fmt.encode(fmt.prompt(task["instruction"]))
            live.append(_Live(Episode(index, prompt, [], [], "stop", -1), on_loop(_make(make_env)), time.monotonic()))
    with timeline.span("reset", ENVIRONMENTS, episodes=len(live)):
        resets = on_loop(_gather([x.env.reset(tasks[x.episode.prompt_index]) for x in live]))
    for x, outcome in zip(live, resets):
        if isinstance(outcome, Exception):
            _drop(x, outcome)
    turn = 0
    # An episode with no room left for a turn ends here (max_tokens), without a request.
    while active := [x for x in live if not x.episode.status and not end_if_full(x.episode, limits)]:
        seed = None if params.seed is None else params.seed * 1009 + turn
        # One call per turn; episodes near their token budget ask for less, in a call of their own per length.
        calls: dict[int, list[_Live]] = {}
        for x in active:
            calls.setdefault(min(params.max_new_tokens, room_left(x.episode, limits)), []).append(x)
        for length, batch in calls.items():
            call_seed = seed if seed is None or length == params.max_new_tokens else seed * 7919 + length
            with timeline.span("generate", "engine", batch=len(batch), turn=turn):
                generations = engine.generate([x.episode.prompt_tokens + x.episode.output_ids for x in batch],
                                              turn_sampling(params, fmt, call_seed, length))
            for x, gen in zip(batch, generations):
                x.closed, x.text = take_turn(x.episode, gen, fmt, limits)
        with timeline.span("environment", ENVIRONMENTS, episodes=len(active), turn=turn):
            steps = on_loop(_gather([x.env.step(x.text) for x in active]))
        for x, outcome in zip(active, steps):
            if isinstance(outcome, Exception):
                _drop(x, outcome)
                continue
            after_step(x.episode, *outcome, x.closed, fmt, limits, x.started)
        turn += 1
    finished = [x for x in live if x.episode.status != "dropped"]
    with timeline.span("reward", ENVIRONMENTS, episodes=len(finished)):
        rewards = on_loop(_gather([x.env.evaluate() for x in finished]))
    for x, outcome in zip(finished, rewards):
        if isinstance(outcome, Exception):
            _drop(x, outcome)
        else:
            x.episode.reward = float(outcome)
            x.episode.info = dict(getattr(x.env, "info", {}))
    for x in live:
        x.episode.model_errors = getattr(x.env, "model_errors", 0)
        x.episode.infra_errors += getattr(x.env, "infra_errors", 0)


def task_system_prompt(task_cfg: Any) -> str:
    """An agent task's system prompt: task.system_prompt, else its environment's."""
    from megatron_rl.envs import system_prompt

    return task_cfg.system_prompt or system_prompt(task_cfg.environment)


def turn_sampling(params: SamplingParams, fmt: TurnFormat, seed: Optional[int],
                  room: Optional[int] = None) -> SamplingParams:
    """One model turn: one sample, stopped by the template's end-of-turn token too, and no longer
    than the episode's `room` (`room_left`; >= 1): a request past the episode's budget would
    generate tokens that are thrown away, and past the engine's context length it fails."""
    max_new_tokens = params.max_new_tokens if room is None else min(params.max_new_tokens, room)
    return dataclasses.replace(params, n=1, stop_token_ids=tuple(params.stop_token_ids) + fmt.stop_token_ids,
                               seed=seed, max_new_tokens=max_new_tokens)


def room_left(ep: Episode, limits: EpisodeLimits) -> int:
    """The tokens an episode may still add (limits.max_tokens counts the prompt and every turn)."""
    return max(limits.max_tokens - len(ep.prompt_tokens) - len(ep.output_ids), 0)


def end_if_full(ep: Episode, limits: EpisodeLimits) -> bool:
    """Before a turn: end an episode that has no room left (status max_tokens) instead of asking
    the engine for a turn; True if it ended."""
    if room_left(ep, limits) > 0:
        return False
    ep.status, ep.finish_reason = "max_tokens", "length"
    return True


def take_turn(ep: Episode, gen: Any, fmt: TurnFormat, limits: EpisodeLimits) -> tuple[bool, str]:
    """Append a generated turn (cut at the episode's token budget); returns (the turn ended with
    its stop token, the turn's text for the environment)."""
    room = room_left(ep, limits)
    ids = gen.output_ids[:room]
    ep.output_ids += ids
    ep.logprobs += gen.logprobs[:room]
    ep.model_mask += [1] * len(ids)
    if gen.routing is not None:  # this call fed the whole episode so far: its routing covers every earlier turn
        ep.routing = gen.routing[:len(ep.prompt_tokens) + len(ep.output_ids) - 1]
    if not ep.turn_versions:
        ep.weight_version = gen.weight_version  # a rollout's version is its first token's
    ep.turn_versions.append(gen.weight_version)
    ep.num_turns += 1
    # closed: the turn's own end-of-turn (or eos) token ended it; a stop string or the token limit leaves
    # it open, and the observation closes it
    closed = (gen.finish_reason == "stop" and len(ids) == len(gen.output_ids) and bool(ids)
              and ids[-1] in (*fmt.stop_token_ids, fmt.tokenizer.eos_token_id))
    return closed, fmt.tokenizer.decode(ids, skip_special_tokens=True)


def after_step(ep: Episode, observation: str, done: bool, closed: bool, fmt: TurnFormat, limits: EpisodeLimits,
               started: float) -> None:
    """End the episode (status) or append the observation, tokenized once (mask 0)."""
    if done:
        ep.status = "submitted"
    elif ep.num_turns >= limits.max_turns:
        ep.status = "max_turns"
    elif time.monotonic() - started > limits.wall_time_s:
        ep.status = "wall_time"
    else:
        ids = fmt.encode(fmt.observation(observation, closed))
        if len(ep.prompt_tokens) + len(ep.output_ids) + len(ids) >= limits.max_tokens:
            ep.status, ep.finish_reason = "max_tokens", "length"
            return
        ep.output_ids += ids
        ep.logprobs += [0.0] * len(ids)
        ep.model_mask += [0] * len(ids)


async def _make(make_env: Callable[[], Any]) -> Any:
    return make_env()  # on the event loop that will drive it (gRPC channels bind to their loop)


async def _gather(coros: list) -> list:
    return list(await asyncio.gather(*coros, return_exceptions=True))


def _drop(x: _Live, error: BaseException) -> None:
    from megatron_rl.envs.base import InfrastructureError

    if not isinstance(error, InfrastructureError):
        raise error
    logger.warning("episode of task %d dropped: %s", x.episode.prompt_index, error)
    x.episode.status, x.episode.reward = "dropped", 0.0
    x.episode.infra_errors += 1


def scheduler_stats(episodes: Sequence[Episode], timeline: Timeline, start: float, wall: float,
                    backpressure_wait_s: float = 0.0) -> dict[str, float]:
    """A scheduler run's metrics, either scheduler's (the run began at `start`, perf_counter
    seconds, and took `wall`): `sched/engine_busy`, the fraction of the run the engine spent in
    `generate` (its `engine` spans on `timeline`), `sched/wall_s`, its episodes counted by the
    statuses only a scheduler gives (cut: aborted, deadline, partial), the seconds the sandbox's
    back-pressure held episodes back, and `episode_metrics`."""
    busy = timeline.busy("engine", start, start + wall)
    return {"sched/engine_busy": busy / max(wall, 1e-9), "sched/wall_s": wall,
            **{f"sched/{status}": float(sum(e.status == status for e in episodes))
               for status in ("aborted", "deadline", "partial")},
            "sched/backpressure_wait_s": backpressure_wait_s, **episode_metrics(episodes)}


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Counts for the step's metrics: attribution of failures, turns, statuses; and the mean of each
    number the environments put in `info` (`agent/env/<key>`, over the `agent/env_count/<key>` episodes that
    report it). `agent/episodes` counts them all, lost ones included: the count `agent/turns_mean` is over."""
    count = max(len(episodes), 1)
    out = {"agent/episodes": float(len(episodes)), "agent/turns_mean": sum(e.num_turns for e in episodes) / count,
           "agent/model_errors": float(sum(e.model_errors for e in episodes)),
           "agent/infra_errors": float(sum(e.infra_errors for e in episodes)),
           "agent/hacking_flagged": float(sum(bool(e.info.get("tampered") or e.info.get("hardcoded"))
                                              for e in episodes))}
    for status in ("submitted", "max_turns", "max_tokens", "wall_time", "dropped", "aborted", "deadline",
                   "partial", "mismatch", "sampling_mismatch", "agent_failed"):
        out[f"agent/{status}"] = float(sum(e.status == status for e in episodes))
    reported: dict[str, list[float]] = {}  # what the environments' evaluate() found: means of its numbers
    for e in episodes:
        for key, value in e.info.items():
            if isinstance(value, (bool, int, float)):
                reported.setdefault(key, []).append(float(value))
    out.update({f"agent/env/{key}": sum(v) / len(v) for key, v in sorted(reported.items())})
    out.update({f"agent/env_count/{key}": float(len(v)) for key, v in sorted(reported.items())})
    return out
