"""The batch step's reading of a Slurm allocation (environment as Slurm 22.05 sets it, copied
from a real het job), its run directory rule and its parsing of srun's failure lines; the
stop flag of `megatron_rl.preemption` in one process, and how helper processes take the stop signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.parallel.dist import dist_env_from
from megatron_rl.preemption import (MARKER, STOP_SIGNALS, TIME_LIMIT, JobDeadline, Preemption,
                                    children_block_stop_signals, slurm_job_end)
from megatron_rl.slurm_job import count_tasks, first_failure, job_layout, run_dir_for
from tests.integration.jobs import shielded_signals

# Batch-step variables of `sbatch --ntasks-per-node=2 --gpus-per-node=2 : --cpus-per-task=1 run.sh`.
HET_BATCH = {"SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "megatron-rl", "SLURM_HET_SIZE": "2",
             "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_NODELIST_HET_GROUP_0": "gpu[01-02]",
             "SLURM_JOB_NODELIST_HET_GROUP_1": "cpu7", "SLURM_NTASKS_HET_GROUP_0": "16",
             "SLURM_TASKS_PER_NODE_HET_GROUP_0": "8(x2)", "SLURM_SUBMIT_DIR": "/home/u/megatron-rl"}
# A training task of the het group 0 step, as srun sets it.
HET_TASK = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "gpu[01-02]",
            "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_JOB_ID": "42"}


def test_count_tasks():
    assert count_tasks("2") == 2
    assert count_tasks("8(x2)") == 16
    assert count_tasks("2(x3),1") == 7
    with pytest.raises(ValueError, match="tasks-per-node"):
        count_tasks("two")


def test_het_job_layout_and_roles():
    layout = job_layout(HET_BATCH)
    assert layout.het and layout.num_train_tasks == 16 and layout.restart_count == 0
    assert layout.train_nodes == ("gpu01", "gpu02") and layout.sandbox_nodes == ("cpu7",)
    assert layout.roles() == {"gpu01": ("train",), "gpu02": ("train",), "cpu7": ("sandbox",)}


def test_gpu_only_layout_puts_sandboxes_on_the_gpu_nodes():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[08-09]", "SLURM_TASKS_PER_NODE": "4(x2)",
           "SLURM_RESTART_COUNT": "2"}
    layout = job_layout(env)
    assert not layout.het and layout.num_train_tasks == 8 and layout.restart_count == 2
    assert layout.roles() == {"n08": ("train", "sandbox"), "n09": ("train", "sandbox")}


def test_generator_nodes_are_the_last_nodes_of_the_gpu_component():
    layout = job_layout({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[01-04]", "SLURM_TASKS_PER_NODE": "8(x4)"})
    split = layout.with_generator_nodes(1)
    assert split.train_nodes == ("n01", "n02", "n03") and split.generator_nodes == ("n04",)
    assert split.num_train_tasks == 24  # 8 ranks on each training node
    assert split.roles()["n04"] == ("generate", "sandbox") and split.roles()["n01"] == ("train", "sandbox")
    assert layout.with_generator_nodes(0) == layout
    het = job_layout(HET_BATCH).with_generator_nodes(1)
    assert het.train_nodes == ("gpu01",) and het.generator_nodes == ("gpu02",) and het.num_train_tasks == 8
    assert het.sandbox_nodes == ("cpu7",)
    with pytest.raises(ValueError, match="rollout.generator_nodes=4 leaves no node to train on"):
        layout.with_generator_nodes(4)
    uneven = job_layout({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[01-02]", "SLURM_TASKS_PER_NODE": "3,2"})
    with pytest.raises(ValueError, match="same number of tasks on every node"):
        uneven.with_generator_nodes(1)


def test_layout_outside_slurm_says_how_to_submit():
    with pytest.raises(RuntimeError, match="sbatch slurm/run.sh"):
        job_layout({})


def test_run_dir_is_keyed_by_job_id_so_a_requeued_job_finds_it(tmp_path):
    layout = job_layout(HET_BATCH)
    assert run_dir_for([], layout, HET_BATCH) == Path("/home/u/megatron-rl/runs/megatron-rl-42")
    assert run_dir_for([], layout, dict(HET_BATCH, MEGATRON_RL_RUN_ROOT=str(tmp_path))) == tmp_path / "megatron-rl-42"
    assert run_dir_for(["task=arithmetic", f"run_dir={tmp_path}/x"], layout) == tmp_path / "x"


def test_a_relative_run_dir_is_the_submitters_not_the_batch_steps_working_directory(tmp_path, monkeypatch):
    """The docs' resume line, `sbatch slurm/run.sh ... run_dir=runs/megatron-rl-41`, from the directory the first
    job was submitted from: the batch step runs elsewhere (it ran in the checkout), and a path taken from its
    working directory was a new, empty run directory, so the "resumed" job silently started again at step 0."""
    submit = tmp_path / "project"
    (submit / "runs" / "megatron-rl-41").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # the batch step's working directory is not the submit directory
    env = dict(HET_BATCH, SLURM_SUBMIT_DIR=str(submit))
    layout = job_layout(env)
    assert run_dir_for(["run_dir=runs/megatron-rl-41"], layout, env) == submit / "runs" / "megatron-rl-41"
    assert run_dir_for([], layout, dict(env, MEGATRON_RL_RUN_ROOT="scratch")) == submit / "scratch" / "megatron-rl-42"
    assert run_dir_for([], layout, env) == submit / "runs" / "megatron-rl-42"


def test_first_failure_is_the_first_task_srun_names():
    lines = ["0: step 3 | reward 0.1\n",
             "srun: error: c1: task 1: Killed\n",
             "srun: launch/slurm: _step_signal: Terminating StepId=4.0\n",
             "srun: error: c1: task 0: Terminated\n"]
    assert first_failure(lines) == (1, "c1", "Killed")
    assert first_failure(["srun: error: gpu03: tasks 8-15: Exited with exit code 1"]) == (8, "gpu03",
                                                                                           "Exited with exit code 1")
    assert first_failure(["srun: error: Unable to create step for job 5: Invalid TRES"]) is None


def test_rank_of_a_het_group_task():
    env = dist_env_from(HET_TASK)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (9, 16, 1, 8)
    assert env.master_addr == "gpu01" and env.source == "slurm"
    assert env.master_port == dist_env_from(HET_TASK).master_port  # same on every rank and every requeue


def test_a_watched_stop_signal_is_a_request_not_an_exit(tmp_path):
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        stop = Preemption(tmp_path, is_main=True).install()
        stop.watch()
        assert not stop.stop_agreed(1, 10)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.stop_agreed(2, 10) and stop.reason == "SIGUSR1"
        assert not stop.stop_agreed(10, 10), "after the last step there is nothing to stop"
        # the time limit after the warning: Slurm sends SIGTERM twice (measured with Slurm 22.05); this process
        # lives on to checkpoint (a repeat ended it at once before), and SIGTERM is the reason now
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        assert stop.stop_agreed(3, 10) and stop.reason == "SIGTERM"
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_deadline_stops_when_one_more_step_and_its_checkpoint_would_pass_the_time_limit():
    """Hand-derived, the job ending at t=1400: start-up with step 1 takes 200 s (the first interval, which counts
    only until a second exists), later steps 30-40 s; one more step and its checkpoint need the longest step, the
    longest save (before one was measured: the longest step again) and 60 s of slack."""
    clock = _Clock()
    deadline = JobDeadline(lambda: 1400.0, clock=clock, slack_s=60.0)
    deadline.start()
    clock.now = 1200.0
    assert deadline.near() and (deadline.needed, deadline.left) == (200 + 200 + 60, 200)
    clock.now = 1230.0
    assert not deadline.near() and (deadline.needed, deadline.left) == (30 + 30 + 60, 170)
    clock.now = 1260.0
    assert not deadline.near(save_seconds=10.0) and (deadline.needed, deadline.left) == (30 + 10 + 60, 140)
    clock.now = 1300.0
    assert deadline.near(save_seconds=10.0) and (deadline.needed, deadline.left) == (40 + 10 + 60, 100)


def test_the_deadline_asks_for_the_end_again_after_refresh_s_and_none_never_stops():
    clock, ends, asked = _Clock(), [1025.0, 5000.0], []

    def end() -> float:
        asked.append(clock.now)
        return ends[len(asked) - 1]

    deadline = JobDeadline(end, clock=clock, slack_s=0.0, refresh_s=300.0)
    deadline.start()
    for now in (1010.0, 1020.0):
        clock.now = now
        assert deadline.near(), now  # 15 s, then 5 s left, 10 + 10 needed: the end it read first
    clock.now = 1310.0  # the limit was raised (`scontrol update`): read again 300 s after the first reading
    assert not deadline.near() and asked == [1010.0, 1310.0] and deadline.left == 5000.0 - 1310.0
    unlimited = JobDeadline(lambda: None, clock=clock)
    unlimited.start()
    clock.now += 10**6
    assert not unlimited.near() and not unlimited.near()


def test_the_time_limit_stop_is_rank_zeros_and_named(tmp_path):
    clock = _Clock()
    stop = Preemption(tmp_path, is_main=True, deadline=JobDeadline(lambda: 1100.0, clock=clock)).install()
    other = Preemption(tmp_path, is_main=False, deadline=JobDeadline(lambda: 1100.0, clock=clock))
    assert other.deadline is None  # one clock decides for every rank (their flags are summed)
    stop.watch()
    clock.now = 1010.0  # 10 s a step, 90 s left: 10 + 10 + 60 fits
    assert not stop.stop_agreed(1, 10)
    clock.now = 1030.0  # 20 s a step, 70 s left: 20 + 5 + 60 does not
    assert stop.stop_agreed(2, 10, save_seconds=5.0) and stop.reason == TIME_LIMIT
    stop.save_and_mark(type("Checkpoints", (), {"root": tmp_path / "ckpt", "save": lambda *a: None})(), 2,
                       lambda: {})
    assert json.loads((tmp_path / MARKER).read_text())["signal"] == TIME_LIMIT


def test_a_stop_before_the_time_limit_requeues_the_job(tmp_path, monkeypatch):
    """Slurm requeues no job that reached its time limit: the ranks stop before it (TIME_LIMIT in
    preempted.json), and the batch step requeues, as after USR1; a SIGTERM stop is not requeued."""
    from megatron_rl.config import load_config
    from megatron_rl.slurm_job import BatchStep

    cfg = load_config(["cluster=slurm", "rollout.backend=hf", "sandbox=bwrap"], world_size=16)
    for reason, requeued in ((TIME_LIMIT, True), ("SIGUSR1", True), ("SIGTERM", False)):
        step = BatchStep(job_layout(HET_BATCH), tmp_path, [], cfg, sandbox=False, sandbox_wait_s=1)
        asked: list[str] = []

        def ranks(reason: str = reason) -> int:
            (tmp_path / MARKER).write_text(json.dumps({"signal": reason, "steps_done": 4}))
            return 0

        monkeypatch.setattr(step, "_run_training", ranks)
        monkeypatch.setattr(step, "_requeue", lambda why: asked.append(why) or 0)
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
        try:
            assert step.run() == 0
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        assert asked == ([f"stopped after step 4 {'before the time limit' if reason == TIME_LIMIT else 'on SIGUSR1'}"]
                         if requeued else []), reason


def test_slurm_job_end_reads_scontrols_end_time_then_slurms_variable(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    answer = tmp_path / "answer"
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\ncat {answer}\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    answer.write_text("JobId=7 JobName=megatron-rl JobState=RUNNING TimeLimit=00:02:00 "
                      "StartTime=2026-12-08T03:00:00 EndTime=2026-12-08T03:02:00 Partition=debug\n")
    expected = time.mktime((2026, 12, 8, 3, 2, 0, 0, 0, -1))  # this node's local time, as scontrol prints it
    assert slurm_job_end({"SLURM_JOB_ID": "7"}) == expected
    answer.write_text("JobId=7 JobState=RUNNING TimeLimit=UNLIMITED EndTime=Unknown\n")
    assert slurm_job_end({"SLURM_JOB_ID": "7"}) is None
    assert slurm_job_end({"SLURM_JOB_ID": "7", "SLURM_JOB_END_TIME": "1765000000"}) == 1765000000.0
    assert slurm_job_end({"SLURM_JOB_END_TIME": "1765000000"}) is None  # not in a Slurm job


def test_the_steps_pass_the_allocations_cpus_per_task_on(tmp_path, monkeypatch):
    """srun of Slurm 22.05 to 23.02 does not inherit --cpus-per-task: the training and sandbox steps of a
    het job pass each component's own, and nothing when the allocation set none."""
    from megatron_rl.config import load_config
    from megatron_rl.slurm_job import BatchStep

    cfg = load_config(["cluster=slurm", "rollout.backend=hf", f"+sandbox.images.python={tmp_path}"], world_size=16)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK_HET_GROUP_0", "12")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK_HET_GROUP_1", "32")
    step = BatchStep(job_layout(HET_BATCH), tmp_path, [], cfg, sandbox=True, sandbox_wait_s=1)
    assert "--cpus-per-task=12" in step._srun_train() and "--cpus-per-task=32" in step._srun_sandbox()
    # cluster=slurm's Apptainer runtime, with the configured image handed to every server
    assert {"--runtime", "apptainer", f"--server-arg=--image=python={tmp_path}"} <= set(step._srun_sandbox())
    monkeypatch.delenv("SLURM_CPUS_PER_TASK_HET_GROUP_0")
    assert not any(a.startswith("--cpus-per-task") for a in step._srun_train())


