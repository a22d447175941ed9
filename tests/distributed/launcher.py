"""Spawn a gloo process group for a test: fresh interpreters (spawn, never fork), a free
port, one thread per process, and a hard timeout so a hung collective fails the test."""

from __future__ import annotations

import os
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from megatron_rl.parallel.dist import free_port


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    try:
        fn(rank, world_size, *args)
    except Exception:
        traceback.print_exc()
        raise


def run_spawned(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> None:
    """Run `fn(rank, world_size, *args)` in `world_size` spawned processes; raise on any failure."""
    ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size,
                             join=False, start_method="spawn")
    import time

    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{fn.__name__} did not finish within {timeout_s}s (hung collective?)")
