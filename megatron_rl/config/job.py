"""The job's services and outputs: `sandbox.*`, `cluster.*`, `logging.*`, `checkpoint.*`.

Each dataclass checks its own fields in ``__post_init__`` (see megatron_rl/config/schema.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from megatron_rl.checks import check_choice as _check_choice
from megatron_rl.checks import check_min as _check_min
from megatron_rl.checks import invalid as _invalid


@dataclass
class SandboxConfig:
    """Isolation runtime for executing model-written code during reward computation."""

    runtime: str = "bwrap"
    """bwrap (bubblewrap namespaces), apptainer (container) or process (NO isolation)."""
    address: Optional[str] = None
    """host:port of a remote sandbox service; null runs sandboxes locally."""
    num_workers: int = 2
    """Concurrent sandboxed executions."""
    images: dict[str, str] = field(default_factory=dict)
    """Images the sandbox servers run code in, name: path (apptainer: a .sif file or sandbox directory, e.g.
    built from docs/examples/python.def; bwrap: a root filesystem directory, besides the host's own `host`
    image). The first is the one tasks use. Set one as `sandbox.images.python=/shared/images/python.sif`."""
    allow_unisolated: bool = False
    """Explicit opt-in required for runtime=process, which runs untrusted code unsandboxed."""

    max_restarts: int = 3
    """Slurm jobs: times the sandbox step is started again when it dies during training (after 5, 10, 20...
    s, on the same ports; 0: never)."""

    RUNTIMES: ClassVar[tuple[str, ...]] = ("bwrap", "apptainer", "process")

    def __post_init__(self) -> None:
        _check_choice("sandbox.runtime", self.runtime, self.RUNTIMES)
        if self.runtime == "process" and not self.allow_unisolated:
            raise ValueError(
                "sandbox.runtime=process is invalid without sandbox.allow_unisolated=true: it runs "
                "model-written code with no isolation; use sandbox=bwrap or sandbox=apptainer, "
                "or pass sandbox.allow_unisolated=true to accept the risk"
            )
        _check_min("sandbox.num_workers", self.num_workers, 1)
        for name in self.images:
            if not name or not all(c.isalnum() or c in "-_." for c in name):
                raise _invalid(f"sandbox.images.{name}", self.images[name], "an image name is letters, digits, "
                               "'-', '_' and '.'")
        _check_min("sandbox.max_restarts", self.max_restarts, 0)


@dataclass
class ClusterConfig:
    """How processes are launched and which device they use."""

    launcher: str = "local"
    """local (this command spawns the ranks), torchrun or slurm."""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu or cuda."""
    nproc: int = 1
    """Processes the local launcher starts."""
    master_port: Optional[int] = None
    """Rendezvous port; null picks a free one."""

    LAUNCHERS: ClassVar[tuple[str, ...]] = ("local", "torchrun", "slurm")
    DEVICES: ClassVar[tuple[str, ...]] = ("auto", "cpu", "cuda")

    def __post_init__(self) -> None:
        _check_choice("cluster.launcher", self.launcher, self.LAUNCHERS)
        _check_choice("cluster.device", self.device, self.DEVICES)
        _check_min("cluster.nproc", self.nproc, 1)
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise _invalid(
                "cluster.master_port", self.master_port, "must lie in [1, 65535] or be null (pick a free port)"
            )


