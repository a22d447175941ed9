"""Process-wide logging setup: one `init_logger()` call at each entry point, rank-aware.

Rank 0 logs at `level` to the console; other ranks only log WARNING and above there, so an
N-rank job prints one copy of the progress lines but every rank's problems. With
`log_file`, every rank also writes everything at `level` to its own file. Metrics do not
go through the log; see `megatron_rl.observability.metrics`.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Optional, Union

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Marks handlers installed here, so a second init_logger() replaces them instead of
# stacking duplicates, while leaving handlers other code (e.g. pytest) installed alone.
_HANDLER_MARK = "_megatron_rl_handler"


def _format(rank: int) -> str:
    return f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s"


def init_logger(
    rank: int,
    level: str = "INFO",
    log_file: Optional[Union[str, os.PathLike]] = None,
) -> None:
    """Configure the root logger for this process.

    Args:
        rank: global rank of this process; only rank 0 logs below WARNING to the console.
        level: one of DEBUG, INFO, WARNING, ERROR, CRITICAL (case-insensitive).
        log_file: this rank's log file, e.g. `run_dir / "logs" / f"rank{rank}.log"`; its
            parent directories are created. Each rank must pass its own path.
    """
    level_name = level.upper()
    if level_name not in _LEVELS:
        raise ValueError(f"log level {level!r} is not one of {_LEVELS}")
    if rank < 0:
        raise ValueError(f"rank={rank} must be >= 0")
    numeric_level = logging.getLevelName(level_name)

    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, _HANDLER_MARK, False):
            root.removeHandler(handler)
            handler.close()

    formatter = logging.Formatter(_format(rank))
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(numeric_level if rank == 0 else max(numeric_level, logging.WARNING))
    handlers: list[logging.Handler] = [console]
    if log_file is not None:
        path = Path(log_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(path, encoding="utf-8")
        file_handler.setLevel(numeric_level)
        handlers.append(file_handler)
    for handler in handlers:
        handler.setFormatter(formatter)
        setattr(handler, _HANDLER_MARK, True)
        root.addHandler(handler)
    root.setLevel(numeric_level)
    # Route warnings.warn (e.g. from torch/megatron) through the same handlers.
    logging.captureWarnings(True)