def test_the_gpu_only_sandbox_step_shares_every_cpu_the_job_has_on_a_node(tmp_path, monkeypatch):
    """slurm/run_gpu_only.sh: the sandbox step (--overlap) asks for the job's CPUs on a node (the fewest of any
    node), not one, which a cluster binding steps to their CPUs gave all of a node's executions."""
    from megatron_rl.config import load_config
    from megatron_rl.slurm_job import BatchStep, fewest_cpus_per_node

    assert fewest_cpus_per_node("80(x2),40") == 40 and fewest_cpus_per_node("16") == 16
    with pytest.raises(ValueError, match="CPUs per node"):
        fewest_cpus_per_node("all")
    env = {"SLURM_JOB_ID": "43", "SLURM_JOB_NAME": "megatron-rl", "SLURM_JOB_NODELIST": "gpu[01-02]",
           "SLURM_NTASKS": "16", "SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_SUBMIT_DIR": str(tmp_path)}
    cfg = load_config(["cluster=slurm", "rollout.backend=hf", "sandbox=bwrap"], world_size=16)
    monkeypatch.setenv("SLURM_JOB_CPUS_PER_NODE", "80(x2)")
    step = BatchStep(job_layout(env), tmp_path, [], cfg, sandbox=True, sandbox_wait_s=1)
    srun = step._srun_sandbox()
    assert {"--overlap", "--cpus-per-task=80", "--ntasks-per-node=1", "--nodes=2"} <= set(srun), srun


