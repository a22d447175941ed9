"""`sbatch slurm/run.sh <overrides>` on a real (single-host) Slurm cluster: a short RL run
of the small model with 2 training ranks (gloo on CPU) and a het-job CPU component serving the
sandbox rewards; a USR1 warning that makes the job checkpoint, requeue itself and resume (and its time limit,
without a signal); `scancel`
(SIGTERM to every step) that the ranks answer with a checkpoint within KillWait, resumed by a new job
in the same run directory; and a killed rank that brings the job down quickly with the rank named."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[3]
# 2 ranks on c1 (2 fake GPUs), one sandbox server on c2; the #SBATCH sizes of slurm/run.sh are
# for a real cluster, so each het component's are overridden on the command line (`:` separates).
GPU_COMPONENT = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1", "--mem=0",
                 "--time=15"]
CPU_COMPONENT = ["--nodes=1", "--cpus-per-task=1", "--mem=1G"]
# sandbox=bwrap: this host allows unprivileged user namespaces; cluster=slurm's own default, Apptainer, has a test
TINY = ["mode=rl", "cluster.device=cpu", "global_batch_size=32", "rollout.n_samples_per_prompt=8",
        "rollout.max_new_tokens=16", "task.num_train=256", "task.num_eval=8", "task.eval_every=0",
        "task.eval_samples=1", "logging.progress=false", "sandbox=bwrap"]


class Job:
    """One `sbatch` submission, followed by job id (`scontrol show job`) rather than with
    `sbatch --wait`. While Slurm requeues a job, its state reads as a finished one (e.g.
    CANCELLED) for a moment before it is PENDING again, which ended `sbatch --wait` early under
    load; so a job counts as finished only once its state has stayed finished for `SETTLE_S`."""

    SETTLE_S = 5.0

    FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED"}

    def __init__(self, env: dict, tmp: Path, script: str, sbatch_args: list[str], overrides: list[str],
                 cwd: Path = REPO) -> None:
        self.env = dict(env, MEGATRON_RL_RUN_ROOT=str(tmp / "runs"), OMP_NUM_THREADS="1")
        self.output = tmp / "job.out"
        cmd = ["sbatch", "--parsable", f"--output={self.output}", *sbatch_args, script, *overrides]
        proc = subprocess.run(cmd, cwd=cwd, env=self.env, capture_output=True, text=True)
        assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr
        self.job_id = proc.stdout.strip().split(";")[0]
        self.run_dir = tmp / "runs" / f"megatron-rl-{self.job_id}"

    def _show(self) -> dict[str, str]:
        """`scontrol show job` fields of the job (of its first component, which runs the batch script)."""
        out = subprocess.run(["scontrol", "-o", "show", "job", self.job_id], env=self.env, capture_output=True,
                             text=True).stdout.splitlines()
        return dict(field.split("=", 1) for field in (out[0] if out else "").split() if "=" in field)

    def state(self) -> str:
        return self._show().get("JobState", "")

    def finished(self) -> bool:
        """Whether the job has finished: its state is a finished one and stays so for SETTLE_S."""
        settle = time.monotonic() + self.SETTLE_S
        while self.state() in self.FINISHED:
            if time.monotonic() > settle:
                return True
            time.sleep(0.2)
        return False

    def wait(self, timeout: float = 400) -> int:
        """The batch script's exit code once the job has finished."""
        deadline = time.monotonic() + timeout
        while not self.finished():
            if time.monotonic() > deadline:
                subprocess.run(["scancel", self.job_id], env=self.env)
                raise AssertionError(f"job {self.job_id} did not finish in {timeout}s:\n{self.log()}")
            time.sleep(0.5)
        return int(self._show().get("ExitCode", "1:0").split(":")[0])

    def log(self) -> str:
        return self.output.read_text() if self.output.exists() else "(no job output)"

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_for_steps(self, num: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while len([m for m in self.metrics() if m["step"] > 0]) < num:  # row 0: the evaluation before RL
            assert not self.finished(), f"the job ended early:\n{self.log()[-4000:]}"
            assert time.monotonic() < deadline, f"no {num} steps within {timeout}s:\n{self.log()[-4000:]}"
            time.sleep(0.1)


def _job_processes(job_id: str):
    """(pid, command line words, environment) of every process of the job (this host runs every node)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = dict(item.split("=", 1) for item in (proc / "environ").read_bytes().decode(
                errors="replace").split("\0") if "=" in item)
        except OSError:
            continue
        if environ.get("SLURM_JOB_ID") == job_id:
            yield int(proc.name), cmdline, environ


def _rank_pid(job_id: str, rank: int) -> Optional[int]:
    """The pid of training rank `rank` of the job."""
    return next((pid for pid, cmdline, environ in _job_processes(job_id) if b"megatron_rl.train" in cmdline
                 and environ.get("SLURM_PROCID") == str(rank) and "SLURM_STEP_ID" in environ), None)


def test_from_outside_the_checkout_a_config_error_fails_at_once_and_writes_nothing(slurm_env, tmp_path):
    """`cd elsewhere && sbatch <checkout>/slurm/run.sh <bad override>`: Slurm runs a spooled copy of the script,
    which finds the checkout from the path it was submitted as; the bad override ends the job with the local
    run's one `config error:` line in the output file and exit status 2, before any run directory exists. A
    copy of the script outside any checkout says in one line what to set."""
    import shutil

    env = {k: v for k, v in slurm_env.items() if k != "MEGATRON_RL_HOME"}
    sizes = [*GPU_COMPONENT, ":", *CPU_COMPONENT]
    job = Job(env, tmp_path, str(REPO / "slurm" / "run.sh"), sizes, [*TINY, "rollout.temperature=-1"], cwd=tmp_path)
    assert job.wait(timeout=180) == 2, job.log()
    text = job.output.read_text()
    errors = [line for line in text.splitlines() if "config error" in line]
    assert len(errors) == 1 and errors[0].startswith("config error: rollout.temperature=-1 is invalid"), text
    assert not (tmp_path / "runs").exists()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(REPO / "slurm" / "run.sh", elsewhere / "run.sh")
    lost = Job(env, elsewhere, str(elsewhere / "run.sh"), sizes, TINY, cwd=elsewhere)
    assert lost.wait(timeout=180) == 2, lost.log()
    assert "cannot find the checkout" in lost.output.read_text()
    assert "set MEGATRON_RL_HOME=/path/to/megatron-rl" in lost.output.read_text()


def test_het_job_trains_with_rewards_from_the_cpu_component(slurm_env, tmp_path):
    job = Job(slurm_env, tmp_path, "slurm/run.sh", [*GPU_COMPONENT, ":", *CPU_COMPONENT],
              [*TINY, "num_steps=4", "task.sft_warmup_steps=30", "checkpoint.save_every=2"])
    assert job.wait() == 0, job.log()[-6000:]
    rows = job.metrics()
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # 0: the evaluation before any update
    assert all(r["reward/verifier_calls"] > 0 and r["reward/verifier_errors"] == 0 for r in rows[1:])
    # The rewards came from the het component's server on c2: its log counts the executions,
    # and no rank started a server of its own.
    sandbox_log = (job.run_dir / "logs" / "sandbox-c2.log").read_text()
    served = [int(n) for n in re.findall(r"stopped after serving (\d+) executions", sandbox_log)]
    assert served and served[0] > 0, sandbox_log
    for rank in (0, 1):
        assert "local sandbox server" not in (job.run_dir / "logs" / f"rank{rank}.log").read_text()
    log = job.log()
    assert "nodes c1=train, c2=sandbox" in log and "sandbox servers: c2:" in log
    assert (job.run_dir / "config.yaml").exists()
    assert (job.run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    assert not list((job.run_dir / "sandbox").glob("*.json")), "the server drains and deregisters at the end"


def _nodes_completing(env: dict) -> bool:
    """Whether a node of the test cluster still cleans up a job (sinfo's state ends in "completing"), or
    sinfo could not tell."""
    proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True)
    states = proc.stdout.split()
    return proc.returncode != 0 or not states or any("completing" in s or s.endswith("@") for s in states)


def _slurm_says(env: dict, job: Job) -> str:
    """For a failure message: the job's `scontrol show job` state and reason, and the lines of the
    test cluster's daemon logs that name it (why Slurm ended or held it)."""
    fields = job._show()
    lines = [f"scontrol: JobState={fields.get('JobState')} Reason={fields.get('Reason')} "
             f"ExitCode={fields.get('ExitCode')} Restarts={fields.get('Restarts')}"]
    for log in sorted((Path(env["MEGATRON_RL_SLURM_LAB"]) / "log").glob("slurm*.log")):
        named = [line for line in log.read_text(errors="replace").splitlines()
                 if re.search(rf"(JobId=|[Jj]ob |jobid |StepId=|\[){job.job_id}\b", line)]
        lines += [f"{log.name}: {line}" for line in named[-15:]]
    return "\n".join(lines)


def test_usr1_checkpoints_requeues_and_resumes_without_repeating_a_step(slurm_env, tmp_path):
    steps = 7
    job = Job(slurm_env, tmp_path, "slurm/run.sh", [*GPU_COMPONENT, ":", *CPU_COMPONENT],
              [*TINY, f"num_steps={steps}", "checkpoint.save_every=100"])
    job.wait_for_steps(2)
    # What `#SBATCH --signal=B:USR1@180` does before the time limit: USR1 to the batch step only.
    subprocess.run(["scancel", "--batch", "--signal=USR1", job.job_id], env=slurm_env, check=True)
    deadline = time.monotonic() + 300  # KillWait, the node's "completing", the forced start; slow on a loaded box
    states: list[str] = []  # the job's states while it requeues, for the failure message
    free_since: Optional[float] = None  # since when the nodes have been done with the first start
    while "start 2" not in job.log():
        state = job.state()
        if not states or states[-1] != state:
            states.append(state)
        # Once the batch step has asked for the requeue, the job may read as finished (CANCELLED)
        # for longer than Job.SETTLE_S on a loaded machine before it is PENDING again (CI saw
        # it); only the deadline judges it then.
        if "requeueing job" not in job.log():
            assert not job.finished(), job.log()[-6000:]
        assert time.monotonic() < deadline, f"states {states}\n{job.log()[-6000:]}\n{_slurm_says(slurm_env, job)}"
        # Slurm holds a requeued job back ~2 min (longer than its job credentials live), not needed here.
        # The start must come after slurmd revoked the first start's credential (before the nodes end
        # "completing") and in a later second: a start in the second of the revocation reads as revoked,
        # and the job is killed ("Job credential revoked"; CI saw it, the job FAILED). So 3 s after the
        # nodes are done. StartTime=now again at every poll: a het job starts from the backfill
        # scheduler only, which runs when something changed, not when a begin time passes.
        if state != "PENDING" or _nodes_completing(slurm_env):
            free_since = None
        elif free_since is None:
            free_since = time.monotonic()
        elif time.monotonic() - free_since > 3:
            subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"], env=slurm_env)
        time.sleep(0.5)
    assert job.wait() == 0, job.log()[-6000:]
    log = job.log()
    stopped = int(re.search(r"stopped after step (\d+) on SIGUSR1: requeueing", log).group(1))
    assert 2 <= stopped < steps
    assert [r["step"] for r in job.metrics()] == list(range(steps + 1)), "every step exactly once"
    rank0 = (job.run_dir / "logs" / "rank0.log").read_text()
    assert f"resumed from {job.run_dir}/checkpoints/step_{stopped:08d}" in rank0
    assert "training finished" in log and not (job.run_dir / "preempted.json").exists()
    # the requeued start added to the logs: the first start's lines are still there (job.log, each sandbox log)
    assert (job.run_dir / "logs" / "job.log").read_text().count(f"job {job.job_id} start ") == 2
    server_log = (job.run_dir / "logs" / "sandbox-server-c2.log").read_text()
    assert server_log.count("=== sandbox server starting at") == 2 and "job restart 1" in server_log


def test_a_job_near_its_time_limit_checkpoints_and_requeues_itself(slurm_env, tmp_path):
    """A job of 2 minutes with more steps than fit (Slurm never requeues one that reaches its limit): rank 0 reads
    the end from `scontrol show job` and, once one more step and its checkpoint may not fit with the minute of
    slack (checkpoint.stop_before_time_limit), the ranks checkpoint and the batch step requeues the job, before
    Slurm's time limit would kill it."""
    # no USR1 warning (the script's @180 would come at once): SIGURG, which the batch step ignores, replaces it
    gpu = [a for a in GPU_COMPONENT if not a.startswith("--time=")] + ["--time=2", "--signal=B:URG@1"]
    job = Job(slurm_env, tmp_path, "slurm/run.sh", [*gpu, ":", *CPU_COMPONENT],
              [*TINY, "num_steps=5000", "checkpoint.save_every=10000"])
    deadline = time.monotonic() + 240
    while "requeueing job" not in job.log():
        assert not job.finished(), job.log()[-6000:]
        assert time.monotonic() < deadline, job.log()[-6000:]
        time.sleep(0.5)
    subprocess.run(["scancel", job.job_id], env=slurm_env, check=True)  # its next start is not this test's
    log = job.log()
    stopped = int(re.search(r"stopped after step (\d+) before the time limit: requeueing job", log).group(1))
    assert 1 <= stopped < 5000
    rank0 = (job.run_dir / "logs" / "rank0.log").read_text()
    assert re.search(r"the job's time limit is \d+s away and one more step with its checkpoint may take \d+s: "
                     rf"stopping after step {stopped} of 5000", rank0), rank0[-4000:]
    assert (job.run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:08d}"
    assert json.loads((job.run_dir / "preempted.json").read_text())["signal"] == "TIME_LIMIT"


@pytest.mark.serial  # bounds a wall-clock wait (KillWait): in the parallel pass, under the other tests' load, the
# ranks' exit (checkpoint, plots) took more than its 5 s twice and the batch step died before its last line
def test_scancel_checkpoints_within_killwait_and_a_resubmission_resumes(slurm_env, tmp_path):
    """`scancel <id>` (as a time limit or a preemption: SIGTERM to every process of every step, SIGKILL
    KillWait seconds later, 5 s on this cluster): the ranks checkpoint the step they are in, the sandbox step
    serves on until training ends, and the batch step outlives them to say so; the job is not requeued. A new
    job with `run_dir=` the first one's resumes there and runs every step exactly once."""
    steps = 6
    overrides = [*TINY, f"num_steps={steps}", "checkpoint.save_every=100"]
    job = Job(slurm_env, tmp_path, "slurm/run.sh", [*GPU_COMPONENT, ":", *CPU_COMPONENT], overrides)
    job.wait_for_steps(2)
    subprocess.run(["scancel", job.job_id], env=slurm_env, check=True)
    job.wait()
    log = job.log()
    assert job.state() == "CANCELLED", log[-6000:]
    marker = json.loads((job.run_dir / "preempted.json").read_text())
    stopped = marker["steps_done"]
    assert marker["signal"] == "SIGTERM" and 2 <= stopped < steps, marker
    assert f"stopped after step {stopped} on SIGTERM; the next start of this job" in log, log[-6000:]
    # said at once, before the ranks' checkpoint: why, the step under way, what is on disk, how to resume
    assert re.search(rf"job {job.job_id} was cancelled \(scancel\) or preempted after RL step ({stopped - 1}|{stopped}) "
                     rf"\(the last one logged\); last complete "
                     rf"checkpoint: (none yet|step_\d+); .* submit again with run_dir={job.run_dir}", log), log[-6000:]
    assert "requeueing" not in log
    assert (job.run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:08d}"
    assert [r["step"] for r in job.metrics()] == list(range(stopped + 1))
    sandbox = "".join(p.read_text() for p in (job.run_dir / "logs").glob("sandbox-c2*.log"))
    assert "got SIGTERM: serving on" in sandbox, sandbox

    (tmp_path / "again").mkdir()
    again = Job(slurm_env, tmp_path / "again", "slurm/run.sh", [*GPU_COMPONENT, ":", *CPU_COMPONENT],
                [*overrides, f"run_dir={job.run_dir}"])
    assert again.wait() == 0, again.log()[-6000:]
    rank0 = (job.run_dir / "logs" / "rank0.log").read_text()
    assert f"resumed from {job.run_dir}/checkpoints/step_{stopped:08d}" in rank0
    assert [r["step"] for r in job.metrics()] == list(range(steps + 1)), "every step exactly once"
    assert not (job.run_dir / "preempted.json").exists()


def test_a_killed_rank_ends_the_job_quickly_and_is_named(slurm_env, tmp_path):
    # GPU nodes only: the sandbox server runs as an --overlap step on c1's spare cores.
    job = Job(slurm_env, tmp_path, "slurm/run_gpu_only.sh", GPU_COMPONENT, [*TINY, "num_steps=200"])
    job.wait_for_steps(1)
    pid = _rank_pid(job.job_id, rank=1)
    assert pid is not None, "rank 1's process not found"
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    code = job.wait(timeout=120)
    took = time.monotonic() - killed
    log = job.log()
    assert code != 0, log[-4000:]
    assert took < 60, f"the job took {took:.0f}s to end after rank 1 died"
    assert re.search(r"training failed: rank 1 on c1 failed first \(Killed\)", log), log[-4000:]
    assert f"Last lines of {job.run_dir}/logs/rank1.log" in log
    assert "nodes c1=train+sandbox" in log, "the sandbox step shared the GPU node"


def test_disaggregated_generator_runs_on_a_node_of_its_own(slurm_env, tmp_path):
    """rollout.generator_nodes=1 on a two-node job: the training step runs on c1 only, the
    generator step on c2, and the generator reaches trainer rank 0 over the network (the hub
    and the weight group at c1's address, found through the run directory)."""
    nodes = ["--partition=debug", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=1",
             "--mem=0", "--time=15"]
    job = Job(slurm_env, tmp_path, "slurm/run_gpu_only.sh", nodes,
              [*TINY, "task=arithmetic", "num_steps=3", "task.sft_warmup_steps=5", "rollout.mode=disaggregated",
               "rollout.generator_nodes=1", "checkpoint.save_every=0"])
    assert job.wait() == 0, job.log()[-6000:]
    log = job.log()
    assert "nodes c1=train, c2=generate" in log
    assert "no sandbox step: the task's rewards run no code" in log  # arithmetic is checked by rule
    assert re.search(r"training step: srun .*--nodelist=c1 --ntasks=1", log), log[-4000:]
    assert re.search(r"generator step: srun .*--nodelist=c2 --ntasks=1", log), log[-4000:]
    assert [r["step"] for r in job.metrics()] == [0, 1, 2, 3]
    assert job.metrics()[1]["rollout/logprob_mismatch"] <= 1e-4  # the generator has the trainer's weights
    generator = (job.run_dir / "logs" / "generator0.log").read_text()
    assert "generator 0 of 1 on c2" in generator and "trainer at c1" in generator
    assert "generator 0 stops at weights v2" in generator
    assert re.search(r"waiting for 1 generator\(s\) started separately .* hub c1:\d+",
                     (job.run_dir / "logs" / "rank0.log").read_text())


def test_a_second_test_cluster_runs_beside_the_first(slurm_env, tmp_path):
    """Two test runs (or a developer's own cluster) on one machine: each cluster has its own state directory
    and free ports, so a second one starts, answers and stops while the first keeps serving."""
    here = REPO / "tests" / "integration" / "slurm"
    second = dict(slurm_env, MEGATRON_RL_SLURM_LAB=str(tmp_path / "lab2"))
    second["SLURM_CONF"] = str(tmp_path / "lab2" / "etc" / "slurm.conf")

    def port(env) -> str:
        return re.search(r"^SlurmctldPort=(\d+)$", Path(env["SLURM_CONF"]).read_text(), re.M).group(1)

    def nodes(env) -> dict[str, str]:
        """node -> state (sinfo -N lists a node once per partition)."""
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True,
                             timeout=30).stdout.split("\n")
        return dict(line.split() for line in out if line.strip())

    proc = subprocess.run(["bash", str(here / "setup.sh")], env=second, capture_output=True, text=True, timeout=300)
    try:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert port(second) != port(slurm_env)
        assert nodes(second) == {"c1": "idle", "c2": "idle"} == nodes(slurm_env)
    finally:
        subprocess.run(["bash", str(here / "teardown.sh")], env=second, timeout=60)
    assert nodes(slurm_env) == {"c1": "idle", "c2": "idle"}  # the first cluster still serves


def test_the_preflight_check_names_what_no_node_can_meet(slurm_env):
    """slurm/run.sh as shipped asks for 2 nodes of 8 GPUs and a 32-CPU, 64 GB sandbox node: the test cluster
    (one 2-GPU node per partition, 2 CPUs each) can never run it, and Slurm would leave it pending. The check
    says which option fails in which component; the sizes the other tests submit pass."""
    import sys

    def check(*options: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "megatron_rl.slurm_check", "--script",
                               str(REPO / "slurm" / "run.sh"), *options], cwd=REPO, env=slurm_env,
                              capture_output=True, text=True, timeout=120)

    shipped = check()
    assert shipped.returncode == 1, shipped.stdout + shipped.stderr
    lines = shipped.stdout.splitlines()
    assert "component 0 (partition gpu): --nodes=2 asks for 2 nodes, the partition has 1 (c1)" in lines
    assert "component 0 (partition gpu): --gpus-per-node=8, but its nodes have at most 2 GPUs" in lines
    assert any(line.startswith("component 1 (partition cpu): --cpus-per-task=32") for line in lines)
    assert any(line.startswith("component 1 (partition cpu): --mem=64G") for line in lines)
    fits = check(*GPU_COMPONENT, ":", *CPU_COMPONENT)
    assert fits.returncode == 0 and "fits" in fits.stdout, fits.stdout + fits.stderr
    wrong = check("--partition=nope")
    assert wrong.returncode == 1 and "no such partition" in wrong.stdout


