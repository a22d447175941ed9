"""Reward computation off the training thread: verifiers run on a background asyncio loop,
so rewards of finished samples are computed while other samples still generate; the RL
loop collects them (with a deadline) after generation.

Also starts a sandbox server for a local run when no address is configured.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import subprocess
import threading
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

logger = logging.getLogger(__name__)


class RewardService:
    def __init__(self, verifier_factory) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rewards", daemon=True)
        self.thread.start()
        self.verifier = asyncio.run_coroutine_threadsafe(_build(verifier_factory), self.loop).result()

    def submit(self, items: Sequence[tuple[Any, str]]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(self.verifier.score(list(items)), self.loop)

    def close(self) -> None:
        client = getattr(self.verifier, "client", None)
        if client is not None:
            asyncio.run_coroutine_threadsafe(client.close(), self.loop).result(timeout=10)
        if callable(getattr(self.verifier, "close", None)):  # e.g. a reward function's thread pool
            self.verifier.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


async def _build(factory):
    return factory()


def start_local_sandbox(run_dir: Path, runtime: str, allow_unisolated: bool, capacity: int = 2,
                        timeout_s: float = 60.0, images: Optional[Mapping[str, str]] = None
                        ) -> tuple[subprocess.Popen, str]:
    """Start a sandbox server for this run (discovery file under run_dir/sandbox/). It serves on through
    SIGTERM (Slurm's end-of-job signal reaches every process while the ranks finish their step and
    checkpoint); `stop_local_sandbox` or this process's end (SIGINT, the parent-death signal) drains it."""
    from megatron_rl_sandbox.spawn import spawn_server

    args = ["--address", "127.0.0.1:0", "--runtime", runtime, "--run-dir", str(run_dir), "--capacity", str(capacity),
            "--ignore-sigterm"]
    if allow_unisolated:
        args.append("--allow-unisolated")
    args += image_args(images or {})
    proc, info = spawn_server(args, Path(run_dir) / "logs" / "sandbox-server.log", timeout_s, die_with_parent=True)
    logger.info("local sandbox server (%s) on %s", runtime, info["address"])
    return proc, info["address"]


def image_args(images: Mapping[str, str]) -> list[str]:
    """The sandbox server's arguments for `sandbox.images` (the first is its default image)."""
    return [f"--image={name}={path}" for name, path in images.items()]


def stop_local_sandbox(proc: Optional[subprocess.Popen]) -> None:
    from megatron_rl_sandbox.spawn import stop_server

    if proc is not None:
        stop_server(proc, timeout_s=30)