def test_fewer_training_tasks_than_gpus_per_node_is_said():
    """Colocated, each rank takes one GPU: 8 GPUs and 4 tasks per node leave 4 idle (said); as many tasks as GPUs,
    or a disaggregated run (local generators take the spare GPUs), say nothing."""
    from megatron_rl.config import load_config
    from megatron_rl.slurm_job import idle_gpus

    cfg = load_config(["cluster=slurm", "rollout.backend=hf", "sandbox=bwrap"], world_size=8)
    env = {"SLURM_JOB_ID": "44", "SLURM_JOB_NAME": "megatron-rl", "SLURM_JOB_NODELIST": "gpu[01-02]",
           "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_GPUS_PER_NODE": "h100:8"}
    why = idle_gpus(job_layout(env), cfg, env)
    assert why is not None and "8 GPUs per node but 4 training task(s)" in why and "--ntasks-per-node=8" in why
    assert idle_gpus(job_layout(env), cfg, dict(env, SLURM_GPUS_PER_NODE="4")) is None
    assert idle_gpus(job_layout(env), cfg, {k: v for k, v in env.items() if k != "SLURM_GPUS_PER_NODE"}) is None
    disagg = load_config(["cluster=slurm", "rollout.backend=hf", "sandbox=bwrap", "rollout.mode=disaggregated"],
                         world_size=8)
    assert idle_gpus(job_layout(env), disagg, env) is None
    het = dict(HET_BATCH, SLURM_GPUS_PER_NODE_HET_GROUP_0="8")  # 16 tasks on 2 nodes: 8 each
    assert idle_gpus(job_layout(het), load_config(["cluster=slurm", "rollout.backend=hf", "sandbox=bwrap"],
                                                  world_size=16), het) is None


