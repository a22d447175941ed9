"""The batch step of `sbatch slurm/run.sh`: one training run inside one Slurm allocation.

    python -m megatron_rl.slurm_job run [--no-sandbox] -- <hydra overrides>    (the batch step)
    python -m megatron_rl.slurm_job sandbox --run-dir D --runtime bwrap ...     (one per sandbox node)
    python -m megatron_rl.disagg.generator --run-dir D                         (one per generator GPU)

`run` validates the config once, makes the run directory (keyed by the job id, so that a
requeued job finds its checkpoints), starts one sandbox server per node of the CPU component
of a heterogeneous job (`--het-group=1`), or, without one, per GPU node as an `--overlap` step
sharing the job's CPUs there; waits until each has written its discovery file under
`<run_dir>/sandbox/`; with `rollout.mode=disaggregated rollout.generator_nodes=N` it starts the
generator step on the last N nodes of the GPU component (rollout.num_generators / N tasks per
node; they connect to trainer rank 0 through `<run_dir>/disagg/hub.json`) and trains on the
others; then runs the SPMD training step (`srun --kill-on-bad-exit=1`) and
  - forwards SIGUSR1 (Slurm's `--signal=B:USR1@<s>` warning goes to the batch step) to the
    ranks, which finish the step, checkpoint, write `preempted.json` and exit 0; the job then
    `scontrol requeue`s itself and the next start resumes from that checkpoint;
  - when a rank dies, names the rank that failed first (from srun's own error line) and the
    last lines of its log, and exits with srun's status.

Why Python inside the package and not shell in launch/: waiting on two steps while forwarding
signals, parsing srun's failure lines and polling server health are easier to get right (and
to unit-test) here; `python -m` runs it with the job's interpreter on every node without
setting PYTHONPATH. launch/slurm_job.sh and slurm/*.sh stay thin shell around it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

from megatron_rl.parallel.dist import expand_nodelist, free_port
from megatron_rl.preemption import MARKER, TIME_LIMIT, describe_stop, read_marker
from megatron_rl.runtime import log_tail
from megatron_rl.slurm_check import job_fields, minutes

logger = logging.getLogger("megatron_rl.slurm_job")
STOP_FILE = "STOP"  # under <run_dir>/sandbox/: asks the sandbox step to drain and exit (srun would SIGKILL it)
SRUN_ERROR = re.compile(r"^srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,\-]+): (?P<reason>.+)$")


@dataclasses.dataclass(frozen=True)
class JobLayout:
    """Which nodes of the allocation train, generate (disaggregated mode) and serve sandboxes."""

    job_id: str
    job_name: str
    restart_count: int
    het: bool
    train_nodes: tuple[str, ...]
    sandbox_nodes: tuple[str, ...]
    num_train_tasks: int
    generator_nodes: tuple[str, ...] = ()

    def roles(self) -> dict[str, tuple[str, ...]]:
        """node -> its roles ("train", "generate", "sandbox")."""
        named = (("train", self.train_nodes), ("generate", self.generator_nodes), ("sandbox", self.sandbox_nodes))
        out: dict[str, tuple[str, ...]] = {}
        for node in (*self.train_nodes, *self.generator_nodes, *self.sandbox_nodes):
            out[node] = tuple(r for r, nodes in named if node in nodes)
        return out

    def with_generator_nodes(self, num: int) -> "JobLayout":
        """The last `num` nodes of the GPU component generate, the others train (raises ValueError
        when that leaves no node to train on or the GPU component's tasks are uneven over its nodes)."""
        if num == 0:
            return self
        nodes = self.train_nodes
        if num >= len(nodes):
            raise ValueError(f"rollout.generator_nodes={num} leaves no node to train on: the job's GPU component "
                             f"has {len(nodes)} node(s); ask for more nodes (--nodes) or fewer generator nodes")
        if self.num_train_tasks % len(nodes):
            raise ValueError(f"rollout.generator_nodes={num} needs the same number of tasks on every node "
                             f"(--ntasks-per-node); the GPU component has {self.num_train_tasks} tasks on "
                             f"{len(nodes)} nodes")
        per_node = self.num_train_tasks // len(nodes)
        sandbox = self.sandbox_nodes if self.het else nodes
        return dataclasses.replace(self, train_nodes=nodes[:-num], generator_nodes=nodes[-num:],
                                   sandbox_nodes=sandbox, num_train_tasks=per_node * (len(nodes) - num))


def _per_node(counts: str, what: str) -> list[tuple[int, int]]:
    """A Slurm per-node string (`2(x3),1`) as (count, nodes) pairs; ValueError naming `what` otherwise."""
    pairs = []
    for part in counts.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"cannot parse Slurm {what} {counts!r}")
        pairs.append((int(match.group(1)), int(match.group(2) or 1)))
    return pairs


