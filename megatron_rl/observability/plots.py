"""Static PNG plots of `metrics.jsonl`, one figure per metric against step.

Uses matplotlib's object API with the Agg canvas (no pyplot, no global backend switch), so
it is safe in headless jobs and does not disturb an interactive session in the same process.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Union

from megatron_rl.observability.metrics import STEP_KEY, read_metrics

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]


def plot_filename(key: str) -> str:
    """PNG file name for a metric, e.g. "loss" -> "loss.png", "perf/tok/s" -> "perf_tok_s.png"."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key).strip("_") + ".png"


def plot_metrics(metrics_jsonl: PathLike, out_dir: PathLike, keys: Sequence[str]) -> list[Path]:
    """Write `<out_dir>/<key>.png` (value vs. step) for each key that has data.

    Keys that never appear with a numeric value in the file are skipped (logged at INFO).
    Returns the paths written, in the order of `keys`.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("metric plots need matplotlib: pip install matplotlib") from exc

    records = read_metrics(metrics_jsonl)
    out = Path(out_dir)
    written: list[Path] = []
    for key in keys:
        points = [
            (record[STEP_KEY], record[key])
            for record in records
            if STEP_KEY in record and isinstance(record.get(key), (int, float))
        ]
        if not any(math.isfinite(value) for _, value in points):
            logger.info("no data for metric %r in %s; skipping its plot", key, metrics_jsonl)
            continue
        steps, values = zip(*points)
        figure = Figure(figsize=(6, 4), dpi=100)
        FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        axes.plot(steps, values, marker="." if len(points) < 50 else None)
        axes.set_xlabel("step (optimizer updates done)")  # metrics.jsonl's `step`
        axes.set_ylabel(key)
        axes.set_title(key)
        axes.grid(True, alpha=0.3)
        figure.tight_layout()
        out.mkdir(parents=True, exist_ok=True)
        path = out / plot_filename(key)
        figure.savefig(path, format="png")
        written.append(path)
    return written
