"""Rule-based math rewards on hostile completions: a number beyond float's range and a very
long final answer give a 0 reward quickly instead of raising or stalling the training step."""

from __future__ import annotations

import time

from megatron_rl.rewards.rule import MAX_ANSWER_CHARS, answers_match, as_number, math_reward


def test_plain_answers_still_match():
    assert math_reward("so the answer is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_reward("#### 1,234", "1234") == 1.0
    assert math_reward("I think 41", "42") == 0.0


def test_a_number_beyond_float_range_is_no_number_and_no_crash():
    huge = "1" + "0" * 400  # Fraction(huge) is exact; float() of it raises OverflowError
    assert as_number(huge) is None
    assert math_reward(f"\\boxed{{{huge}}}", "5") == 0.0
    assert math_reward(f"the answer is {huge}", "5") == 0.0
    assert math_reward(f"\\boxed{{{huge}}}", huge) == 1.0  # equal strings still match


def test_an_overlong_answer_is_not_matched_and_costs_little_time():
    # normalize()'s \frac regex backtracks quadratically: 60 KB of "\frac{" took seconds
    text = "#### " + "\\frac{" * 10_000
    start = time.process_time()  # CPU time: a loaded machine does not stretch it
    assert math_reward(text, "5") == 0.0
    assert time.process_time() - start < 0.5
    long_answer = "7" * (MAX_ANSWER_CHARS + 1)
    assert not answers_match(long_answer, long_answer)
    assert answers_match("7" * MAX_ANSWER_CHARS, "7" * MAX_ANSWER_CHARS)