def count_tasks(tasks_per_node: str) -> int:
    """Total of a Slurm tasks-per-node string: `2(x3),1` -> 7."""
    return sum(count * nodes for count, nodes in _per_node(tasks_per_node, "tasks-per-node"))


def idle_gpus(layout: JobLayout, cfg, environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """Why GPUs of the allocation would sit idle, or None: colocated, every rank takes one GPU of its node, so
    `--gpus-per-node=8 --ntasks-per-node=4` leaves four GPUs per node unused without a word (the reverse
    mismatch fails at once, two ranks on one GPU). Disaggregated runs give spare GPUs to local generators."""
    if cfg.rollout.mode == "disaggregated" or not layout.train_nodes:
        return None
    gpus = environ.get("SLURM_GPUS_PER_NODE" + ("_HET_GROUP_0" if layout.het else ""), "")
    match = re.fullmatch(r"(?:[^:,]+:)?(\d+)", gpus.strip())
    nodes = len(layout.train_nodes)
    if match is None or layout.num_train_tasks % nodes:
        return None
    per_node, tasks = int(match.group(1)), layout.num_train_tasks // nodes
    if per_node <= tasks:
        return None
    return (f"the job has {per_node} GPUs per node but {tasks} training task(s) per node, one GPU each: "
            f"{per_node - tasks} GPU(s) per node stay idle; ask for --ntasks-per-node={per_node}")


def fewest_cpus_per_node(cpus_per_node: str) -> int:
    """The smallest count of a Slurm per-node string (SLURM_JOB_CPUS_PER_NODE): `80(x2),40` -> 40."""
    return min(count for count, _ in _per_node(cpus_per_node, "CPUs per node"))


def job_layout(environ: Mapping[str, str] = os.environ) -> JobLayout:
    """Read the allocation from the batch step's environment (no scontrol calls)."""
    if "SLURM_JOB_ID" not in environ:
        raise RuntimeError("not inside a Slurm job (SLURM_JOB_ID is unset): submit with `sbatch slurm/run.sh`")
    het = int(environ.get("SLURM_HET_SIZE", "1")) > 1
    g0 = "_HET_GROUP_0" if het else ""
    train = tuple(expand_nodelist(environ[f"SLURM_JOB_NODELIST{g0}"]))
    sandbox = tuple(expand_nodelist(environ["SLURM_JOB_NODELIST_HET_GROUP_1"])) if het else train
    if f"SLURM_NTASKS{g0}" in environ:
        ntasks = int(environ[f"SLURM_NTASKS{g0}"])
    else:
        ntasks = count_tasks(environ.get(f"SLURM_TASKS_PER_NODE{g0}", "1"))
    return JobLayout(job_id=environ["SLURM_JOB_ID"], job_name=environ.get("SLURM_JOB_NAME", "megatron-rl"),
                     restart_count=int(environ.get("SLURM_RESTART_COUNT", "0")), het=het,
                     train_nodes=train, sandbox_nodes=sandbox, num_train_tasks=ntasks)


def run_dir_for(overrides: Sequence[str], layout: JobLayout, environ: Mapping[str, str] = os.environ) -> Path:
    """`run_dir=` from the overrides, else `<MEGATRON_RL_RUN_ROOT or $SLURM_SUBMIT_DIR/runs>/<name>-<job id>`:
    the same directory on every start of a requeued job. A relative path is the submitter's, as in a local run
    (`run_dir=runs/megatron-rl-41` to resume a run made by a job submitted from the same directory): it is taken
    from $SLURM_SUBMIT_DIR, whatever this process's working directory is."""
    submit_dir = Path(environ.get("SLURM_SUBMIT_DIR") or ".")
    for override in reversed(overrides):
        if override.startswith("run_dir="):
            return (submit_dir / Path(override.split("=", 1)[1]).expanduser()).resolve()
    root = Path(environ.get("MEGATRON_RL_RUN_ROOT") or "runs").expanduser()
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", layout.job_name)
    return (submit_dir / root).resolve() / f"{name}-{layout.job_id}"


def _why_terminated(fields: Mapping[str, str]) -> str:
    """Why Slurm sent SIGTERM, from the job's fields: at that moment the state is mostly COMPLETING, so a time
    limit is told by the run time having reached it (within Slurm's one-minute timer), anything else is a
    cancel or a preemption."""
    state = fields.get("JobState", "")
    if state in ("TIMEOUT", "PREEMPTED", "CANCELLED"):
        return {"TIMEOUT": "reached its time limit", "PREEMPTED": "was preempted",
                "CANCELLED": "was cancelled (scancel)"}[state]
    run, limit = (minutes(fields.get(k, "")) for k in ("RunTime", "TimeLimit"))
    if run is not None and limit is not None and run >= limit - 1:
        return "reached its time limit"
    return "was cancelled (scancel) or preempted" if fields else "got SIGTERM"


def _last_step(run_dir: Path) -> str:
    """The step of metrics.jsonl's last row ("none" before the first)."""
    path = run_dir / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - 65536))
            rows = [line for line in f.read().decode(errors="replace").splitlines() if line.strip()]
        return str(json.loads(rows[-1])["step"]) if rows else "none"
    except (OSError, ValueError, KeyError, IndexError):
        return "none"


