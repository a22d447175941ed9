"""An episode's turns ask the engine for no more tokens than the episode has room for
(EpisodeLimits.max_tokens counts the prompt and every turn), in both drivers: the lockstep one
(multiturn.run_episodes) and the asynchronous scheduler (scheduler.run_episodes_async). An
engine with a context length of max_tokens would refuse a longer request."""

from __future__ import annotations

import pytest

from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.multiturn import EpisodeLimits, TurnFormat, run_episodes
from megatron_rl.rollout.scheduler import run_episodes_async
from megatron_rl.rollout.scripted import ScriptedPolicy

MAX_NEW = 16
OBSERVATION = "ok"


class EchoEnv:
    """An environment that answers every turn with OBSERVATION and never ends the episode."""

    async def reset(self, task):
        self.steps = 0

    async def step(self, action):
        self.steps += 1
        return OBSERVATION, False

    async def evaluate(self):
        return 0.0

    async def close(self):
        pass


class Recording(ScriptedPolicy):
    """Records each call's prompt lengths and max_new_tokens."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[list[int], int]] = []

    def generate(self, prompts, params):
        self.calls.append(([len(p) for p in prompts], params.max_new_tokens))
        return super().generate(prompts, params)


def _play(driver, tasks, limits, loop):
    tokenizer = load_tokenizer("builtin:char")
    fmt = TurnFormat(tokenizer, "sys")
    policy = Recording(tokenizer, ["x" * 40] * 8, end_of_turn=fmt.end_of_turn)  # every turn longer than MAX_NEW
    params = SamplingParams(max_new_tokens=MAX_NEW)
    if driver == "lockstep":
        episodes = run_episodes(policy, tasks, 1, params, EchoEnv, fmt, limits, loop)
    else:
        episodes, _ = run_episodes_async(policy, tasks, 1, params, EchoEnv, fmt, limits, loop)
    return fmt, policy, episodes


def _lengths(fmt):
    """(prompt tokens of task "a", tokens of one observation after a turn cut by the token limit)."""
    return len(fmt.encode(fmt.prompt("a"))), len(fmt.encode(fmt.observation(OBSERVATION, False)))


@pytest.mark.parametrize("driver", ["lockstep", "async"])
def test_turns_ask_for_no_more_than_the_room_left(driver, loop):
    fmt = TurnFormat(load_tokenizer("builtin:char"), "sys")
    prompt, obs = _lengths(fmt)
    # Task "a": turn 1 takes MAX_NEW tokens, the observation fits, 5 tokens are left for turn 2.
    # Task "aaaa" (3 more prompt tokens): 2 left for turn 2.
    limits = EpisodeLimits(max_turns=8, max_tokens=prompt + MAX_NEW + obs + 5, wall_time_s=60)
    tasks = [{"instruction": "a"}, {"instruction": "aaaa"}]
    fmt, policy, episodes = _play(driver, tasks, limits, loop)
    asked = sorted(m for lengths, m in policy.calls for _ in lengths)
    assert asked == [2, 5, MAX_NEW, MAX_NEW]
    for lengths, max_new_tokens in policy.calls:
        assert all(max_new_tokens <= limits.max_tokens - n for n in lengths)
    assert [e.status for e in episodes] == ["max_tokens"] * 2 and [e.num_turns for e in episodes] == [2, 2]
    assert all(len(e.prompt_tokens) + len(e.output_ids) == limits.max_tokens for e in episodes)


@pytest.mark.parametrize("driver", ["lockstep", "async"])
def test_an_episode_without_room_ends_without_a_request(driver, loop):
    fmt = TurnFormat(load_tokenizer("builtin:char"), "sys")
    prompt, _ = _lengths(fmt)
    limits = EpisodeLimits(max_turns=8, max_tokens=prompt, wall_time_s=60)  # the prompt fills the budget
    fmt, policy, episodes = _play(driver, [{"instruction": "a"}], limits, loop)
    assert policy.calls == []
    [episode] = episodes
    assert episode.status == "max_tokens" and episode.num_turns == 0 and episode.output_ids == []


def test_a_turn_ended_by_a_stop_string_is_closed_by_the_observation():
    """A turn that ends with its end-of-turn token is closed; one ended by a stop string (or the token
    limit) is not, and the observation appended after it starts with the end-of-turn text."""
    from megatron_rl.rollout.base import Generation
    from megatron_rl.rollout.multiturn import Episode, after_step, take_turn

    tokenizer = load_tokenizer("builtin:char")
    fmt = TurnFormat(tokenizer, "s")
    limits = EpisodeLimits(max_turns=4, max_tokens=500, wall_time_s=60)
    eot = fmt.stop_token_ids
    assert len(eot) == 1
    for ids, closed in ((tokenizer.encode("run:", add_special_tokens=False) + list(eot), True),
                        (tokenizer.encode("run: ls END", add_special_tokens=False), False)):
        ep = Episode(0, fmt.encode(fmt.prompt("task")), [], [], "stop", 1)
        got, text = take_turn(ep, Generation(0, ids, [0.0] * len(ids), "stop", 1), fmt, limits)
        assert got is closed and text.startswith("run:")
        after_step(ep, "done", False, got, fmt, limits, started=float("inf"))
        appended = tokenizer.decode(ep.output_ids[len(ids):], skip_special_tokens=False)
        assert appended.startswith(fmt.end_of_turn) is not closed