def _job_pids(job_id: str, marker: bytes) -> list[int]:
    """The pids of this job's processes whose command line holds `marker` (b"\\0" between words)."""
    return [pid for pid, cmdline, _ in _job_processes(job_id) if marker in b"\0".join(cmdline)]


def _kill_sandbox_step(job_id: str) -> None:
    """SIGKILL the sandbox step's server and its `slurm_job sandbox` wrapper. The wrapper may exit on its own
    between the two kills, once its server is gone: a pid already gone is that outcome, not an error. The first
    kill must land, or the test would pass without killing anything."""
    pids = _job_pids(job_id, b"megatron_rl_sandbox.server") + _job_pids(job_id, b"megatron_rl.slurm_job\0sandbox")
    assert pids, "the sandbox step's processes were not found"
    os.kill(pids[0], signal.SIGKILL)
    for pid in pids[1:]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_dead_sandbox_step_is_reported_and_its_discovery_files_go(slurm_env, tmp_path):
    """The het job's sandbox server and its step are SIGKILLed mid-run, leaving their discovery file: the
    supervisor says so in job.log (exit status, the step training had reached), removes the stale file, and
    training goes on with the later samples' rewards left unscored, not scored 0 (quickly: once every server has
    refused connections for 10 s the clients stop waiting out their deadlines). With sandbox.max_restarts=0 the
    step is not started again (the restart is the next test)."""
    job = Job(slurm_env, tmp_path, "slurm/run.sh", [*GPU_COMPONENT, ":", *CPU_COMPONENT],
              [*TINY, "num_steps=3", "task.sft_warmup_steps=30",  # warm: its expressions reach the sandbox
               "sandbox.max_restarts=0"])
    job.wait_for_steps(1)
    assert list((job.run_dir / "sandbox").glob("*.json"))
    _kill_sandbox_step(job.job_id)
    assert job.wait(timeout=400) == 0, job.log()[-6000:]
    log = job.log()
    assert re.search(r"the sandbox step ended with exit code -?\d+ while training ran \(after RL step \d+\).*"
                     r"no restart left", log), log[-6000:]
    assert not list((job.run_dir / "sandbox").glob("*.json")), "the dead server's discovery file stayed"
    rows = job.metrics()
    assert rows[-1]["step"] == 3
    # step 2 may have been scored before the kill landed; step 3 cannot have been
    assert rows[-1]["reward/unscored"] > 0 and rows[-1]["reward/verifier_errors"] > 0
    unscored = sum(r.get("reward/unscored", 0) for r in rows)
    assert f"{unscored:.0f} samples left unscored, no verdict" in log  # the run's summary line says how many


