"""A generative judge's prompt and verdict (task.reward=judge): what the judging model is asked, and how its
reply becomes a reward. Pure text: the engine call is rollout/judging.py.

The prompt holds the task's prompt, the response and, with `task.judge.show_reference=true`, the row's
reference answer (task.answer_key); with `show_reference=false` the reference is nowhere in it. A custom
`task.judge.template` names its parts {prompt}, {response} and {reference} (replaced as plain text: other
braces stay as written).

Verdicts (`task.judge.verdict`):
- score: the last `score: X` (or `score = X`, any case) in the reply, 0 <= X <= max_score; reward X / max_score;
- yes_no: the reply's last word when it is `yes` or `no` (any case; the template asks to end with it), else the
  `yes` or `no` the reply says when all of them agree; reward 1 or 0. A reply that says both and does not end
  with one ("Yes, there is no error.") is no verdict, not the last one it happens to say.
A reply with no verdict, or a score outside the scale, is no verdict (`parse_verdict` returns None): the
sample is left unscored and counted, never scored 0 as if the judge had said so.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

SCORE_TEMPLATE = ("You are grading a response to a task.\n\nTask:\n{prompt}\n\nResponse:\n{response}\n\n"
                  "{reference_part}Rate how correct and helpful the response is, from 0 to {max_score}. "
                  "End your reply with a line `score: X`.")
YES_NO_TEMPLATE = ("You are grading a response to a task.\n\nTask:\n{prompt}\n\nResponse:\n{response}\n\n"
                   "{reference_part}Is the response correct? End your reply with yes or no.")
REFERENCE_PART = "Reference answer:\n{reference}\n\n"

_SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_LAST_WORD = re.compile(r"([A-Za-z]+)[^A-Za-z0-9]*\Z")


def check_template(template: Optional[str], show_reference: bool) -> None:
    """A custom template names {prompt} and {response}, and names {reference} only when it is shown;
    ValueError naming the fix."""
    if template is None:
        return
    for part in ("{prompt}", "{response}"):
        if part not in template:
            raise ValueError(f"task.judge.template has no {part}: the judge must see the prompt and the response")
    if "{reference}" in template and not show_reference:
        raise ValueError("task.judge.template names {reference} but task.judge.show_reference=false: remove it from "
                         "the template, or set task.judge.show_reference=true")


def judge_prompt(judge: Any, prompt: str, response: str, reference: Optional[str]) -> str:
    """The judge's prompt text (before any chat template) for one response; `judge`: task.judge."""
    shown = reference if judge.show_reference and reference is not None else None
    if judge.template is None:
        template = SCORE_TEMPLATE if judge.verdict == "score" else YES_NO_TEMPLATE
        part = REFERENCE_PART.replace("{reference}", shown) if shown is not None else ""
        # the response is filled in last: text it contains is never read as a placeholder
        text = template.replace("{reference_part}", part).replace("{max_score}", f"{judge.max_score:g}")
        return text.replace("{prompt}", prompt).replace("{response}", response)
    text = judge.template.replace("{reference}", shown if shown is not None else "")
    return text.replace("{prompt}", prompt).replace("{response}", response)


def parse_verdict(judge: Any, reply: str) -> Optional[float]:
    """The reward in [0, 1] the reply states (see the module docstring), or None for no verdict."""
    if judge.verdict == "score":
        found = _SCORE.findall(reply)
        if not found:
            return None
        value = float(found[-1])
        if not (math.isfinite(value) and 0 <= value <= judge.max_score):
            return None
        return value / judge.max_score
    last = _LAST_WORD.search(reply)
    if last is not None and last.group(1).lower() in ("yes", "no"):
        return 1.0 if last.group(1).lower() == "yes" else 0.0
    said = {word.lower() for word in _YES_NO.findall(reply)}
    if len(said) != 1:  # neither, or both ("Yes, no errors."): which one is the verdict cannot be told
        return None
    return 1.0 if said == {"yes"} else 0.0
