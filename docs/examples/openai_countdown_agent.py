"""A black-box agent for task.agent_command: a plain script against the OpenAI API, as any agent framework's would
be, run once per episode by megatron-rl (docs/agents.md, "Black-box agents").

It plays a Countdown task in up to 3 turns. The model may call the `evaluate` tool (an arithmetic expression ->
its value), which this script runs and answers; an answer without a tool call is judged and told back. Reward:
1 when an answer reaches the target, else the share of the last answer's characters that belong to an
expression over + - * ( ) and digits (a formatting signal a small model can climb). The reward is the last stdout
line, as JSON, with `solved` beside it (logged as agent/env/solved).

    task.agent_command=[python,docs/examples/openai_countdown_agent.py]
"""

import ast
import json
import os

from openai import OpenAI

ALLOWED = set("0123456789+-*() ")
TOOLS = [{"type": "function", "function": {
    "name": "evaluate", "description": "The value of an arithmetic expression over + - * and integers.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def value(expression: str):
    """The expression's value, or None: only integers, + - * and parentheses (an ast walk, never eval)."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        return None

    def walk(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            left, right = walk(node.left), walk(node.right)
            if left is None or right is None:
                return None
            return left + right if isinstance(node.op, ast.Add) else (
                left - right if isinstance(node.op, ast.Sub) else left * right)
        return None
    return walk(tree.body) if len(expression) < 64 else None


def main() -> None:
    task = json.loads(os.environ["MEGATRON_RL_TASK"])
    client = OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"],
                    default_headers={"X-Episode-Id": os.environ["MEGATRON_RL_EPISODE_ID"]}, max_retries=0)
    messages = [{"role": "user", "content": task["instruction"]}]
    reward, solved = 0.0, False
    for _ in range(3):
        reply = client.chat.completions.create(model=os.environ["MEGATRON_RL_MODEL"], messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:  # run the tools the model asked for and show it their results
            for call in message.tool_calls:
                expression = json.loads(call.function.arguments).get("expression", "")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(value(str(expression)))})
            continue
        answer = (message.content or "").strip()
        got = value(answer)
        solved = got == task["target"]
        reward = 1.0 if solved else sum(c in ALLOWED for c in answer) / max(len(answer), 1)
        if solved:
            break
        messages.append({"role": "user", "content": "invalid" if got is None else f"{got}, try again"})
    print(json.dumps({"reward": reward, "solved": float(solved)}))


if __name__ == "__main__":
    main()
