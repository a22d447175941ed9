"""Rule-based verifiers: extract the final answer of a completion, normalise it, compare.

Extraction is strict by default: the last `\\boxed{...}` (balanced braces) that is not empty, else the
text after the last `####` (to the end of its line) if any. A completion with neither has no answer and
scores 0. With `last_number=True` (`task.answer_extraction=last_number`) such a completion is scored by
the last number in its text instead, a lenient reading that also rewards a number that merely happens
to come last ("Dee has 2 eggs so he loses 1." reads as 1); the verifier counts how many answers were
read that way (`reward/last_number_answers`). Normalisation drops `$`, spaces, thousands
separators and a trailing period, and turns `a/b` and decimals into numbers; two answers
match when both are numbers within `tol` (relative, with an absolute floor) or the strings
are equal. A predicted answer longer than `MAX_ANSWER_CHARS` never matches: no reference
answer is that long, and normalising such text costs time quadratic in its length.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
MAX_ANSWER_CHARS = 512
MAX_BOXES_TRIED = 8


def _last_boxed(text: str) -> Optional[str]:
    """The content of the last `\\boxed{...}` (balanced braces) that holds something: an empty box, as a
    model copying the instruction `Answer in \\boxed{}.` writes it, states no answer. Only the last
    `MAX_BOXES_TRIED` boxes are tried (each is scanned to its closing brace: a text of thousands of open
    boxes would take quadratic time)."""
    end = len(text)
    for _ in range(MAX_BOXES_TRIED):
        start = text.rfind("\\boxed{", 0, end)
        if start < 0:
            break
        i, depth = start + len("\\boxed{"), 1
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                if text[i:j].strip():
                    return text[i:j]
                break
        end = start
    return None


def extract_answer(text: str, last_number: bool = False) -> tuple[Optional[str], Optional[str]]:
    """(the final answer, how it was found: "boxed", "####" or "last_number"); (None, None) when the
    text states none (and, with `last_number`, holds no number either)."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    if "####" in text:
        answer = text.rsplit("####", 1)[1].strip().split("\n", 1)[0]
        if answer:
            return answer, "####"
    if last_number:
        numbers = _NUMBER.findall(text.replace(",", ""))
        if numbers:
            return numbers[-1], "last_number"
    return None, None


def normalize(answer: str) -> str:
    answer = answer.strip().replace("$", "").replace(" ", "").replace("\\!", "")
    answer = re.sub(r"(?<=\d),(?=\d{3})", "", answer)
    answer = re.sub(r"\\(?:text|mathrm)\{([^}]*)\}", r"\1", answer)
    answer = re.sub(r"\\[dt]?frac\{([^}]*)\}\{([^}]*)\}", r"\1/\2", answer)
    return answer.rstrip(".")


def as_number(answer: str) -> Optional[float]:
    if not re.fullmatch(r"-?\d+(?:\.\d+)?(?:/-?\d+)?", answer):
        return None
    try:
        return float(Fraction(answer))
    except (ValueError, ZeroDivisionError, OverflowError):  # OverflowError: beyond float's range
        return None


def answers_match(predicted: str, reference: str, tol: float = 1e-6) -> bool:
    if len(predicted) > MAX_ANSWER_CHARS:
        return False
    p, r = normalize(predicted), normalize(reference)
    pn, rn = as_number(p), as_number(r)
    if pn is not None and rn is not None:
        return abs(pn - rn) <= tol * max(1.0, abs(rn))
    return p == r


def score_answer(completion: str, reference: str, tol: float = 1e-6,
                 last_number: bool = False) -> tuple[float, Optional[str]]:
    """(1.0 when the completion's final answer, strict or with the last-number fallback, matches the reference
    answer, else 0.0; how the answer was found, as `extract_answer` says)."""
    predicted, how = extract_answer(completion, last_number)
    return (1.0 if predicted is not None and answers_match(predicted, reference, tol) else 0.0), how


def math_reward(completion: str, reference: str, tol: float = 1e-6, last_number: bool = False) -> float:
    """1.0 when the completion's final answer (strict, or with the last-number fallback) matches the
    reference answer, else 0.0."""
    return score_answer(completion, reference, tol, last_number)[0]


def exact_match(completion: str, reference: str) -> float:
    return 1.0 if completion.strip() == reference.strip() else 0.0