def test_a_dead_sandbox_step_is_restarted_on_its_ports_and_rewards_resume(slurm_env, tmp_path):
    """Killed after RL step 1, the sandbox step is started again 5 s later on the same node and port; the
    ranks' clients, which keep that address, find it serving again, and the last step's rewards are scored
    by it."""
    job = Job(slurm_env, tmp_path, "slurm/run.sh", [*GPU_COMPONENT, ":", *CPU_COMPONENT],
              [*TINY, "num_steps=6", "task.sft_warmup_steps=30"])
    job.wait_for_steps(1)
    address = json.loads(next((job.run_dir / "sandbox").glob("*.json")).read_text())["address"]
    _kill_sandbox_step(job.job_id)
    assert job.wait(timeout=400) == 0, job.log()[-6000:]
    log = job.log()
    assert "restarting it in 5 s (3 restart(s) left)" in log, log[-6000:]
    assert f"sandbox step restarted (1 of 3): servers {address}" in log, log[-6000:]
    last = job.metrics()[-1]
    assert last["step"] == 6 and last["reward/verifier_calls"] > 0 and last["reward/unscored"] == 0, last


@pytest.mark.serial  # it makes its own load; beside the parallel pass's the ranks could not start in time
def test_under_cpu_stress_a_cancelled_job_still_says_why_where_and_how_to_resume(slurm_env, tmp_path):
    """scancel on a box whose cores are all busy: the batch step's line (why the job ends, the step under way,
    the last complete checkpoint, how to resume) is written at once on SIGTERM, before KillWait's SIGKILL, even
    when the ranks' own stop does not finish in time."""
    import sys

    job = Job(slurm_env, tmp_path, "slurm/run.sh", [*GPU_COMPONENT, ":", *CPU_COMPONENT],
              [*TINY, "num_steps=50", "checkpoint.save_every=1"])
    job.wait_for_steps(2)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3 * (os.cpu_count() or 1))]
    try:
        time.sleep(1.0)
        subprocess.run(["scancel", job.job_id], env=slurm_env, check=True)
        job.wait(timeout=300)
    finally:
        for burner in burners:
            burner.kill()
    log = job.log()
    assert re.search(rf"job {job.job_id} was cancelled \(scancel\) or preempted after RL step \d+ \(the last one "
                     rf"logged\); last complete "
                     rf"checkpoint: step_\d+; .* submit again with run_dir={job.run_dir}", log), log[-6000:]