def test_after_sigterm_the_stop_is_said_once_the_checkpoint_is_marked_not_when_the_ranks_exit(
        tmp_path, monkeypatch, caplog):
    """Under `scancel` Slurm SIGKILLs every step KillWait seconds after its SIGTERM; ranks whose exit (plots,
    teardown) outlasts that took the batch step down before it said where training stopped. The batch step says
    it when `preempted.json` appears, while the training step still runs, and says it once."""
    import json
    import logging
    import threading

    from megatron_rl.config import load_config
    from megatron_rl.preemption import MARKER
    from megatron_rl.slurm_job import BatchStep

    cfg = load_config(["cluster=slurm", "rollout.backend=hf", "sandbox=bwrap"], world_size=16)
    step = BatchStep(job_layout(HET_BATCH), tmp_path, [], cfg, sandbox=False, sandbox_wait_s=1)
    marker = tmp_path / MARKER
    record = json.dumps({"signal": "SIGTERM", "steps_done": 3})
    ranks = (f"import pathlib, time; time.sleep(0.5); pathlib.Path({str(marker)!r}).write_text({record!r}); "
             "time.sleep(60)")  # a checkpointed rank that is slow to exit
    monkeypatch.setattr(step, "_srun_train", lambda: [sys.executable, "-c", ranks])
    step.terminating = True
    caplog.set_level(logging.INFO, logger="megatron_rl.slurm_job")
    runner = threading.Thread(target=step._run_training, daemon=True)
    runner.start()
    try:
        deadline = time.monotonic() + 20
        while not step.said_stop and time.monotonic() < deadline:
            time.sleep(0.05)
        said = [r.getMessage() for r in caplog.records if "stopped after" in r.getMessage()]
        assert said == ["stopped after step 3 on SIGTERM; the next start of this job (same run directory) resumes"]
        assert step.train.poll() is None  # said while the ranks were still exiting
    finally:
        step.train.kill()
        runner.join(timeout=10)
    assert len([r for r in caplog.records if "stopped after" in r.getMessage()]) == 1


