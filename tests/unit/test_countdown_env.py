"""The `countdown` agent environment (Countdown with feedback): its answers checked against
Python's own arithmetic on hand-written expressions, whole episodes through the multi-turn
rollout with a scripted policy, the generated task sets, and the config rules that pair
the generator with the environment."""

from __future__ import annotations

import asyncio

import pytest

from megatron_rl.config import TaskConfig
from megatron_rl.data.agent_tasks import countdown_tasks
from megatron_rl.data.countdown import generate_problems, split_of
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.envs import known_bad_turns, make_environment, reference_turns, system_prompt
from megatron_rl.envs.countdown import SYSTEM_PROMPT, CountdownEnvironment, check
from megatron_rl.envs.tools import TOOL_INSTRUCTIONS, format_tool_call
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.multiturn import EpisodeLimits, TurnFormat, run_episodes
from megatron_rl.rollout.scripted import ScriptedPolicy

NUMBERS, TARGET = [3, 5, 7], 22


@pytest.mark.parametrize("answer", ["3*5+7", "7+3*5", " (5*3)+7 ", "3*5+7\nsomething after the first line"])
def test_a_solution_is_correct_and_ends_the_episode(answer):
    assert check(NUMBERS, TARGET, answer) == (True, "correct")


@pytest.mark.parametrize("answer", ["3*7+5", "5+7", "3*5", "7-5", "3-5-7", "(3+5)*7"])
def test_a_wrong_expression_is_told_its_value_and_direction(answer):
    value = eval(answer)  # the test's own strings: Python's arithmetic is the independent reference
    assert value != TARGET
    assert check(NUMBERS, TARGET, answer) == (False, f"{value}, too {'low' if value < TARGET else 'high'}")


@pytest.mark.parametrize("answer, why", [
    ("", "not an expression of + - * over the numbers"),
    ("3/5+7", "not an expression of + - * over the numbers"),
    ("3**5", "not an expression of + - * over the numbers"),
    ("-3+5", "not an expression of + - * over the numbers"),
    ("x+1", "not an expression of + - * over the numbers"),
    ("3*5+7 is it", "not an expression of + - * over the numbers"),
    ("(" * 40 + "3+5" + ")" * 40, "not an expression of + - * over the numbers"),
    ("3+", "not an expression of + - * over the numbers"),
    ("22", "use at least 2 numbers"),
    ("(7)", "use at least 2 numbers"),
    ("3*3+7", "3 used too often"),
    ("35-7", "35 is not given"),
    ("3+5+9", "9 is not given"),
])
def test_anything_else_is_invalid_and_says_why(answer, why):
    assert check(NUMBERS, TARGET, answer) == (False, f"invalid: {why}")


def test_an_episode_counts_attempts_model_errors_and_the_first_try():
    async def play(turns):
        env = make_environment("countdown")
        task = {"id": "t", "instruction": "3 5 7 -> 22", "numbers": NUMBERS, "target": TARGET}
        assert await env.reset(task) == "3 5 7 -> 22"
        observations = [await env.step(t) for t in turns]
        return observations, await env.evaluate(), env.info, env.model_errors

    observations, reward, info, errors = asyncio.run(play(["3/5", "5+7", "3*5+7"]))
    assert observations == [("invalid: not an expression of + - * over the numbers", False), ("12, too low", False),
                            ("correct", True)]
    assert (reward, info, errors) == (1.0, {"attempts": 3, "solved": True, "solved_first": False}, 1)
    _, reward, info, errors = asyncio.run(play(["7+5*3"]))
    assert (reward, info, errors) == (1.0, {"attempts": 1, "solved": True, "solved_first": True}, 0)
    _, reward, info, _ = asyncio.run(play(["5+7", "3+5"]))
    assert (reward, info) == (0.0, {"attempts": 2, "solved": False, "solved_first": False})


def test_a_task_without_its_problem_is_refused_at_reset():
    with pytest.raises(ValueError, match="countdown task t lacks numbers, target"):
        asyncio.run(make_environment("countdown").reset({"id": "t", "instruction": "?"}))


def test_generated_tasks_keep_the_held_out_split_and_their_references_solve_them():
    train, held_out = countdown_tasks(200, seed=3), countdown_tasks(40, seed=3, split="eval")
    problems = generate_problems(200, seed=3)
    assert [(t["numbers"], t["target"]) for t in train] == [(list(p.numbers), p.target) for p in problems]
    for tasks, split in ((train, "train"), (held_out, "eval")):
        for t in tasks:
            assert split_of(tuple(t["numbers"]), t["target"]) == split
            assert t["instruction"] == " ".join(map(str, t["numbers"])) + f" -> {t['target']}"
            assert check(t["numbers"], t["target"], *reference_turns("countdown", t)) == (True, "correct")
    assert len({t["id"] for t in train + held_out}) == 240


