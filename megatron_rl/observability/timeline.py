"""A per-step timeline of what ran when (generation batches, environment waits, rewards,
training phases), written as a Chrome trace (`chrome://tracing`, https://ui.perfetto.dev)
and summarised as busy / idle fractions for the metrics.

The trace format is the Trace Event Format's complete events (`"ph": "X"`, microseconds);
writing it takes a few lines of JSON, so no tracing library is needed (torch.profiler
traces device kernels, not this application-level view).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional


class Timeline:
    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def add(self, name: str, track: str, start: float, end: float, **args: Any) -> None:
        """A span from `start` to `end` (time.perf_counter() seconds) on the row `track`."""
        with self._lock:
            self.events.append({"name": name, "track": track, "start": start, "end": end, "args": args})

    @contextlib.contextmanager
    def span(self, name: str, track: str, **args: Any) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, track, start, time.perf_counter(), **args)

    def busy(self, track: str, start: Optional[float] = None, end: Optional[float] = None) -> float:
        """Seconds the track was busy within [start, end] (overlapping spans counted once)."""
        spans = sorted((e["start"], e["end"]) for e in self.events if e["track"] == track)
        lo = self.origin if start is None else start
        hi = max((e for _, e in spans), default=lo) if end is None else end
        total, cursor = 0.0, lo
        for s, e in spans:
            s, e = max(s, cursor), min(e, hi)
            if e > s:
                total += e - s
                cursor = e
        return total

    def to_chrome_trace(self, path: Path, pid: int = 0) -> None:
        tracks = sorted({e["track"] for e in self.events})
        tid = {t: i for i, t in enumerate(tracks)}
        events = [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid[t], "args": {"name": t}} for t in tracks]
        events += [{"name": e["name"], "ph": "X", "pid": pid, "tid": tid[e["track"]],
                    "ts": (e["start"] - self.origin) * 1e6, "dur": (e["end"] - e["start"]) * 1e6, "args": e["args"]}
                   for e in self.events]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