def _cpus_per_task(het_group: Optional[int]) -> list[str]:
    """`--cpus-per-task` of the allocation (or of its het component), passed on explicitly: srun of
    Slurm 22.05 to 23.02 does not inherit it, and each rank would be bound to one core."""
    name = "SLURM_CPUS_PER_TASK" + ("" if het_group is None else f"_HET_GROUP_{het_group}")
    value = os.environ.get(name)
    return [f"--cpus-per-task={value}"] if value and value.isdigit() else []


def first_failure(srun_stderr: Sequence[str]) -> Optional[tuple[int, str, str]]:
    """(rank, node, reason) of the first task srun reported as failed, e.g. from
    `srun: error: c1: task 1: Killed`; None when srun reported no task."""
    for line in srun_stderr:
        match = SRUN_ERROR.match(line.strip())
        if match:
            first = re.match(r"\d+", match.group("tasks")).group(0)
            return int(first), match.group("node"), match.group("reason")
    return None


def _init_logging(log_file: Path) -> None:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter("%(asctime)s slurm_job %(levelname)s %(message)s")
    for handler in (logging.StreamHandler(sys.stderr), logging.FileHandler(log_file)):
        handler.setFormatter(fmt)
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


class BatchStep:
    """The supervisor of one start of the job (see the module docstring)."""

    def __init__(self, layout: JobLayout, run_dir: Path, overrides: list[str], cfg, sandbox: bool,
                 sandbox_wait_s: float, server_args: Sequence[str] = ()) -> None:
        if not sandbox:  # no sandbox step: no node has that role
            layout = dataclasses.replace(layout, sandbox_nodes=())
        self.layout, self.run_dir, self.overrides, self.cfg = layout, run_dir, overrides, cfg
        self.use_sandbox, self.sandbox_wait_s, self.server_args = sandbox, sandbox_wait_s, list(server_args)
        self.train: Optional[subprocess.Popen] = None
        self.sandbox: Optional[subprocess.Popen] = None
        self.generators: Optional[subprocess.Popen] = None
        self.usr1 = False
        self.terminating = False
        self.said_stop = False  # the "stopped after step N" line was logged
        self.said_term = False  # the line saying why the job is ending (SIGTERM) was logged
        self.sandbox_ports: dict[str, str] = {}  # node -> the port its server serves on (kept across restarts)
        self.sandbox_restarts = 0  # restarts of the sandbox step done
        self.sandbox_restart_at: Optional[float] = None  # when the next restart is due (monotonic)
        self.sandbox_pending: Optional[float] = None  # a restarted step must have registered by then
        self.srun_errors: list[str] = []

    # -- signals -----------------------------------------------------------------------------
    def _on_usr1(self, signum: int, frame) -> None:
        self.usr1 = True
        if self.train is not None and self.train.poll() is None:
            self.train.send_signal(signal.SIGUSR1)  # srun forwards it to every rank

    def _on_term(self, signum: int, frame) -> None:
        self.terminating = True  # Slurm signals the ranks itself; forwarding would only repeat it

    # -- steps -------------------------------------------------------------------------------
    def _srun_sandbox(self) -> list[str]:
        from megatron_rl.rewards.service import image_args

        sb = self.cfg.sandbox
        n = len(self.layout.sandbox_nodes)
        if self.layout.het:
            where = ["--het-group=1", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", *_cpus_per_task(1)]
            capacity = int(os.environ.get("SLURM_CPUS_PER_TASK_HET_GROUP_1", sb.num_workers))
        else:  # on the GPU nodes: no GPUs, no memory reservation of its own, and (--overlap) every CPU the job
            # has on the node, shared with the ranks; with --cpus-per-task=1 a cluster that binds steps to their
            # CPUs (task/affinity, task/cgroup) ran all of a node's sandbox executions on one core
            cpus = fewest_cpus_per_node(os.environ.get("SLURM_JOB_CPUS_PER_NODE") or "1")
            where = ["--overlap", "--gpus-per-node=0", "--mem=0", f"--nodes={n}", f"--ntasks={n}",
                     "--ntasks-per-node=1", f"--cpus-per-task={cpus}"]
            capacity = sb.num_workers
        cmd = ["srun", *where, "--label", "--job-name=sandbox", sys.executable, "-m", "megatron_rl.slurm_job",
               "sandbox", "--run-dir", str(self.run_dir), "--runtime", sb.runtime, "--capacity", str(capacity)]
        if self.sandbox_ports:
            cmd += ["--ports", ",".join(f"{node}={port}" for node, port in sorted(self.sandbox_ports.items()))]
        cmd += ["--allow-unisolated"] if sb.allow_unisolated else []
        return cmd + [f"--server-arg={a}" for a in [*image_args(sb.images), *self.server_args]]

    def _srun_train(self) -> list[str]:
        lay = self.layout
        where = ["--het-group=0"] if lay.het else []
        where += _cpus_per_task(0 if lay.het else None)
        if lay.generator_nodes:  # the other nodes of the GPU component generate
            n = len(lay.train_nodes)
            where += [f"--nodes={n}", f"--nodelist={','.join(lay.train_nodes)}", f"--ntasks={lay.num_train_tasks}",
                      f"--ntasks-per-node={lay.num_train_tasks // n}"]
        return ["srun", *where, "--kill-on-bad-exit=1", "--label", "--mem=0", "--job-name=train", sys.executable,
                "-m", "megatron_rl.train", "cluster=slurm", *self.overrides, f"run_dir={self.run_dir}"]

    def _srun_generators(self) -> list[str]:
        lay, num = self.layout, self.cfg.rollout.num_generators
        n = len(lay.generator_nodes)
        where = ["--het-group=0"] if lay.het else []
        where += _cpus_per_task(0 if lay.het else None)
        where += [f"--nodes={n}", f"--nodelist={','.join(lay.generator_nodes)}", f"--ntasks={num}",
                  f"--ntasks-per-node={num // n}"]
        return ["srun", *where, "--label", "--mem=0", "--job-name=generate", sys.executable, "-m",
                "megatron_rl.disagg.generator", "--run-dir", str(self.run_dir)]

    def _start_generators(self) -> None:
        """Start the generator step; the generators wait for the trainer's hub file (a file left by
        an earlier start of the job is removed first), so nothing is waited for here."""
        from megatron_rl.disagg.channel import hub_path

        hub_path(self.run_dir).unlink(missing_ok=True)
        cmd = self._srun_generators()
        logger.info("generator step: %s", " ".join(cmd))
        self.generators = subprocess.Popen(cmd)

    def _stop_generators(self) -> None:
        """They stop when the trainer does; a step still running after 60 s is cancelled (srun turns a
        SIGTERM into SIGKILL for its tasks, so the generators' deferral of SIGTERM does not apply)."""
        if self.generators is None:
            return
        try:
            code = self.generators.wait(timeout=60)
        except subprocess.TimeoutExpired:
            logger.warning("the generator step did not stop within 60 s of training; cancelling it")
            self.generators.send_signal(signal.SIGTERM)
            code = self.generators.wait()
        if code != 0:
            logger.warning("the generator step ended with exit code %d; see %s/logs/generator*.log", code,
                           self.run_dir)

    def _start_sandboxes(self) -> bool:
        from megatron_rl_sandbox.client import discover

        for path in (*(self.run_dir / "sandbox").glob("*.json"), self.run_dir / "sandbox" / STOP_FILE):
            path.unlink(missing_ok=True)  # left by a start that was killed
        cmd = self._srun_sandbox()
        logger.info("sandbox step: %s", " ".join(cmd))
        self.sandbox = subprocess.Popen(cmd)
        expected = len(self.layout.sandbox_nodes)
        deadline = time.monotonic() + self.sandbox_wait_s
        while len(found := discover(self.run_dir)) < expected:
            if self.sandbox.poll() is not None or time.monotonic() > deadline:
                why = (f"exited with {self.sandbox.returncode}" if self.sandbox.poll() is not None
                       else f"registered {len(found)} of {expected} servers in {self.sandbox_wait_s:.0f}s")
                logger.error("the sandbox step %s; see %s/logs/sandbox-*.log", why, self.run_dir)
                return False
            time.sleep(0.5)
        logger.info("sandbox servers: %s", ", ".join(found))
        self.sandbox_ports = {a.rsplit(":", 1)[0]: a.rsplit(":", 1)[1] for a in found}
        return True

    def _stop_sandboxes(self) -> None:
        if self.sandbox is None or self.sandbox.poll() is not None:
            return
        # A signal to srun would end the step at once (SIGKILL after KillWait), without draining.
        (self.run_dir / "sandbox").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "sandbox" / STOP_FILE).touch()
        try:
            self.sandbox.wait(timeout=90)
        except subprocess.TimeoutExpired:
            logger.warning("the sandbox step did not stop within 90 s; cancelling it")
            self.sandbox.send_signal(signal.SIGTERM)
            self.sandbox.wait()

    def _supervise_sandbox(self) -> None:
        """Called every quarter second while training runs. A sandbox step that ended is said once in job.log
        (its exit status, the RL step training had reached), its servers' discovery files (dead addresses) go,
        and it is started again on the same ports, after 5, 10, 20... s, at most sandbox.max_restarts times:
        the ranks' clients keep calling those addresses, and their health checks find the new servers. Until
        then code rewards get no verdict (left unscored; the clients stop waiting out deadlines once every
        server has refused connections for 10 s)."""
        now = time.monotonic()
        if self.sandbox_pending is not None:  # a restarted step: registered yet?
            from megatron_rl_sandbox.client import discover

            found = discover(self.run_dir)
            if len(found) >= len(self.layout.sandbox_nodes):
                self.sandbox_pending = None
                logger.info("sandbox step restarted (%d of %d): servers %s", self.sandbox_restarts,
                            self.cfg.sandbox.max_restarts, ", ".join(found))
                return
            if self.sandbox.poll() is None:
                if now > self.sandbox_pending:  # stopped now; handled as a death at the next call
                    self.sandbox_pending = None
                    logger.error("the restarted sandbox step registered %d of %d servers in %.0f s; stopping it",
                                 len(found), len(self.layout.sandbox_nodes), self.sandbox_wait_s)
                    self.sandbox.send_signal(signal.SIGTERM)
                    self.sandbox.wait()
                return
            self.sandbox_pending = None  # it ended before registering: a death like any other
        if self.sandbox.poll() is None:
            return
        if self.sandbox_restart_at is None:  # it ended just now
            gone = sorted((self.run_dir / "sandbox").glob("*.json"))
            for path in gone:
                path.unlink(missing_ok=True)
            left, delay = self.cfg.sandbox.max_restarts - self.sandbox_restarts, 5 * 2 ** self.sandbox_restarts
            what = (f"restarting it in {delay} s ({left} restart(s) left)" if left > 0 else
                    f"no restart left (sandbox.max_restarts={self.cfg.sandbox.max_restarts}): code rewards get no "
                    f"verdict from here on; resubmit with run_dir={self.run_dir} to get servers back")
            logger.error("the sandbox step ended with exit code %s while training ran (after RL step %s); %d "
                         "discovery file(s) removed; %s; see %s/logs/sandbox-*.log", self.sandbox.returncode,
                         _last_step(self.run_dir), len(gone), what, self.run_dir)
            self.sandbox_restart_at = now + delay if left > 0 else float("inf")
        if now >= self.sandbox_restart_at:
            self.sandbox_restarts += 1
            self.sandbox_restart_at = None
            cmd = self._srun_sandbox()
            logger.info("sandbox step, restart %d: %s", self.sandbox_restarts, " ".join(cmd))
            self.sandbox = subprocess.Popen(cmd)
            self.sandbox_pending = now + self.sandbox_wait_s

    def _run_training(self) -> int:
        cmd = self._srun_train()
        logger.info("training step: %s", " ".join(cmd))
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", os.environ.get("SLURM_CPUS_PER_TASK", "1"))
        self.train = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace", env=env)
        reader = threading.Thread(target=self._pump_stderr, daemon=True)
        reader.start()
        while True:
            try:
                code = self.train.wait(timeout=0.25)
                break
            except subprocess.TimeoutExpired:
                # SIGTERM: KillWait is running and the ranks' exit (plots, process-group teardown) may outlast
                # it, taking this step with them; say how training stopped as soon as the checkpoint is marked
                if self.terminating and not self.said_term:
                    self._say_terminating()
                if self.terminating and not self.said_stop and (marker := read_marker(self.run_dir)) is not None:
                    self._say_stopped(marker)
                if self.sandbox is not None and not self.terminating:  # the job's end stops every step
                    self._supervise_sandbox()
        reader.join(timeout=10)
        return code

    def _pump_stderr(self) -> None:
        for line in self.train.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            if line.startswith("srun: error:"):
                self.srun_errors.append(line)

    def _report_failure(self, code: int) -> None:
        failed = first_failure(self.srun_errors)
        if failed is None:
            logger.error("the training step failed with exit code %d and srun named no task:\n%s", code,
                         "".join(self.srun_errors) or "  (no srun error lines)")
            return
        rank, node, reason = failed
        log = self.run_dir / "logs" / f"rank{rank}.log"
        logger.error("training failed: rank %d on %s failed first (%s); srun stopped the other ranks "
                     "(--kill-on-bad-exit). Last lines of %s:\n%s", rank, node, reason, log, log_tail(log))

    def _requeue(self, why: str) -> int:
        logger.warning("%s: requeueing job %s to resume from its last checkpoint", why, self.layout.job_id)
        subprocess.run(["scontrol", "requeue", self.layout.job_id], check=False)
        return 0

    def run(self) -> int:
        signal.signal(signal.SIGUSR1, self._on_usr1)
        signal.signal(signal.SIGTERM, self._on_term)
        lay = self.layout
        logger.info("job %s start %d: run directory %s; nodes %s", lay.job_id, lay.restart_count + 1, self.run_dir,
                    ", ".join(f"{n}={'+'.join(r)}" for n, r in lay.roles().items()))
        (self.run_dir / MARKER).unlink(missing_ok=True)
        if (why := idle_gpus(lay, self.cfg)) is not None:
            logger.warning("%s", why)
        try:
            if self.use_sandbox and not self._start_sandboxes():
                return 1
            if self.usr1:  # the warning came while the sandboxes started: no time for a run
                return self._requeue("SIGUSR1 before training started")
            if lay.generator_nodes:
                self._start_generators()
            code = self._run_training()
            marker = read_marker(self.run_dir)
            if self.terminating and marker is not None and not self.said_stop:
                # KillWait is running, and stopping the sandbox step takes part of it: say it first
                self._say_stopped(marker)
        finally:
            self._stop_generators()
            self._stop_sandboxes()
        if code != 0:
            self._report_failure(code)
            if self.usr1 and not self.terminating:  # e.g. the signal came before the RL loop watched for it
                return self._requeue(f"the training step ended with {code} after SIGUSR1")
            return code
        if marker is None:
            logger.info("training finished; run directory %s", self.run_dir)
            return 0
        if marker["signal"] in ("SIGUSR1", TIME_LIMIT) and not self.terminating:
            return self._requeue(f"stopped after {describe_stop(marker)} "
                                 f"{'before the time limit' if marker['signal'] == TIME_LIMIT else 'on SIGUSR1'}")
        if not self.said_stop:
            self._say_stopped(marker)
        return 0

    def _say_terminating(self) -> None:
        """SIGTERM came (scancel, the time limit, preemption): say at once, before KillWait ends, why the job
        ends, the last RL step logged (the ranks may be in the next one or about to stop after it), what is safe
        on disk, so that the line is there even when the ranks' own
        stop (their checkpoint, the line after it) does not finish in time."""
        self.said_term = True
        why = _why_terminated(job_fields(self.layout.job_id))
        latest = self.run_dir / "checkpoints" / "latest"
        saved = latest.read_text().strip() if latest.is_file() else "none yet"
        logger.warning("job %s %s after RL step %s (the last one logged); last complete checkpoint: %s; the ranks "
                       "checkpoint the step they are in if it ends within KillWait; to resume, submit again with "
                       "run_dir=%s", self.layout.job_id, why, _last_step(self.run_dir), saved, self.run_dir)

    def _say_stopped(self, marker: dict) -> None:
        self.said_stop = True
        on = "before the time limit" if marker["signal"] == TIME_LIMIT else f"on {marker['signal']}"
        logger.warning("stopped after %s %s; the next start of this job (same run directory) resumes",
                       describe_stop(marker), on)


