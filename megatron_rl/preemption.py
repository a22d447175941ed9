"""Graceful stop on preemption: a signal asks the job to finish the current step, checkpoint
and exit 0, so that the requeued job (or the same command run again) resumes from there.

Slurm warns a job before its end with `--signal=[B:]USR1@<seconds>`; schedulers and `scancel`
send SIGTERM. Both only set a flag here; the RL loop polls `stop_agreed()` after every step,
which all-reduces the flag so that every rank stops after the same step (a signal reaches the
ranks at slightly different times), then `save_and_mark()` writes a checkpoint (unless that
step already has one) and rank 0 writes `<run_dir>/preempted.json`, which tells the batch
script (`megatron_rl.slurm_job`) to `scontrol requeue` the job.

The job's time limit is a stop too, without a signal (`JobDeadline`, checkpoint.stop_before_time_limit): rank 0
knows the job's end from `scontrol show job` and stops after the last step that leaves time for one more step
and its checkpoint (the longest step seen, the longest save seen, and a minute's slack), so a job that runs out
of time is requeued and resumes instead of being killed mid-step at its limit, which Slurm never requeues.
`--signal=B:USR1@<seconds>` stays as the backstop of a first step longer than the warning.

Until the loop calls `watch()` (e.g. while building the model) a stop signal ends the process at
once, as it would without this module. After the first one, more change nothing (Slurm sends SIGTERM
twice at the time limit, measured with Slurm 22.05, and USR1 may have come before): SIGINT (Ctrl-C)
or SIGKILL ends a stopping job at once.

The ranks' helper processes get the same signals (srun sends USR1 to every process of the step, and
Slurm ends a job with SIGTERM to all of them) but the ranks own the stop: `children_block_stop_signals`
starts helpers (SGLang's schedulers, local generators) with both signals blocked, and
`helper_defers_stop_signals` makes a helper's own process (a generator) log them and serve on until the
trainer stops it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
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
TIME_LIMIT = "TIME_LIMIT"  # the reason of a stop before the job's time limit (no signal came)


def slurm_job_end(environ: Optional[dict[str, str]] = None) -> Optional[float]:
    """The Unix time at which the Slurm job reaches its time limit: `scontrol show job`'s EndTime (a limit
    changed by `scontrol update` counts), else SLURM_JOB_END_TIME (set by Slurm 23.02 and later); None outside
    a Slurm job, without a time limit, or when neither answers."""
    env = os.environ if environ is None else environ
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    from megatron_rl.slurm_check import job_fields

    end = job_fields(job_id).get("EndTime", "")
    if re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", end):  # "Unknown" without a limit
        return time.mktime(time.strptime(end, "%Y-%m-%dT%H:%M:%S"))  # scontrol prints this node's local time
    end = env.get("SLURM_JOB_END_TIME", "")
    return float(end) if end.isdigit() and int(end) > 0 else None


class JobDeadline:
    """Whether the step just done is the last one that fits before the job's end (rank 0's view).

    The time one more step and its checkpoint need is taken from what this run measured: the longest interval
    between two calls of `near` (a step with its evaluation and periodic checkpoint; the first interval, which
    holds the start-up, counts only until a second exists), plus the longest checkpoint save seen (the longest
    interval before any), plus `slack_s` (Slurm's time-limit timer and the stop's own exit). The end is asked
    again every `refresh_s` seconds."""

    def __init__(self, end_time: Callable[[], Optional[float]], clock: Callable[[], float] = time.time,
                 slack_s: float = 60.0, refresh_s: float = 300.0) -> None:
        self.end_time, self.clock, self.slack_s, self.refresh_s = end_time, clock, slack_s, refresh_s
        self.intervals: list[float] = []
        self.last: Optional[float] = None  # the previous call's time (or start()'s)
        self._end: Optional[float] = None
        self._asked: Optional[float] = None
        self.needed = 0.0  # the last call's estimate of one more step and its checkpoint, seconds
        self.left = 0.0  # the last call's time to the end, seconds

    def start(self) -> None:
        if self.last is None:
            self.last = self.clock()

    def near(self, save_seconds: Optional[float] = None) -> bool:
        now = self.clock()
        if self.last is not None:
            self.intervals.append(now - self.last)
        self.last = now
        if self._asked is None or now - self._asked >= self.refresh_s:
            self._end, self._asked = self.end_time(), now
        if self._end is None or not self.intervals:
            return False
        step = max(self.intervals[1:] or self.intervals)
        self.needed = step + (step if save_seconds is None else save_seconds) + self.slack_s
        self.left = self._end - now
        return self.left < self.needed


class Preemption:
    """The stop flag of one rank (one instance per process, made by the runtime)."""

    def __init__(self, run_dir: Path, is_main: bool, device: Optional[torch.device] = None,
                 deadline: Optional[JobDeadline] = None) -> None:
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self.device = device
        self.deadline = deadline if is_main else None  # rank 0 decides for all (one clock, one scontrol call)
        self.received: set[int] = set()  # the kinds of stop signal that came
        self.watched = False
        self.reason = ""  # the agreed stop signal's name

    def install(self) -> "Preemption":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def watch(self) -> None:
        """From now on a stop signal is a request that `stop_agreed()` reports (and the job's time limit is
        watched: the first step's time counts from the first call)."""
        self.watched = True
        if self.deadline is not None:
            self.deadline.start()

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.watched:
            signal.signal(signum, signal.SIG_DFL)  # nobody polls: stop now
            os.kill(os.getpid(), signum)
            return
        # Logging here could interleave with a log call it interrupted. A repeat changes nothing: Slurm sends
        # SIGTERM twice at the time limit, and USR1 may precede it; the ranks are stopping already, and
        # SIGKILL follows after KillWait anyway.
        self.received.add(signum)

    def stop_agreed(self, steps_done: int, total_steps: int, what: str = "step",
                    save_seconds: Optional[float] = None) -> bool:
        """True on every rank when any rank got a stop signal, or (rank 0's `deadline`) one more step and its
        checkpoint would not end before the job's time limit, and steps remain (a collective: call it on all
        ranks after the same step); `what` the steps are, for the log; `save_seconds` the longest checkpoint
        save so far (None: none yet)."""
        from megatron_rl.parallel.dist import all_reduce_cpu_scalars

        self.watch()
        near_end = self.deadline is not None and self.deadline.near(save_seconds)
        local = [float(sig in self.received) for sig in STOP_SIGNALS] + [float(near_end)]
        counts = all_reduce_cpu_scalars(local, device=self.device)
        if not any(counts) or steps_done >= total_steps:
            return False
        # SIGTERM wins: the scheduler is ending the job; USR1 or the time limit alone ask for a requeue.
        self.reason = (signal.SIGTERM.name if counts[1] else signal.SIGUSR1.name if counts[0] else TIME_LIMIT)
        if self.reason == TIME_LIMIT:
            if self.deadline is not None:
                logger.warning("the job's time limit is %.0fs away and one more %s with its checkpoint may take "
                               "%.0fs: stopping after %s %d of %d to checkpoint; the job is requeued and resumes",
                               self.deadline.left, what, self.deadline.needed, what, steps_done, total_steps)
        else:
            logger.warning("stop requested (%s on %d rank(s)): stopping after %s %d of %d to checkpoint",
                           self.reason, int(max(counts[:2])), what, steps_done, total_steps)
        return True

    def save_and_mark(self, checkpoints: Any, steps_done: int, extra: Callable[[], dict[str, Any]],
                      metrics: Optional[dict[str, float]] = None) -> None:
        """Checkpoint after `steps_done` steps (all ranks) and record the stop for the launcher."""
        from megatron_rl.checkpoint.training import find_latest, step_dir

        latest = find_latest(checkpoints.root)
        if latest is None or latest != step_dir(checkpoints.root, steps_done):
            checkpoints.save(steps_done, extra(), metrics)
        self.mark(steps_done, checkpoints.root)

    def mark(self, steps_done: int, checkpoints: Path, warm_start_steps: Optional[int] = None) -> None:
        """Record the stop for the launcher (rank 0 writes `preempted.json`), after the checkpoint of
        `steps_done` steps was written; `warm_start_steps`: the supervised warm start's steps done when it
        was stopped (before RL step 1)."""
        if not self.is_main:
            return
        record = {"steps_done": steps_done, "signal": self.reason, "time": time.time()}
        if warm_start_steps is not None:
            record["warm_start_steps"] = warm_start_steps
        path = self.run_dir / MARKER
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
        logger.warning("checkpointed after %s and stopped; run the same command (or let Slurm requeue the job) "
                       "to resume from %s", describe_stop(record), checkpoints)


def describe_stop(record: dict[str, Any]) -> str:
    """Where a stop record (`preempted.json`) says the run stopped: "step 3", "warm-start step 40"."""
    if record.get("warm_start_steps") is not None:
        return f"warm-start step {record['warm_start_steps']}"
    return f"step {record['steps_done']}"


@contextlib.contextmanager
def children_block_stop_signals() -> Iterator[None]:
    """Processes started inside this block have SIGUSR1 and SIGTERM blocked (held pending, never acted on
    unless they unblock them: `helper_defers_stop_signals` does); this thread blocks them for the block only.

    srun forwards the stop warning (USR1) to every process of the step, not only to the ranks, and Slurm
    ends a job (time limit, scancel, preemption) with SIGTERM to every process of every step, SIGKILL
    KillWait seconds later: helper processes (SGLang's schedulers, local disaggregated generators,
    multiprocessing's resource tracker) would die of either while the ranks finish their step and
    checkpoint. The ranks own the stop and end their helpers themselves (SIGKILL).

    A blocked mask, not an ignored disposition: both survive fork and exec, but nothing is lost in this
    process. A signal that arrives during the block (SGLang's start takes minutes) is acted on by another
    thread of the process, or by this one when the block ends, as without the block; an ignored one would
    be dropped. Threads started inside the block keep the mask, so the signals reach the others.

    multiprocessing's resource tracker is started here, under the mask: when 'spawn' starts it (with the first
    process), CPython unblocks SIGINT and SIGTERM on the calling thread afterwards, and every process started
    after it in the block would have had SIGTERM unblocked."""
    from multiprocessing import resource_tracker

    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def helper_defers_stop_signals(name: str) -> None:
    """In a helper process of the ranks (a disaggregated generator): SIGUSR1 and SIGTERM are logged and
    otherwise ignored, as the trainer acts on them (it finishes its step, checkpoints, then stops this helper;
    Slurm's SIGKILL follows KillWait seconds after its SIGTERMs). SIGINT (Ctrl-C) or SIGKILL ends it at once.
    Unblocks both (`children_block_stop_signals`): one held pending since the start is taken now. Call it
    from the main thread."""
    said: queue.SimpleQueue = queue.SimpleQueue()  # put() may be called from a signal handler; logging may not

    def say() -> None:
        while True:
            logger.warning("%s got %s: the trainer stops it (after checkpointing); SIGINT or SIGKILL ends it now",
                           name, signal.Signals(said.get()).name)

    threading.Thread(target=say, name="stop-signal-log", daemon=True).start()

    def handle(signum: int, frame: Any) -> None:
        said.put(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handle)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def read_marker(run_dir: Path) -> Optional[dict[str, Any]]:
    """The stop record that `save_and_mark` left in `run_dir`, if any."""
    path = Path(run_dir) / MARKER
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
