"""Graceful stop on preemption: a signal asks the job to finish the current step, checkpoint
and exit 0, so that the requeued job (or the same command run again) resumes from there.

Slurm warns a job before its end with `--signal=[B:]USR1@<seconds>`; schedulers and `scancel`
send SIGTERM. Both only set a flag here; the RL loop polls `stop_agreed()` after every step,
which all-reduces the flag so that every rank stops after the same step (a signal reaches the
ranks at slightly different times), then `save_and_mark()` writes a checkpoint (unless that
step already has one) and rank 0 writes `<run_dir>/preempted.json`, which tells the batch
script (`megatron_rl.slurm_job`) to `scontrol requeue` the job.

Until the loop calls `watch()` (e.g. while building the model), and for a second signal, the
signal keeps its default action: the process ends at once, as it would without this module.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
MARKER = "preempted.json"


class Preemption:
    """The stop flag of one rank (one instance per process, made by the runtime)."""

    def __init__(self, run_dir: Path, is_main: bool, device: Optional[torch.device] = None) -> None:
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self.device = device
        self.signum: Optional[int] = None
        self.watched = False
        self.reason = ""  # the agreed stop signal's name

    def install(self) -> "Preemption":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def watch(self) -> None:
        """From now on a stop signal is a request that `stop_agreed()` reports."""
        self.watched = True

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.watched or self.signum is not None:
            signal.signal(signum, signal.SIG_DFL)  # nobody polls, or asked twice: stop now
            os.kill(os.getpid(), signum)
            return
        self.signum = signum  # logging here could interleave with a log call it interrupted

    def stop_agreed(self, steps_done: int, total_steps: int) -> bool:
        """True on every rank when any rank got a stop signal and steps remain (a collective:
        call it on all ranks after the same step)."""
        from megatron_rl.parallel.dist import all_reduce_cpu_scalars

        self.watch()
        local = [float(self.signum == sig) for sig in STOP_SIGNALS]
        counts = all_reduce_cpu_scalars(local, device=self.device)
        if not any(counts) or steps_done >= total_steps:
            return False
        # SIGTERM wins: the scheduler is ending the job; USR1 alone asks for a requeue.
        self.reason = signal.SIGTERM.name if counts[1] else signal.SIGUSR1.name
        logger.warning("stop requested (%s on %d rank(s)): stopping after step %d of %d to checkpoint",
                       self.reason, int(max(counts)), steps_done, total_steps)
        return True

    def save_and_mark(self, checkpoints: Any, steps_done: int, extra: Callable[[], dict[str, Any]],
                      metrics: Optional[dict[str, float]] = None) -> None:
        """Checkpoint after `steps_done` steps (all ranks) and record the stop for the launcher."""
        from megatron_rl.checkpoint.training import find_latest, step_dir

        latest = find_latest(checkpoints.root)
        if latest is None or latest != step_dir(checkpoints.root, steps_done):
            checkpoints.save(steps_done, extra(), metrics)
        if self.is_main:
            path = self.run_dir / MARKER
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"steps_done": steps_done, "signal": self.reason, "time": time.time()}))
            os.replace(tmp, path)
            logger.warning("checkpointed after step %d and stopped; run the same command (or let Slurm "
                           "requeue the job) to resume from %s", steps_done, checkpoints.root)


@contextlib.contextmanager
def children_ignore_usr1() -> Iterator[None]:
    """Processes started inside this block ignore SIGUSR1; this one gets its handler back after it.

    srun forwards the stop signal to every process of the step, not only to the ranks: helper processes
    (SGLang's schedulers, local disaggregated generators, multiprocessing's resource tracker) would die
    of it (USR1's default action) while the ranks checkpoint. An ignored signal stays ignored across
    fork and exec; a handled one is reset at exec (multiprocessing's 'spawn' and SGLang's schedulers exec).
    The ranks own the stop and end their helpers themselves. Off the main thread (where signals cannot be
    set), or with a handler installed outside Python (which could not be restored), the block changes nothing."""
    before = signal.getsignal(signal.SIGUSR1) if threading.current_thread() is threading.main_thread() else None
    if before is None:
        yield
        return
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, before)


def read_marker(run_dir: Path) -> Optional[dict[str, Any]]:
    """The stop record that `save_and_mark` left in `run_dir`, if any."""
    path = Path(run_dir) / MARKER
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