def _cmd_run(args: argparse.Namespace) -> int:
    from megatron_rl.config import ConfigError
    from megatron_rl.data.tasks import run_needs_sandbox
    from megatron_rl.runtime import load_validated

    layout = job_layout()
    overrides = [o for o in args.overrides if o != "--"]

    def train_tasks(cfg) -> int:  # the training ranks: the GPU component's, less those of generator nodes
        try:
            return layout.with_generator_nodes(cfg.rollout.generator_nodes).num_train_tasks
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    try:  # once here, before any step starts: a bad setting costs seconds, not an allocation's worth
        cfg = load_validated(["cluster=slurm", *overrides], train_tasks)
    except ConfigError as exc:  # the local run's one line, in the job's output file; no run directory made
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    run_dir = run_dir_for(overrides, layout)
    _init_logging(run_dir / "logs" / "job.log")
    layout = layout.with_generator_nodes(cfg.rollout.generator_nodes)
    sandbox = not args.no_sandbox and not cfg.sandbox.address and run_needs_sandbox(cfg)
    if not sandbox:
        logger.info("no sandbox step: %s", "--no-sandbox (MEGATRON_RL_SANDBOX=none)" if args.no_sandbox else
                    f"sandbox.address={cfg.sandbox.address}" if cfg.sandbox.address else
                    "the task's rewards run no code")
    return BatchStep(layout, run_dir, overrides, cfg, sandbox, args.sandbox_wait_s, args.server_arg).run()


