"""Training metrics sinks: a JSONL file (always), TensorBoard scalars and Weights & Biases
(each optional).

`run_dir/metrics.jsonl` holds one JSON object per logged step, `{"step": int, <name>: float,
...}`, flushed line by line so a killed job loses at most the line being written. The entry
points log `step` = the optimizer updates done when the row is written: 0 for the evaluation
before any update, k for the k-th update's row (and the evaluation after it), as in their log
lines and in the name of the checkpoint written after it (`step_<k>`). It is the source of truth
for plots (`megatron_rl.observability.plots`) and for tests; TensorBoard under
`run_dir/tensorboard/` is a view of the same numbers, at the same steps. Only rank 0 writes; on
other ranks `MetricsWriter` is a no-op so callers need no rank checks. Reducing metrics across
ranks is the caller's job (`megatron_rl.observability.reduce`).

W&B (`logging.wandb=true`): one W&B run per run directory (its id is kept in
`run_dir/wandb_run_id`, so a resumed or requeued job continues the same W&B run); offline
clusters set `WANDB_MODE=offline` and `wandb sync` later. W&B keeps the first value logged
for a step, so steps recomputed after a resume keep their pre-crash values there (the JSONL
and TensorBoard are rewound).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, TextIO, Union

logger = logging.getLogger(__name__)

METRICS_FILENAME = "metrics.jsonl"
TENSORBOARD_DIRNAME = "tensorboard"
STEP_KEY = "step"

PathLike = Union[str, os.PathLike]


class MetricsWriter:
    """Append per-step scalar metrics to `run_dir/metrics.jsonl` and, optionally, TensorBoard.

    Args:
        run_dir: run directory; created on rank 0 if missing. An existing `metrics.jsonl`
            is appended to, so a resumed run continues the same file.
        enabled_tensorboard: also write TensorBoard scalars to `run_dir/tensorboard/`.
        rank: global rank; every rank other than 0 writes nothing.
        wandb_init: keyword arguments of `wandb.init` (project, entity, name, config) to also
            log to Weights & Biases; None: no W&B.
    """

    def __init__(self, run_dir: PathLike, enabled_tensorboard: bool, rank: int,
                 wandb_init: Optional[Mapping[str, Any]] = None) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.enabled = rank == 0
        self._file: Optional[TextIO] = None
        self._tb_writer: Any = None  # torch.utils.tensorboard.SummaryWriter, imported lazily
        self._wandb: Any = None  # a wandb Run, imported lazily
        self._wandb_next_step = 0  # W&B refuses steps below the ones it has (e.g. after a resume)
        if not self.enabled:
            return
        if enabled_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ImportError(
                    "TensorBoard metrics need tensorboard: pip install tensorboard "
                    "(or disable TensorBoard in the config)"
                ) from exc
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.run_dir / METRICS_FILENAME, "a", encoding="utf-8")
        if enabled_tensorboard:
            self._tb_writer = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIRNAME))
        if wandb_init is not None:
            self._wandb = _start_wandb(self.run_dir, wandb_init)
            self._wandb_next_step = int(getattr(self._wandb, "step", 0) or 0)
        logger.info(
            "metrics -> %s%s",
            self.run_dir / METRICS_FILENAME,
            f" and {self.run_dir / TENSORBOARD_DIRNAME}" if enabled_tensorboard else "",
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record `metrics` for `step`. Values may be Python/NumPy numbers or 0-d tensors."""
        if not self.enabled:
            return
        if self._file is None:
            raise RuntimeError("MetricsWriter.log() called after close()")
        if STEP_KEY in metrics:
            raise ValueError(f"metric name {STEP_KEY!r} is reserved; pass the step as `step`")
        values: dict[str, float] = {}
        for name, value in metrics.items():
            try:
                values[name] = float(value)
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"metric {name!r}={value!r} is not a scalar number; log floats or 0-d tensors"
                ) from exc
        record = {STEP_KEY: int(step), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb_writer is not None:
            for name, value in values.items():
                self._tb_writer.add_scalar(name, value, global_step=int(step))
        if self._wandb is not None and int(step) >= self._wandb_next_step:
            self._wandb.log(values, step=int(step), commit=True)
            self._wandb_next_step = int(step) + 1

    def rewind(self, step: int) -> None:
        """Forget records at `step` and later (a resumed run recomputes them): rewrite
        metrics.jsonl without them and reopen TensorBoard with `purge_step`."""
        if not self.enabled or self._file is None:
            return
        self._file.close()
        path = self.run_dir / METRICS_FILENAME
        kept = [line for line in path.read_text(encoding="utf-8").splitlines() if _step_of(line) < step]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)
        self._file = open(path, "a", encoding="utf-8")
        if self._tb_writer is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb_writer.close()
            self._tb_writer = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIRNAME), purge_step=step)

    def close(self) -> None:
        """Flush and close the sinks; safe to call more than once."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb_writer is not None:
            self._tb_writer.close()
            self._tb_writer = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def _start_wandb(run_dir: Path, init: Mapping[str, Any]) -> Any:
    try:
        import wandb
    except ImportError as exc:
        raise ImportError("logging.wandb=true needs wandb: pip install -e '.[wandb]' (or logging.wandb=false)") from exc
    id_file = run_dir / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(8)
    id_file.write_text(run_id + "\n")
    return wandb.init(dir=str(run_dir), id=run_id, resume="allow", **dict(init))


def read_metrics(path: PathLike) -> list[dict[str, float]]:
    """Read a `metrics.jsonl` file (or a run dir containing one) into a list of records.

    A truncated last line, as left by a killed job, is skipped with a warning; a malformed
    line anywhere else raises ValueError.
    """
    file = Path(path)
    if file.is_dir():
        file = file / METRICS_FILENAME
    if not file.is_file():
        raise ValueError(f"metrics file {str(file)!r} does not exist")
    lines = file.read_text(encoding="utf-8").splitlines()
    records: list[dict[str, float]] = []
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if line_number == len(lines):
                logger.warning("skipping truncated last line %d of %s", line_number, file)
                continue
            raise ValueError(f"{file}:{line_number} is not valid JSON: {exc}") from exc
        if not isinstance(record, dict):
            raise ValueError(f"{file}:{line_number} is not a JSON object")
        records.append(record)
    return records


def _format_value(value: float) -> str:
    if math.isnan(value) or math.isinf(value):
        return str(value)
    magnitude = abs(value)
    for divisor, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if magnitude >= divisor:
            return f"{value / divisor:.1f}{suffix}"
    if value != 0 and magnitude < 0.01:
        return f"{value:.1e}"
    return f"{value:.4g}"


def format_step_summary(
    step: int, metrics: Mapping[str, float], keys: Union[Sequence[str], Mapping[str, str]]
) -> str:
    """One human-readable line, e.g. `step 12 | loss 1.234 | lr 1.0e-03 | tok/s 5.2k | 0.53s`.

    Args:
        step: the step number.
        metrics: name -> value; keys absent from it are left out of the line.
        keys: the metric names to show, in order; or a mapping name -> display label.

    Formatting: values >= 1000 get an SI suffix (5200 -> "5.2k"), nonzero values below 0.01
    use scientific notation (0.001 -> "1.0e-03"), others 4 significant digits. Names ending
    in "time_s" (seconds, e.g. "step_time_s") are shown as "0.53s" without a label.
    """
    labels = dict(keys) if isinstance(keys, Mapping) else {key: key for key in keys}
    parts = [f"step {step}"]
    for key, label in labels.items():
        if key not in metrics:
            continue
        value = float(metrics[key])
        if key.endswith("time_s"):
            parts.append(f"{value:.2f}s")
        else:
            parts.append(f"{label} {_format_value(value)}")
    return " | ".join(parts)


def _step_of(line: str) -> float:
    """The step of a metrics.jsonl line; infinity (dropped by any rewind) for a blank or cut line,
    e.g. the last one of a job killed while writing it."""
    try:
        return json.loads(line).get(STEP_KEY, -1) if line.strip() else float("inf")
    except ValueError:
        return float("inf")
