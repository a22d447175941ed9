"""Tests for the Countdown task generator and its reference scorer."""

import random

import pytest

from megatron_rl.data.countdown import (
    CountdownProblem,
    format_answer,
    format_prompt,
    generate_problems,
    score,
    split_of,
)


def _key(p: CountdownProblem):
    return tuple(sorted(p.numbers)), p.target


@pytest.fixture(scope="module")
def train():
    return generate_problems(3000, seed=0)


@pytest.fixture(scope="module")
def evals():
    return generate_problems(500, seed=0, split="eval")


def test_generated_solutions_score_one(train, evals):
    for p in train + evals:
        assert score(p, format_answer(p)) == 1.0, p


def test_problem_shape(train):
    assert len(train) == 3000
    for p in train:
        assert len(p.numbers) == 3 and all(1 <= n <= 9 for n in p.numbers)
        assert isinstance(p.target, int) and p.target >= 0
        assert len(format_prompt(p) + format_answer(p)) <= 40
        assert "\n" not in format_answer(p)


def test_determinism():
    a = generate_problems(200, seed=7)
    assert a == generate_problems(200, seed=7)
    assert a != generate_problems(200, seed=8)
    evals = generate_problems(50, seed=7, split="eval")
    assert evals == generate_problems(50, seed=7, split="eval")
    # a shorter request is a prefix of a longer one
    assert generate_problems(100, seed=7) == a[:100]


def test_train_eval_disjoint(train, evals):
    other_seeds = [p for s in range(1, 4) for p in generate_problems(1000, seed=s)]
    train_keys = {_key(p) for p in train + other_seeds}
    eval_keys = {_key(p) for p in evals}
    assert not train_keys & eval_keys
    assert all(split_of(p.numbers, p.target) == "eval" for p in evals)
    # ~10% of distinct pairs are held out (statistical, generous bounds)
    fraction = len(eval_keys) / len(train_keys | eval_keys)
    assert 0.03 < fraction < 0.2


def test_split_of_depends_only_on_sorted_numbers_and_target():
    assert split_of((3, 5, 7), 22) == split_of((7, 3, 5), 22)
    assert split_of((3, 5, 7), 22, held_out_fraction=0.0) == "train"
    assert split_of((3, 5, 7), 22, held_out_fraction=0.999999) == "eval"


def test_format():
    p = CountdownProblem(numbers=(3, 5, 7), target=22, solution="3*5+7")
    assert format_prompt(p) == "3 5 7 -> 22\n"
    assert format_answer(p) == "3*5+7"


P = CountdownProblem(numbers=(3, 5, 7), target=22, solution="3*5+7")


@pytest.mark.parametrize(
    "completion",
    [
        "3*5+7",
        "7+3*5",
        "5*3+7",
        " 3 * 5 + 7 ",
        "(3*5)+7",
        "((3)*5)+(7)",
        "3*5+7\nanything after the first line is ignored",
        "\n3*5+7\n",  # stripped before cutting at the newline
    ],
)
def test_score_correct(completion):
    assert score(P, completion) == 1.0


@pytest.mark.parametrize(
    "completion",
    [
        "3*5+5",  # reuses 5
        "3*5+7+0",  # 0 is not a given number
        "15+7",  # 15 is not a given number
        "3*5*7",  # wrong value (105)
        "22",  # not an expression over the numbers
        "7",  # single number
        "3*5+7=22",  # forbidden char
        "3/5+7",  # division not allowed
        "3**5",  # power
        "-3+5*5",  # unary minus (also reuses 5)
        "+3*5+7",  # unary plus
        "3 5 7",
        "35+7",  # concatenated digits
        "(3*5+7",  # unbalanced
        "()",
        "",
        "   ",
        "__import__('os').system('true')",
        "3*5+7 # comment",
        "0x3*5+7",
        "3*5+07",  # leading zero is a syntax error in Python 3
        "(" * 500 + "3" + ")" * 500,
        "9" * 5000,
        "3*5+7<|endoftext|>",
    ],
)
def test_score_wrong(completion):
    assert score(P, completion) == 0.0


def test_score_multiset_with_repeated_numbers():
    p = CountdownProblem(numbers=(4, 4, 2), target=18, solution="4*4+2")
    assert score(p, "4*4+2") == 1.0
    assert score(p, "4*4+2*2") == 0.0  # 2 given once
    assert score(p, "4*4*4-46") == 0.0


def test_score_negative_intermediate_is_fine():
    p = CountdownProblem(numbers=(2, 9, 8), target=1, solution="9-8")
    assert score(p, "2-9+8") == 1.0  # 2-9 = -7 on the way
    assert score(p, "9-8") == 1.0
    assert score(p, "2*(9-8)") == 0.0  # = 2


def test_score_never_raises_on_garbage():
    rng = random.Random(0)
    alphabet = "0123456789+-*() /\n\t.=abc'\"[]{}"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        assert score(P, text) in (0.0, 1.0)
    assert score(P, None) == 0.0  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num": -1, "seed": 0},
        {"num": 1, "seed": 0, "split": "test"},
        {"num": 1, "seed": 0, "held_out_fraction": 1.0},
        {"num": 1, "seed": 0, "split": "eval", "held_out_fraction": 0.0},
    ],
)
def test_generate_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        generate_problems(**kwargs)


def test_reward_function_scores_as_score_from_the_prompt_fields():
    """task.reward=megatron_rl.data.countdown:reward: the prompt's meta (numbers, target) as the sample."""
    from megatron_rl.rewards.custom import load_reward_function

    reward = load_reward_function("megatron_rl.data.countdown:reward")
    sample = {"numbers": [3, 5, 7], "target": 22}
    for completion in ("3*5+7", "7+3*5\nmore", "3*5+5", "3*5*7", "__import__('os')", ""):
        assert reward(completion, sample) == score(P, completion)
    assert reward("3*5+7", {"numbers": [3, 5, 7], "target": 23}) == 0.0