def test_environment_defaults_come_from_its_class():
    assert system_prompt("countdown") == SYSTEM_PROMPT
    assert system_prompt("repo") == TOOL_INSTRUCTIONS  # the repo environment's tool-call instructions
    task = {"reference": {"b.py": "y", "a.py": "x"}}
    assert [t.split('"name": "')[1][:5] for t in reference_turns("repo", task)] == ["write", "write", "submi"]
    with pytest.raises(ValueError, match="environment 'synthetic' cannot play reference solutions"):
        reference_turns("synthetic", {"reference": "1+1"})
    assert known_bad_turns("repo", {}) == [format_tool_call("submit")]
    with pytest.raises(ValueError, match="environment 'synthetic' names no known-bad candidate .*known_bad_turns"):
        known_bad_turns("synthetic", {})


def test_generator_and_environment_go_together():
    TaskConfig(type="agent", generator="countdown", environment="countdown")
    TaskConfig(type="agent", path="tasks.jsonl", environment="countdown")  # own rows in that environment
    for kwargs in ({"generator": "countdown"}, {"environment": "countdown"},
                   {"generator": "function", "environment": "countdown"}):
        with pytest.raises(ValueError, match="task.generator=.* is invalid: generated countdown tasks run in"):
            TaskConfig(type="agent", **kwargs)


def test_multi_turn_episodes_show_the_feedback_and_train_only_the_model_turns(loop):
    """Through the same multi-turn rollout as training: a wrong try, the environment's answer in
    a tool turn (masked out of the loss), then the solution; and an episode cut at max_turns."""
    tokenizer = load_tokenizer("builtin:char")
    fmt = TurnFormat(tokenizer, SYSTEM_PROMPT)
    task = {"id": "t", "instruction": "3 5 7 -> 22", "numbers": NUMBERS, "target": TARGET}
    make = lambda: make_environment("countdown")  # noqa: E731
    params = SamplingParams(max_new_tokens=16)
    limits = EpisodeLimits(max_turns=3, max_tokens=512)
    [solved] = run_episodes(ScriptedPolicy(tokenizer, ["5+7", "3*5+7"], end_of_turn=fmt.end_of_turn), [task], 1,
                            params, make, fmt, limits, loop)
    assert (solved.reward, solved.status, solved.num_turns, solved.info["attempts"]) == (1.0, "submitted", 2, 2)
    text = tokenizer.decode(solved.output_ids)
    assert text == "5+7<|im_end|>\n<|im_start|>tool\n12, too low<|im_end|>\n<|im_start|>assistant\n3*5+7<|im_end|>"
    model_text = tokenizer.decode([t for t, m in zip(solved.output_ids, solved.model_mask) if m])
    assert model_text == "5+7<|im_end|>3*5+7<|im_end|>"
    assert tokenizer.decode(solved.prompt_tokens) == fmt.prompt("3 5 7 -> 22")
    [unsolved] = run_episodes(ScriptedPolicy(tokenizer, ["5+7"] * 5, end_of_turn=fmt.end_of_turn), [task], 1,
                              params, make, fmt, limits, loop)
    assert (unsolved.reward, unsolved.status, unsolved.num_turns) == (0.0, "max_turns", 3)


def test_quality_checks_countdown_tasks_without_a_sandbox():
    """`megatron_rl.quality`'s runner on the countdown environment: a task whose reference solves
    it is solvable and rejects its known-bad answer; one whose reference does not is caught."""
    from megatron_rl.quality.runner import Runner

    good = countdown_tasks(1, seed=5)[0]
    wrong = dict(good, id="wrong", reference=CountdownEnvironment.known_bad_turns(good)[0])
    runner = Runner([], load_tokenizer("builtin:char"), environment="countdown")  # no sandbox addresses
    try:
        assert runner.verdicts(good, 2)[:2] == ([1.0, 1.0], [0.0, 0.0])
        assert runner.verdicts(wrong, 2)[0] == [0.0, 0.0]
    finally:
        runner.close()
    bad = CountdownEnvironment.known_bad_turns({"numbers": [2, 2, 5], "target": 4})  # 2+2 and 2*2 are 4
    assert bad == ["2-2"] and check([2, 2, 5], 4, bad[0]) == (False, "0, too low")


def test_an_engine_failure_mid_episode_still_closes_every_environment(loop):
    """The lockstep rollout raises what the engine raised (a disaggregated generator's stop, a
    dead engine) after closing every environment it made, so none leaves a sandbox session behind."""
    tokenizer = load_tokenizer("builtin:char")
    fmt = TurnFormat(tokenizer, SYSTEM_PROMPT)
    task = {"id": "t", "instruction": "3 5 7 -> 22", "numbers": NUMBERS, "target": TARGET}
    made: list = []

    def make():
        env = make_environment("countdown")
        close = env.close
        env.closed = False

        async def closing():
            env.closed = True
            await close()
        env.close = closing
        made.append(env)
        return env

    class FailsOnTheSecondTurn(ScriptedPolicy):
        calls = 0

        def generate(self, prompts, params):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("engine died")
            return super().generate(prompts, params)

    policy = FailsOnTheSecondTurn(tokenizer, ["5+7", "3*5+7"], end_of_turn=fmt.end_of_turn)
    with pytest.raises(RuntimeError, match="engine died"):
        run_episodes(policy, [task, task], 2, SamplingParams(max_new_tokens=16), make, fmt,
                     EpisodeLimits(max_turns=3, max_tokens=512), loop)
    assert len(made) == 4 and all(env.closed for env in made)
