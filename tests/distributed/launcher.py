"""Start a gloo process group for a test: processes from a fork server, a free port, one thread
per process, and a hard timeout so a hung collective fails the test.

The processes are never forks of the test process (its threads, process groups and Megatron
state would come along): they are forked by multiprocessing's fork server, a clean process that
has only imported megatron_rl's package, torch, megatron-core and transformers (`_PRELOAD`) and
initialised nothing.
Each rank then starts without paying those imports again (~8 s of CPU a rank, most of a small
distributed test's time: the fork server roughly halved this tier's time on 2 cores)."""

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
    """Run `fn(rank, world_size, *args)` in `world_size` new processes; raise on any failure.

    A rendezvous port that another process took between `free_port` and the store's bind (rare:
    the port is outside the ephemeral range, but parallel test workers draw from the same one)
    is retried on a fresh port, twice at most; any other failure is raised at once."""
    for attempt in range(3):
        try:
            return _run_once(fn, world_size, args, timeout_s)
        except mp.ProcessRaisedException as exc:
            if "EADDRINUSE" not in str(exc) or attempt == 2:
                raise


# megatron_rl first, as in every process of the product: its import hook must see megatron-core load
# (megatron_rl/parallel/megatron_import.py; without it the ranks ran torch.compile'd fusions on CPU).
_PRELOAD = ["megatron_rl", "torch", "megatron.core", "megatron.core.models.gpt", "transformers"]


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float) -> None:
    import multiprocessing

    multiprocessing.set_forkserver_preload(_PRELOAD)  # read when this process first starts the server
    ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size,
                             join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{fn.__name__} did not finish within {timeout_s}s (hung collective?)")