def sandbox_health(address: str):
    """The server's HealthReply (serving, running, executions_finished, ...), or None if it is down."""
    import grpc

    from megatron_rl_sandbox.proto import load as load_proto

    pb2, pb2_grpc = load_proto()
    try:
        with grpc.insecure_channel(address) as channel:
            return pb2_grpc.SandboxStub(channel).Health(pb2.HealthRequest(), timeout=2.0)
    except grpc.RpcError:
        return None


def _cmd_sandbox(args: argparse.Namespace) -> int:
    """One sandbox server on this node, advertised under the node's Slurm name; logs how many
    executions it has served (the proof that this component computed the rewards)."""
    from megatron_rl_sandbox.spawn import spawn_server, stop_server

    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    run_dir = Path(args.run_dir)
    _init_logging(run_dir / "logs" / f"sandbox-{node}.log")
    ports = dict(item.split("=", 1) for item in args.ports.split(",") if "=" in item)
    port = int(ports[node]) if node in ports else free_port("")
    name = f"{node}-{os.getpid()}"
    server_args = ["--address", f"0.0.0.0:{port}", "--advertise", f"{node}:{port}", "--runtime", args.runtime,
                   "--run-dir", str(run_dir), "--capacity", str(args.capacity), "--name", name]
    server_args += (["--allow-unisolated"] if args.allow_unisolated else []) + args.server_arg
    # Slurm's SIGTERM at the job's end reaches this step too, while the trainer may still need rewards for the
    # step it finishes: server and this process serve on; the batch step's STOP file (or SIGINT) ends them,
    # and the server drains when this process dies (its parent-death signal).
    server_args.append("--ignore-sigterm")
    stop, terminated = threading.Event(), threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: terminated.set())
    proc, info = spawn_server(server_args, run_dir / "logs" / f"sandbox-server-{node}.log", die_with_parent=True)
    logger.info("sandbox server %s serving on %s (runtime %s, capacity %d)", name, info["address"], args.runtime,
                args.capacity)
    served, said, polled = 0, False, time.monotonic()
    stop_file = run_dir / "sandbox" / STOP_FILE
    # The STOP file is looked for often: at a job's end the batch step waits for this step within KillWait.
    while not stop.wait(0.2) and proc.poll() is None and not stop_file.exists():
        if terminated.is_set() and not said:
            said = True
            logger.info("sandbox server %s got SIGTERM: serving on until training ends (the STOP file)", name)
        if time.monotonic() - polled < args.poll_s:
            continue
        polled = time.monotonic()
        health = sandbox_health(info["address"])
        if health is not None and health.executions_finished != served:
            served = health.executions_finished
            logger.info("sandbox server %s: %d executions served (%d running, %d queued)", name, served,
                        health.running, health.queued)
    crashed = proc.poll() is not None
    if not crashed:
        stop_server(proc, timeout_s=60)  # drains running calls and removes its discovery file
    logger.info("sandbox server %s on %s stopped after serving %d executions", name, node, served)
    return (proc.returncode or 1) if crashed else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_rl.slurm_job", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="the batch step: sandbox servers, training, requeue, failure report")
    run.add_argument("--no-sandbox", action="store_true", help="start no sandbox servers (task needs none)")
    run.add_argument("--sandbox-wait-s", type=float, default=300.0, help="how long servers may take to register")
    run.add_argument("--server-arg", action="append", default=[],
                     help="extra argument for every sandbox server, e.g. --server-arg=--max-sessions=64 "
                          "(images come from the config's sandbox.images)")
    run.add_argument("overrides", nargs=argparse.REMAINDER, help="Hydra overrides for megatron_rl.train")
    sb = sub.add_parser("sandbox", help="one sandbox server on this node (run by the sandbox step)")
    sb.add_argument("--run-dir", required=True)
    sb.add_argument("--runtime", default="bwrap", choices=["bwrap", "apptainer", "process"])
    sb.add_argument("--capacity", type=int, default=os.cpu_count() or 1)
    sb.add_argument("--allow-unisolated", action="store_true")
    sb.add_argument("--server-arg", action="append", default=[], help="passed to megatron_rl_sandbox.server")
    sb.add_argument("--poll-s", type=float, default=2.0, help="seconds between health polls (for the log)")
    sb.add_argument("--ports", default="", help="node=port,...: the ports to serve on (a restarted step takes its "
                    "predecessor's, which the ranks' clients still call); others pick a free port")
    args = parser.parse_args(argv)
    return _cmd_run(args) if args.command == "run" else _cmd_sandbox(args)


if __name__ == "__main__":
    sys.exit(main())