def _still_running(proc: subprocess.Popen, after_s: float = 1.0) -> bool:
    try:
        proc.wait(timeout=after_s)
    except subprocess.TimeoutExpired:
        return True
    return False


def test_processes_started_in_the_block_outlive_both_stop_signals_and_this_one_loses_none():
    """Slurm sends USR1 (srun's forward of the warning) and SIGTERM (the job's end) to every process
    of a step; helpers the ranks start must outlive them while the ranks checkpoint. This process
    acts on a signal that arrives during the block (SGLang's start, minutes long) as without it."""
    got: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: got.append(signum)) for sig in STOP_SIGNALS}
    try:
        with children_block_stop_signals():
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.1)
        assert got == [signal.SIGUSR1], "a signal that came during the block was lost"
        try:
            assert {signal.SIGUSR1, signal.SIGTERM} <= shielded_signals(child.pid)
            for sig in STOP_SIGNALS:
                child.send_signal(sig)
            assert _still_running(child)
        finally:
            child.kill()
            child.wait()
        assert not {signal.SIGUSR1, signal.SIGTERM} & signal.pthread_sigmask(signal.SIG_BLOCK, [])
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert got == [signal.SIGUSR1, signal.SIGTERM]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


SPAWNER = """
import multiprocessing, time
from megatron_rl.preemption import children_block_stop_signals
with children_block_stop_signals():  # the resource tracker is not running yet in this interpreter
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    child.start()
print(child.pid, flush=True)
child.join()
"""


