"""Countdown arithmetic task: problem generation, prompt/answer formatting, reference scoring.

A problem is three numbers from 1..9 (repeats allowed) and a non-negative integer target.
A solution is an expression over 2 or 3 of the numbers, each used at most once, with
`+ - *` and parentheses, that evaluates to the target. Division and unary minus are not
part of the task.

Train/eval split: each distinct `(sorted numbers, target)` pair is assigned to "eval" iff a
SHA-256 hash of the pair falls below `held_out_fraction`. The assignment depends only on the
pair (not on the seed), so no seed of the train split ever produces an eval pair.

`score` is the reference reward checker. It parses with `ast` and walks an allow-list of
node types; it never calls `eval`. It is not a sandbox: untrusted code execution belongs to
the sandbox module, which should agree with this function.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import random
import re
from collections import Counter
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)

NUM_NUMBERS = 3
MIN_NUMBER = 1
MAX_NUMBER = 9
MIN_NUMBERS_USED = 2
SPLITS = ("train", "eval")

_OPERATORS: dict[type, str] = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*"}
_ALLOWED_ANSWER = re.compile(r"[0-9+\-*() ]+")
# Longest sensible answer is ~15 chars ("(9 - 8) * (7+6)" style); the cap keeps ast.parse
# away from pathological nesting on garbage completions.
_MAX_ANSWER_CHARS = 64
# Generation retries before giving up; the eval split needs ~1/held_out_fraction draws
# per accepted problem.
_MAX_DRAWS_PER_PROBLEM = 100_000


@dataclass(frozen=True)
class CountdownProblem:
    """One Countdown problem.

    Attributes:
        numbers: the available numbers, in presentation order (length 3, each 1..9).
        target: the value the expression must reach (non-negative).
        solution: one reference expression, e.g. "(3+5)*7"; other solutions may exist.
    """

    numbers: tuple[int, ...]
    target: int
    solution: str


def split_of(numbers: tuple[int, ...], target: int, held_out_fraction: float = 0.1) -> str:
    """Return "eval" or "train" for a problem, from a hash of (sorted numbers, target)."""
    key = ",".join(str(n) for n in sorted(numbers)) + f"|{target}"
    digest = hashlib.sha256(key.encode("ascii")).digest()
    unit = int.from_bytes(digest[:8], "big") / 2**64
    return "eval" if unit < held_out_fraction else "train"


def _random_expression(rng: random.Random, numbers: tuple[int, ...]) -> ast.expr:
    """A random expression tree over 2 or 3 distinct positions of `numbers`."""
    num_used = rng.randint(MIN_NUMBERS_USED, len(numbers))
    operands: list[ast.expr] = [ast.Constant(n) for n in rng.sample(numbers, num_used)]
    # Repeatedly combine two adjacent operands: covers both (a o b) o c and a o (b o c).
    while len(operands) > 1:
        i = rng.randrange(len(operands) - 1)
        op = rng.choice(list(_OPERATORS))()
        operands[i:i + 2] = [ast.BinOp(left=operands[i], op=op, right=operands[i + 1])]
    return operands[0]


def _evaluate(node: ast.AST) -> int:
    """Evaluate an allow-listed arithmetic tree; ValueError on any other node."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        return left * right
    raise ValueError(f"disallowed expression node {type(node).__name__}")


def _constants(node: ast.AST) -> list[int]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)]


