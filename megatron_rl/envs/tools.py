"""The agent's tool-call format, its parser and the rendering of tool results.

One tool call per model turn, in the Hermes / Qwen function-calling format that chat
models are trained on, so real checkpoints work without prompt surgery:

    <tool_call>{"name": "run", "arguments": {"command": "python3 -m unittest -q"}}</tool_call>

Tools (all act on the episode's sandbox workspace; `write`, `patch` and `read` are
idempotent, so replaying them after a sandbox failure is safe):

    run(command)              sh -c command in the workspace; exit code + truncated output
    read(path)                a file's content (truncated)
    write(path, content)      create or replace a file
    patch(path, old, new)     replace the one occurrence of `old` in a file with `new`
    test()                    run the task's visible tests
    submit()                  end the episode (then the hidden verification runs)

A turn without any `<tool_call>` is a final answer and ends the episode like `submit`. A
malformed call (a `<tool_call>` without its closing `</tool_call>`, e.g. cut by the token
limit; bad JSON, unknown tool, missing or mistyped arguments) is answered with an
error observation and the episode goes on: it is the model's mistake, counted as such,
never a crash. The JSON parsing is the standard library's; the format is small enough that
no tool-calling library would add anything here. Only the turn's first call runs: text after
its `</tool_call>`, further calls included, is ignored (one call per turn, as the
instructions say).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Optional

TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
TOOLS: dict[str, dict[str, type]] = {
    "run": {"command": str},
    "read": {"path": str},
    "write": {"path": str, "content": str},
    "patch": {"path": str, "old": str, "new": str},
    "test": {},
    "submit": {},
}
TOOL_INSTRUCTIONS = (
    "You work in a sandboxed repository. Call one tool per turn as "
    '<tool_call>{"name": NAME, "arguments": {...}}</tool_call>. Tools: run(command), read(path), '
    "write(path, content), patch(path, old, new), test(), submit(). Answer without a tool call "
    "or call submit() when done."
)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


class ToolCallError(ValueError):
    """A malformed tool call; the message is shown to the model as the observation."""


def parse_tool_call(text: str) -> Optional[ToolCall]:
    """The turn's first tool call, None for a final answer (no `<tool_call>`); ToolCallError when
    malformed or unclosed."""
    match = TOOL_CALL.search(text)
    if match is None:
        return None
    if not match.group(2):  # cut off (the token limit) or unfinished: the call may not be the intended one
        raise ToolCallError("tool call has no closing </tool_call>")
    body = match.group(1).strip()
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        raise ToolCallError(f"tool call is not valid JSON ({err.msg} at position {err.pos})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolCallError('tool call must be a JSON object with a "name" string')
    name, arguments = call["name"], call.get("arguments", {})
    if name not in TOOLS:
        raise ToolCallError(f"unknown tool {name!r}; tools: {', '.join(TOOLS)}")
    if not isinstance(arguments, dict):
        raise ToolCallError('"arguments" must be a JSON object')
    for key, kind in TOOLS[name].items():
        if not isinstance(arguments.get(key), kind):
            raise ToolCallError(f"tool {name} needs argument {key!r} ({kind.__name__})")
    unknown = sorted(set(arguments) - set(TOOLS[name]))
    if unknown:
        raise ToolCallError(f"tool {name} got unknown arguments {unknown}; it takes {sorted(TOOLS[name]) or 'none'}")
    return ToolCall(name, arguments)


def format_tool_call(name: str, **arguments: Any) -> str:
    """The text of a well-formed call (scripted policies, warm-start data, docs)."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def truncate(data: bytes | str, limit: int) -> str:
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... [{len(text) - 2 * half} characters truncated] ...\n{text[-half:]}"


def format_result(exit_code: int, stdout: bytes | str, stderr: bytes | str, limit: int, note: str = "") -> str:
    """A structured, bounded rendering of a command's outcome."""
    parts = [f"exit_code: {exit_code}" + (f" ({note})" if note else "")]
    for label, data in (("stdout", stdout), ("stderr", stderr)):
        if data:
            parts.append(f"{label}:\n{truncate(data, limit)}")
    return "\n".join(parts)
