"""Rule-based math rewards: strict extraction by default (a boxed or `####` answer, nothing else), the
last-number reading only when asked; on hostile completions a number beyond float's range and a very
long final answer give a 0 reward quickly instead of raising or stalling the training step."""

from __future__ import annotations

import time

from megatron_rl.rewards.rule import MAX_ANSWER_CHARS, answers_match, as_number, extract_answer, math_reward


def test_plain_answers_still_match():
    assert math_reward("so the answer is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_reward("#### 1,234", "1234") == 1.0
    assert math_reward("I think 41", "42") == 0.0


def test_strict_reading_ignores_numbers_that_merely_come_last():
    """The two responses that the last-number reading scored backwards: an answer that happens to end on the
    reference number, and a right sum followed by another number."""
    lucky, unlucky = "Dee has 2 eggs so he loses 1.", "5 + 9 = 14 total eggs, which also translates to 1 additional egg"
    assert math_reward(lucky, "1") == 0.0 and math_reward(lucky, "1", last_number=True) == 1.0
    assert math_reward(unlucky, "14") == 0.0 and math_reward(unlucky, "14", last_number=True) == 0.0
    assert math_reward(unlucky + " \\boxed{14}", "14") == 1.0
    assert extract_answer(lucky) == (None, None) and extract_answer(lucky, last_number=True) == ("1", "last_number")
    # an empty box (the instruction `Answer in \\boxed{}.` copied) states nothing: the last box that does counts
    assert extract_answer("The answer is \\boxed{}.") == (None, None)
    assert extract_answer("so \\boxed{7}. The answer is \\boxed{ }.") == ("7", "boxed")
    assert extract_answer("#### 3\nThe answer is \\boxed{}.") == ("3", "####")
    assert extract_answer("#### \n") == (None, None)
    # the last boxed answer wins over an earlier ####, and #### reads to the end of its line only
    assert extract_answer("#### 3\nso \\boxed{4}") == ("4", "boxed")
    assert extract_answer("#### 12\nmore text 7", last_number=True) == ("12", "####")


def test_a_number_beyond_float_range_is_no_number_and_no_crash():
    huge = "1" + "0" * 400  # Fraction(huge) is exact; float() of it raises OverflowError
    assert as_number(huge) is None
    assert math_reward(f"\\boxed{{{huge}}}", "5") == 0.0
    assert math_reward(f"the answer is {huge}", "5", last_number=True) == 0.0
    assert math_reward(f"\\boxed{{{huge}}}", huge) == 1.0  # equal strings still match


def test_an_overlong_answer_is_not_matched_and_costs_little_time():
    # normalize()'s \frac regex backtracks quadratically: 60 KB of "\frac{" took seconds
    text = "#### " + "\\frac{" * 10_000
    start = time.process_time()  # CPU time: a loaded machine does not stretch it
    assert math_reward(text, "5") == 0.0
    assert time.process_time() - start < 0.5
    text = "\\boxed{" * 20_000  # open boxes: each one tried is scanned to the end
    start = time.process_time()
    assert math_reward(text, "5") == 0.0
    assert time.process_time() - start < 0.5
    long_answer = "7" * (MAX_ANSWER_CHARS + 1)
    assert not answers_match(long_answer, long_answer)
    assert answers_match("7" * MAX_ANSWER_CHARS, "7" * MAX_ANSWER_CHARS)