def generate_problems(
    num: int, seed: int, split: str = "train", held_out_fraction: float = 0.1
) -> list[CountdownProblem]:
    """Generate `num` problems of one split, deterministically for a given `seed`.

    Problems are drawn i.i.d. (numbers uniform in 1..9, then a random valid expression whose
    value is the target) and kept if their `(sorted numbers, target)` pair belongs to
    `split`; repeats of a pair are possible, as with any i.i.d. sample.

    Args:
        num: number of problems to return (>= 0).
        seed: RNG seed; the same arguments always give the same list.
        split: "train" or "eval".
        held_out_fraction: share of distinct pairs reserved for "eval", in [0, 1). Use the
            same value for both splits or they are not disjoint.
    """
    if num < 0:
        raise ValueError(f"num={num} must be >= 0")
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    if not 0.0 <= held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction={held_out_fraction} must be in [0, 1)")
    if split == "eval" and held_out_fraction == 0.0:
        raise ValueError("split='eval' needs held_out_fraction > 0 (e.g. 0.1)")

    rng = random.Random(seed)
    problems: list[CountdownProblem] = []
    max_draws = max(num, 1) * _MAX_DRAWS_PER_PROBLEM
    for _ in range(max_draws):
        if len(problems) == num:
            break
        numbers = tuple(rng.randint(MIN_NUMBER, MAX_NUMBER) for _ in range(NUM_NUMBERS))
        tree = _random_expression(rng, numbers)
        target = _evaluate(tree)
        if target < 0 or split_of(numbers, target, held_out_fraction) != split:
            continue
        # ast.unparse inserts exactly the parentheses precedence needs; drop its spaces.
        solution = ast.unparse(tree).replace(" ", "")
        problems.append(CountdownProblem(numbers=numbers, target=target, solution=solution))
    if len(problems) < num:
        raise ValueError(
            f"only found {len(problems)} of {num} {split!r} problems in {max_draws} draws; "
            f"raise held_out_fraction={held_out_fraction}"
        )
    logger.debug("generated %d %s countdown problems (seed=%d)", num, split, seed)
    return problems


def format_prompt(problem: CountdownProblem) -> str:
    """Prompt text, e.g. "3 5 7 -> 22\\n"; the model continues with the expression."""
    return " ".join(str(n) for n in problem.numbers) + f" -> {problem.target}\n"


def format_answer(problem: CountdownProblem) -> str:
    """Reference completion, e.g. "3*5+7" (no terminator; the trainer appends eos)."""
    return problem.solution


def score(problem: CountdownProblem, completion: str) -> float:
    """Reference reward: 1.0 if `completion` solves `problem`, else 0.0. Never raises.

    The completion is stripped and cut at its first newline; a non-str scores 0. It is
    correct iff it contains only `0-9 + - * ( ) space`, parses as an expression of binary
    `+ - *` over integer literals, uses 2 or 3 literals that form a sub-multiset of
    `problem.numbers` (each number at most as often as it is given, no concatenated
    digits), and equals the target. Decode completions with `skip_special_tokens=True`:
    a trailing "<|endoftext|>" in the text scores 0.
    """
    value, _ = judge(problem, completion)
    return 1.0 if value is not None and value == problem.target else 0.0


def reward(completion: str, sample: dict) -> float:
    """`score` as a reward function (`task.reward=megatron_rl.data.countdown:reward`, rewards/custom.py): the
    reference checker in the trainer's process instead of the sandbox verifier. It parses the expression
    (`ast`, + - * over integer literals) and runs none of the model's output, so it needs no sandbox; the
    sandbox verifier (the default, `task.reward=auto`) gives the same verdicts and is the path a code task
    takes. `sample`: the problem's fields, numbers and target."""
    return score(CountdownProblem(tuple(sample["numbers"]), int(sample["target"]), ""), completion)


def judge(problem: CountdownProblem, completion: str) -> tuple[Optional[int], str]:
    """(its value, "") when `completion` is a well-formed answer to `problem` (every condition of
    `score` but reaching the target), else (None, what is wrong with it). Never raises."""
    if not isinstance(completion, str):
        return None, "not text"
    answer = completion.strip().split("\n", 1)[0].strip()
    if len(answer) > _MAX_ANSWER_CHARS or not _ALLOWED_ANSWER.fullmatch(answer):
        return None, "not an expression of + - * over the numbers"
    try:
        tree = ast.parse(answer, mode="eval")
        value = _evaluate(tree)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None, "not an expression of + - * over the numbers"
    used, given = Counter(_constants(tree)), Counter(problem.numbers)
    if sum(used.values()) < MIN_NUMBERS_USED:
        return None, f"use at least {MIN_NUMBERS_USED} numbers"
    for number in used:
        if used[number] > given[number]:
            return None, f"{number} is not given" if not given[number] else f"{number} used too often"
    return value, ""