@dataclass
class LoggingConfig:
    """Log verbosity and metric sinks."""

    level: str = "INFO"
    """Python log level on rank 0: DEBUG, INFO, WARNING or ERROR."""
    tensorboard: bool = True
    """Write metrics to TensorBoard under run_dir."""
    wandb: bool = False
    """Also send metrics to Weights & Biases (needs `pip install -e '.[wandb]'`; WANDB_MODE=offline
    on clusters without internet access)."""
    wandb_project: str = "megatron-rl"
    """W&B project."""
    wandb_entity: Optional[str] = None
    """W&B entity (team or user); null: the account's default."""
    wandb_name: Optional[str] = None
    """W&B run name; null: the run directory's name."""
    log_every: int = 1
    """Steps between the one-line console summaries (1: every step; the first and the last step always have
    one); metrics.jsonl and TensorBoard get every step."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    audit_every: int = 0
    """RL steps between reward audits: the step's top trajectories with shortcut flags to
    run_dir/audit/ (megatron_rl/rewards/audit.py); 0: off."""
    audit_samples: int = 8
    """Trajectories written per audit."""
    trace_every: int = 0
    """RL steps between Chrome traces of a step's timeline (phases, generation batches, environment
    waits) in run_dir/traces/ (open in https://ui.perfetto.dev); 0: off."""
    dump_rollouts: bool = False
    """Write every RL step's samples (tokens, engine log-probs, rewards, statuses, decoded text) to
    run_dir/rollouts/step_<k>.jsonl, for reading and for rollout.replay_dir."""

    LEVELS: ClassVar[tuple[str, ...]] = ("DEBUG", "INFO", "WARNING", "ERROR")

    def __post_init__(self) -> None:
        _check_choice("logging.level", self.level, self.LEVELS)
        _check_min("logging.log_every", self.log_every, 1)
        _check_min("logging.audit_every", self.audit_every, 0)
        _check_min("logging.audit_samples", self.audit_samples, 1)
        _check_min("logging.trace_every", self.trace_every, 0)


@dataclass
class CheckpointConfig:
    """Training checkpoints under run_dir/checkpoints and HF exports under run_dir/hf."""

    save_every: int = 20
    """Optimizer steps between training checkpoints; 0 saves only at the end (see save_at_end)."""
    save_at_end: bool = True
    """Write a checkpoint after the last step."""
    keep_last: int = 2
    """How many of the most recent checkpoints to keep."""
    keep_every: Optional[int] = None
    """Also keep every checkpoint whose step is a multiple of this (null: none)."""
    keep_best: int = 0
    """Also keep the checkpoints with the best best_metric, this many (0: none); checkpoints/best names the
    best one (`--checkpoint best` of megatron_rl.export / megatron_rl.eval)."""
    best_metric: str = "eval/accuracy"
    """keep_best: a metric of the step a checkpoint is saved after (metrics.jsonl)."""
    best_mode: str = "max"
    """keep_best: max (higher is better) or min."""
    resume: bool = True
    """Resume from run_dir/checkpoints when it holds a complete checkpoint."""
    stop_before_time_limit: bool = True
    """In a Slurm job with a time limit: stop after the last step that leaves time for one more step and its
    checkpoint (the longest step and save this run measured, plus a minute), checkpoint, and requeue the job,
    which resumes; a job killed at its limit is not requeued and loses the steps since its last checkpoint.
    Rank 0 asks `scontrol show job` for the end every 5 minutes. false: only `--signal=B:USR1@N` stops early."""
    hf_export_every: int = 0
    """Optimizer steps between HF safetensors exports; 0 never exports periodically."""
    hf_export_at_end: bool = False
    """Export an HF checkpoint after the last step."""
    hf_max_shard_size: str = "5GB"
    """Largest safetensors shard of an HF export (e.g. 5GB, 500MB)."""

    def __post_init__(self) -> None:
        _check_min("checkpoint.save_every", self.save_every, 0)
        _check_min("checkpoint.keep_last", self.keep_last, 1)
        if self.keep_every is not None:
            _check_min("checkpoint.keep_every", self.keep_every, 1)
        _check_min("checkpoint.hf_export_every", self.hf_export_every, 0)
        _check_min("checkpoint.keep_best", self.keep_best, 0)
        _check_choice("checkpoint.best_mode", self.best_mode, ("max", "min"))
        if self.keep_best and self.save_every < 1:
            raise _invalid("checkpoint.keep_best", self.keep_best, "chooses among periodic checkpoints: set "
                           "checkpoint.save_every >= 1")