def test_a_process_spawned_in_the_block_when_the_resource_tracker_starts_has_both_blocked():
    """multiprocessing's 'spawn' starts its resource tracker with the first process, and CPython unblocks
    SIGTERM on the calling thread once the tracker runs: the process the block starts next, as SGLang's
    schedulers and the generators are started, had SIGTERM unblocked."""
    proc = subprocess.Popen([sys.executable, "-c", SPAWNER], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    child = int(proc.stdout.readline())
    try:
        assert {signal.SIGUSR1, signal.SIGTERM} <= shielded_signals(child)
    finally:
        os.kill(child, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()


HELPER = """
import logging, os, signal, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
from megatron_rl.preemption import children_block_stop_signals, helper_defers_stop_signals
os.kill(os.getpid(), signal.SIGUSR1)  # before the helper takes the signals: held pending, as in a spawned generator
helper_defers_stop_signals("generator 3")
print("ready", flush=True)
time.sleep(120)
"""


def test_a_helper_serves_on_through_the_stop_signals_and_ends_at_sigint():
    """A generator's own process (started blocked, as `children_block_stop_signals` starts it). It starts with
    SIGINT's default action, as under a terminal or Slurm: a test run started in the background by a
    non-interactive shell (`bash .ci/run &`) ignores SIGINT, the child would inherit that, and Python then
    never raises KeyboardInterrupt (the wait below timed out in two such runs)."""
    with children_block_stop_signals():
        proc = subprocess.Popen([sys.executable, "-c", HELPER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])),
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "ready"
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGTERM):  # Slurm's warning, then its time limit
            proc.send_signal(sig)
            time.sleep(0.3)  # two pending signals of a kind are one
        assert _still_running(proc)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == -signal.SIGINT
        out = proc.stderr.read()
    finally:
        proc.kill()
        proc.stdout.close()
        proc.stderr.close()
    assert out.count("generator 3 got SIGUSR1: the trainer stops it") == 2  # the pending one and the later one
    assert out.count("generator 3 got SIGTERM") == 2


def test_why_a_job_got_sigterm_is_told_from_its_fields():
    from megatron_rl.slurm_job import _why_terminated
    assert _why_terminated({"JobState": "COMPLETING", "RunTime": "00:14:31", "TimeLimit": "00:15:00"}) \
        == "reached its time limit"  # within Slurm's one-minute timer
    assert _why_terminated({"JobState": "COMPLETING", "RunTime": "00:02:00", "TimeLimit": "00:15:00"}) \
        == "was cancelled (scancel) or preempted"
    assert _why_terminated({"JobState": "COMPLETING", "RunTime": "00:02:00", "TimeLimit": "UNLIMITED"}) \
        == "was cancelled (scancel) or preempted"
    assert _why_terminated({"JobState": "TIMEOUT"}) == "reached its time limit"
    assert _why_terminated({"JobState": "COMPLETING", "RunTime": "00:02:00", "TimeLimit": "Partition_Limit"}) \
        == "was cancelled (scancel) or preempted"
    assert _why_terminated({}) == "got SIGTERM"  # scontrol did not answer
