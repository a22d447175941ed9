"""A JSONL event log of one process of a disaggregated run (`<run_dir>/timeline/<name>.jsonl`).

Trainer and generators are separate processes, so their spans are written with wall-clock
times (`time.time()`, one clock for every process on a node) and compared afterwards: the
integration test checks from these files that generation and training overlap. One line
per event: {"event": ..., "start": s, "end": s, ...}.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any


class EventLog:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._file = open(path, "a", buffering=1)  # line-buffered: readable while the run goes on

    def write(self, event: str, start: float, end: float, **fields: Any) -> None:
        with self._lock:
            self._file.write(json.dumps({"event": event, "start": start, "end": end, **fields}) + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total time during which some span of `a` and some span of `b` both run (each list's
    own spans merged first)."""
    def merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
        out: list[tuple[float, float]] = []
        for s, e in sorted(spans):
            if out and s <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], e))
            else:
                out.append((s, e))
        return out

    total = 0.0
    for s1, e1 in merged(a):
        for s2, e2 in merged(b):
            total += max(0.0, min(e1, e2) - max(s1, s2))
    return total
