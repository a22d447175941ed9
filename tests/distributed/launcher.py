"""Spawn a gloo process group for a test: fresh interpreters (spawn, never fork), a free
port, one thread per process, and a hard timeout so a hung collective fails the test."""

from __future__ import annotations

import os
import time
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
    """Run `fn(rank, world_size, *args)` in `world_size` spawned processes; raise on any failure.

    A rendezvous port that another process took between `free_port` and the store's bind (rare:
    the port is outside the ephemeral range, but parallel test workers draw from the same one)
    is retried on a fresh port, twice at most; any other failure is raised at once."""
    for attempt in range(3):
        try:
            return _run_once(fn, world_size, args, timeout_s)
        except mp.ProcessRaisedException as exc:
            if "EADDRINUSE" not in str(exc) or attempt == 2:
                raise


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float) -> None:
    ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{fn.__name__} did not finish within {timeout_s}s (hung collective?)")
