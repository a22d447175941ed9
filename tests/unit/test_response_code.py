"""The candidate file of a code task is the response's code, not its prose (rewards/sandboxed.py)."""

from __future__ import annotations

from megatron_rl.rewards.sandboxed import response_code

CODE = "def f(x):\n    return x + 1\n"


def test_bare_code_is_the_candidate_as_it_is():
    assert response_code(CODE) == CODE
    assert response_code("print('no fences')") == "print('no fences')"


def test_the_last_python_block_is_the_candidate():
    chatty = f"First try:\n```python\ndef f(x):\n    return x\n```\nFixed:\n```python\n{CODE}```\nDone."
    assert response_code(chatty) == CODE
    assert response_code(f"```\n{CODE}```") == CODE  # a block of no language
    assert response_code(f"```py\n{CODE}```") == CODE


def test_thinking_is_not_read_and_other_languages_are_not_python():
    assert response_code(f"<think>```python\nwrong = 1\n```</think>\n```python\n{CODE}```") == CODE
    thought_only = "<think>```python\nwrong = 1\n```</think>no code here"
    assert response_code(thought_only) == "no code here"
    shell = "```bash\npip install x\n```"
    assert response_code(shell) == shell  # no python block: the whole text, which fails the tests as it should
