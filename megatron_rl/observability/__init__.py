"""Observability: rank-aware logging setup, metric sinks (JSONL + TensorBoard), PNG plots, the
combination of rank-local metrics over ranks (`reduce`) and the end-of-run summary (`summary`).

Importing this package is cheap; TensorBoard and matplotlib are imported only when used.
"""

from megatron_rl.observability.logging import init_logger
from megatron_rl.observability.metrics import MetricsWriter, format_step_summary, read_metrics
from megatron_rl.observability.plots import plot_metrics

__all__ = ["MetricsWriter", "format_step_summary", "init_logger", "plot_metrics", "read_metrics"]
