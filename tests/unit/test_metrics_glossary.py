"""docs/metrics.md lists every metric name the code logs: each string literal (or f-string, its varying parts
as `<x>`) of a metric family found in megatron_rl/ must appear on the page."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FAMILIES = ("reward", "rollout", "time", "sync", "eval", "kl", "kl_reward", "filter", "audit", "critic", "sched",
            "agent", "async", "buffer", "env_pool", "dynamic_sampling", "routing", "domain", "response_length",
            "distill")
NAME = re.compile(rf"^(?:{'|'.join(FAMILIES)})/[a-z_0-9@{{}}/]*$")


def logged_names() -> set[str]:
    names = set()
    for path in (REPO / "megatron_rl").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            elif isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            else:
                continue
            if NAME.match(text) and not text.endswith("/"):
                names.add(text)
    return names


def test_every_logged_metric_is_in_the_glossary():
    page = (REPO / "docs" / "metrics.md").read_text()
    documented = {re.sub(r"<[^>]+>", "{}", m) for m in re.findall(r"`([a-z_]+/[^`]+)`", page)}
    names = logged_names()
    assert {"reward/mean", "time/step", "eval/accuracy", "sched/{}"} <= names  # the scan finds them
    missing = sorted(n for n in names if n not in documented)
    assert missing == [], f"document these in docs/metrics.md: {missing}"


def test_every_sandbox_client_metric_is_in_the_glossary():
    """The sandbox client's metrics (sandbox/client.py) are named from its per-class summary's keys."""
    import asyncio

    from megatron_rl_sandbox.client import SandboxClient

    page = (REPO / "docs" / "metrics.md").read_text()

    async def names() -> set[str]:
        async with SandboxClient(["127.0.0.1:9"], deadline_s=0.1) as client:
            client._waits["training"].calls = 1  # a class with calls is reported
            return set(await client.metrics())
    found = asyncio.run(names())
    assert "sandbox/training/wait_p95_s" in found and "sandbox/servers_up" in found
    missing = sorted(n for n in found if f"`{n.replace('/training/', '/<class>/')}`" not in page)
    assert missing == []


def test_the_summary_columns_are_the_loops():
    from megatron_rl.rl.loop import SUMMARY

    page = (REPO / "docs" / "metrics.md").read_text()
    for metric, label in SUMMARY.items():
        assert f"| `{label}` | `{metric}` |" in page