def test_the_apptainer_default_scores_rewards_then_the_eval_and_export_scripts_run(slurm_env, tmp_path):
    """cluster=slurm's sandbox runtime, Apptainer, runs the countdown rewards in the image that sandbox.images
    names (no SANDBOX_SERVER_ARGS); then, submitted from the run's parent directory with a relative --run,
    slurm/eval.sh evaluates the last checkpoint on 2 srun ranks (its countdown rewards in a sandbox server that
    rank 0 starts from the run's sandbox.* settings) and slurm/export.sh writes an HF checkpoint transformers
    loads."""
    import tempfile

    from tests.integration.sandbox_servers import APPTAINER_ROOT, runtime_args

    if runtime_args("apptainer") is None:
        pytest.skip(f"no Apptainer under {APPTAINER_ROOT} (bash tests/integration/apptainer/setup.sh)")
    # the test image's apptainer runs inside bubblewrap with host /tmp bound: workspaces live under /var/tmp
    work = Path(tempfile.mkdtemp(prefix="megatron-rl-slurm-", dir="/var/tmp"))
    os.chmod(work, 0o711)
    env = dict(slurm_env, PATH=f"{APPTAINER_ROOT}:{slurm_env['PATH']}", TMPDIR=str(work))
    overrides = [o for o in TINY if o != "sandbox=bwrap"]
    job = Job(env, tmp_path, "slurm/run_gpu_only.sh", GPU_COMPONENT,
              [*overrides, "num_steps=2", "task.sft_warmup_steps=30", "checkpoint.save_every=2",
               f"+sandbox.images.python={APPTAINER_ROOT / 'image'}"])
    assert job.wait() == 0, job.log()[-6000:]
    sandbox_log = "".join(p.read_text() for p in (job.run_dir / "logs").glob("sandbox-c*.log"))
    assert "(runtime apptainer," in sandbox_log, sandbox_log[-2000:]
    last = job.metrics()[-1]
    # the verify script ran in the container and answered for every candidate: a script that fails there
    # (no python3 in the image, a workspace it cannot reach) leaves its samples unscored, as verifier errors
    assert last["step"] == 2 and last["reward/verifier_calls"] > 0, last
    assert last["reward/unscored"] == 0 and last["reward/verifier_errors"] == 0, last

    run = os.path.relpath(job.run_dir, tmp_path)
    two = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1", "--mem=0", "--time=10"]
    (tmp_path / "eval").mkdir()
    ev = Job(env, tmp_path / "eval", str(REPO / "slurm" / "eval.sh"), two,
             ["--run", run, "--checkpoints", "latest", "--seeds", "1", "--name", "slurm", "--resamples", "200"],
             cwd=tmp_path)
    assert ev.wait() == 0, ev.log()[-6000:]
    out = job.run_dir / "eval" / "slurm"
    summary = json.loads((out / "summary.json").read_text())
    assert [c["step"] for c in summary["checkpoints"]] == [2]
    records = (out / "records.jsonl").read_text().splitlines()
    assert len(records) == 8  # task.num_eval prompts x task.eval_samples x 1 seed, gathered from both ranks
    assert (out / "logs" / "rank0.log").exists() and (out / "logs" / "rank1.log").exists()
    assert "local sandbox server (apptainer)" in (out / "logs" / "rank0.log").read_text()

    (tmp_path / "export").mkdir()
    ex = Job(env, tmp_path / "export", str(REPO / "slurm" / "export.sh"), two, ["--run", run], cwd=tmp_path)
    assert ex.wait() == 0, ex.log()[-6000:]
    exported = job.run_dir / "hf" / "step_00000002"
    assert f"to {exported}" in ex.log() or f"to {os.path.relpath(exported, tmp_path)}" in ex.log(), ex.log()[-3000:]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(exported)
    assert sum(p.numel() for p in model.parameters()) > 0
