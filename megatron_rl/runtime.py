"""Start-up shared by the entry points: command line -> validated config -> processes ->
process groups -> run directory, logging and metrics.

The order is the contract: the whole configuration is composed, typed and validated
(including what an HF checkpoint's config.json says about the architecture) before any
process group, model or file exists, so a bad setting costs seconds and writes nothing.
With `cluster.launcher=local` and `cluster.nproc > 1`, the first process becomes a small
launcher that starts one worker per rank, forwards stop signals (SIGUSR1/SIGTERM: checkpoint
and stop, see `megatron_rl.preemption`) to them, and stops them all when one fails, naming
that rank and the last lines of its log. Under Slurm, `srun` starts the ranks and
`megatron_rl.slurm_job` plays the launcher's part.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

logger = logging.getLogger(__name__)

HYDRA_FLAGS = ("--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--multirun", "-m",
               "--resolve", "--package", "-p", "--shell-completion", "-sc", "--config-dir", "-cd",
               "--config-name", "-cn", "--config-path", "-cp", "--run", "-r")


class Runtime:
    """What an entry point gets after start-up (every rank has one)."""

    def __init__(self, cfg, env, groups, run_dir: Path, writer, device=None) -> None:
        from megatron_rl.preemption import JobDeadline, Preemption, slurm_job_end

        self.cfg = cfg
        self.env = env
        self.groups = groups
        self.run_dir = run_dir
        self.writer = writer
        self.device = device
        deadline = JobDeadline(slurm_job_end) if cfg.checkpoint.stop_before_time_limit else None
        self.preemption = Preemption(run_dir, env.rank == 0, device, deadline).install()

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    def close(self) -> None:
        from megatron_rl.rewards.service import stop_local_sandbox

        self.writer.close()
        stop_local_sandbox(getattr(self, "sandbox_proc", None))


def sandbox_addresses(rt: Runtime, timeout_s: float = 120.0) -> list[str]:
    """The sandbox servers of this run: `sandbox.address`, the servers registered under
    `<run_dir>/sandbox/` (e.g. by the Slurm script), or one that rank 0 starts here."""
    import torch.distributed as dist

    from megatron_rl.rewards.service import start_local_sandbox
    from megatron_rl_sandbox.client import discover, prune_unreachable

    cfg = rt.cfg.sandbox
    if cfg.address:
        return [a.strip() for a in cfg.address.split(",") if a.strip()]
    # Rank 0 alone decides whether to start one, and every rank passes the barrier: a rank that
    # looked after rank 0's server registered must not skip a collective the others are in.
    if rt.is_main:
        prune_unreachable(rt.run_dir)  # a killed server's file names nobody
    if rt.is_main and not discover(rt.run_dir):
        rt.sandbox_proc, _ = start_local_sandbox(rt.run_dir, cfg.runtime, cfg.allow_unisolated,
                                                 capacity=cfg.num_workers, images=cfg.images)
    if dist.is_initialized():
        dist.barrier()
    deadline = time.monotonic() + timeout_s
    while not (found := discover(rt.run_dir)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no sandbox server registered under {rt.run_dir / 'sandbox'}")
        time.sleep(0.2)
    return found


def load_validated(overrides: Sequence[str], world_size: int | Callable[[Any], int]):
    """Compose + type the config, fill the architecture from `model.path`, and run the one checking pass
    (megatron_rl/config/checks/) for `world_size` ranks (or `world_size(cfg)`, when the config decides how
    many of the job's tasks train); raises ConfigError."""
    from megatron_rl.config import validate
    from megatron_rl.config.checks import config_warnings
    from megatron_rl.parallel.dist import dist_env_from

    cfg = load_resolved(overrides)
    validate(cfg, world_size(cfg) if callable(world_size) else world_size)
    if dist_env_from().rank == 0:  # once per job, not once per rank
        for warning in config_warnings(cfg):
            print(f"config warning: {warning}", file=sys.stderr)
    return cfg


def load_resolved(overrides: Sequence[str]):
    """The typed config with the architecture a run uses: `model.*` read from `model.path`'s config.json
    (which overrides the preset's), every checkpoint tensor accounted for. Not validated otherwise."""
    from megatron_rl.config import ConfigError, compose, to_typed

    cfg = to_typed(compose(overrides))
    path = cfg.model.path
    if path and (Path(path) / "config.json").is_file():
        from megatron_rl.checkpoint.hf import arch_from_hf_config, check_tensor_names

        try:
            arch = arch_from_hf_config(path)
        except ValueError as exc:
            raise ConfigError(f"model.path={path}: {exc}") from None
        if arch["family"] != cfg.model.family:
            raise ConfigError(f"model.path={path}: {Path(path) / 'config.json'} is a {arch['family']} model but "
                              f"model.family={cfg.model.family}; pick the matching model config "
                              f"(e.g. model=tiny_{arch['family']}) or set model.family={arch['family']}")
        try:
            cfg.model = dataclasses.replace(cfg.model, **arch)
        except ValueError as exc:  # an architecture this build cannot run (e.g. rope scaling Megatron fixes)
            raise ConfigError(f"model.path={path}: {Path(path) / 'config.json'}: {exc}") from None
        try:  # every tensor read or ignored by name, none missing: found before a run directory exists
            check_tensor_names(path, cfg.model)
        except ValueError as exc:
            raise ConfigError(f"model.path={path}: {exc}") from None
    return cfg


def print_job_config(overrides: Sequence[str]) -> bool:
    """`--cfg job`: the config a run would use, `model.*` from `model.path`'s config.json (Hydra's own print
    shows the preset's architecture, e.g. llama3_8b's 32 layers for any Llama checkpoint). False when the
    overrides do not resolve (a missing model.path, a bad checkpoint): the caller falls back to Hydra's."""
    from omegaconf import OmegaConf

    from megatron_rl.config import ConfigError

    try:
        cfg = load_resolved(overrides)
    except (ConfigError, ValueError) as exc:
        print(f"(the model.* keys below are the preset's, not a checkpoint's: {exc})", file=sys.stderr)
        return False
    if cfg.model.path:
        print(f"# model.* as read from {Path(cfg.model.path) / 'config.json'}")
    print(OmegaConf.to_yaml(OmegaConf.structured(cfg)), end="")
    return True


def _world_size_for(cfg) -> int:
    """How many ranks train: the launcher's (torchrun, srun) when this process is one of its tasks,
    else `cluster.nproc` for the local launcher."""
    from megatron_rl.parallel.dist import dist_env_from

    env = dist_env_from()
    if env.source != "single":
        return env.world_size
    return cfg.cluster.nproc if cfg.cluster.launcher == "local" else 1


def run_hydra_cli(argv: Sequence[str], config_name: str = "config") -> None:
    """Hand Hydra's own flags (`--cfg job`, `--help`, `-m`) to Hydra unchanged."""
    import hydra

    import megatron_rl.config  # noqa: F401  (registers the schemas)
    from megatron_rl.config.loader import CONF_DIR

    @hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")
    def _app(cfg) -> None:  # only reached with --multirun; not a supported way to train yet
        raise SystemExit("use one job per sbatch/launch; Hydra multirun is not supported for training")

    sys.argv = [sys.argv[0], *argv]
    _app()


def start(argv: Sequence[str], job_name: str) -> Optional[Runtime]:
    """Validate, then become a rank (or the local launcher: returns None when workers are done)."""
    from megatron_rl.config import ConfigError

    if any(a.split("=")[0] in HYDRA_FLAGS for a in argv):
        rest = [a for a in argv if a not in ("--cfg", "-c", "job")]
        asks_job = any(a in ("--cfg", "-c") for a in argv) and "job" in argv and len(rest) == len(argv) - 2
        if not (asks_job and not any(a.split("=")[0] in HYDRA_FLAGS for a in rest) and print_job_config(rest)):
            run_hydra_cli(argv)
        return None
    overrides = list(argv)
    try:
        cfg = load_validated(overrides, _world_size_for)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return start_with_config(cfg, overrides, job_name)


def start_with_config(cfg, argv: Sequence[str], job_name: str) -> Optional[Runtime]:
    """The rest of `start` for an entry point that built and validated `cfg` itself (offline
    evaluation reads a run's config.yaml): become a rank, or launch the local workers, which
    run `python -m <job_name> <argv> run_dir=<cfg.run_dir>`."""
    from megatron_rl.parallel.dist import dist_env_from

    overrides = list(argv)
    env = dist_env_from()
    if cfg.cluster.launcher == "slurm" and env.source == "single":
        print("config error: cluster.launcher=slurm but this process was not started by srun (no SLURM_PROCID/"
              "SLURM_NTASKS): submit with `sbatch slurm/run.sh ...`, or use cluster=local here", file=sys.stderr)
        raise SystemExit(2)
    if env.source == "single" and cfg.cluster.launcher == "local" and cfg.cluster.nproc > 1:
        _launch_local(cfg, overrides, job_name)
        return None
    return _become_rank(cfg, env, job_name)


def _resolved_run_dir(cfg) -> str:
    return str(Path(cfg.run_dir).resolve())


def _launch_local(cfg, overrides: list[str], job_name: str) -> None:
    """Start `cluster.nproc` workers on this machine; the first failure stops all of them."""
    from megatron_rl.parallel.dist import free_port

    nproc = cfg.cluster.nproc
    port = cfg.cluster.master_port or free_port()
    run_dir = _resolved_run_dir(cfg)  # one run dir for all ranks, fixed before they start
    args = [*[o for o in overrides if not o.startswith("run_dir=")], f"run_dir={run_dir}"]
    procs: list[subprocess.Popen] = []

    def forward(signum: int, _frame) -> None:  # stop requests (megatron_rl.preemption) go to every worker
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, forward)
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        procs.append(subprocess.Popen([sys.executable, "-m", job_name, *args], env=env))
    failed = _wait_all(procs)
    if failed is not None:
        rank, code = failed
        log = Path(run_dir) / "logs" / f"rank{rank}.log"
        print(f"rank {rank} exited with code {code}; stopped the other ranks. Last lines of {log}:\n"
              f"{log_tail(log)}", file=sys.stderr)
        raise SystemExit(code if code > 0 else 1)


def log_tail(path: Path, num_lines: int = 20) -> str:
    """The last lines of a log file (for failure reports), or why there are none."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError as exc:
        return f"  (no log: {exc})"
    return "\n".join(f"  | {line}" for line in lines[-num_lines:]) or "  (the log is empty)"


def _log_uncaught(exc_type, exc, tb) -> None:
    """Put a rank's fatal exception into its own log too, where failure reports look."""
    if not issubclass(exc_type, KeyboardInterrupt):
        # The console handler prints it too (every rank logs CRITICAL to stderr).
        logging.getLogger("megatron_rl").critical("uncaught exception, this rank stops", exc_info=(exc_type, exc, tb))
    else:
        sys.__excepthook__(exc_type, exc, tb)


def _wait_all(procs: list[subprocess.Popen]) -> Optional[tuple[int, int]]:
    while True:
        codes = [p.poll() for p in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                for other in procs:
                    if other.poll() is None:
                        other.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 10
                for other in procs:
                    try:
                        other.wait(timeout=max(0.1, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        other.kill()
                return rank, code
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.2)


# Warnings megatron-core raises on every CPU start (no TE/Apex/CUDA there by design).
_EXPECTED_CPU_WARNINGS = (
    r".*(Transformer Engine|Apex)( and Apex)? (is|are) not installed.*",
    r".*CUDA_DEVICE_MAX_CONNECTIONS.*",
    r".*full scope is deprecated.*",
)


def _become_rank(cfg, env, job_name: str) -> Runtime:
    import warnings

    import torch
    import torch.distributed as dist

    from megatron_rl.observability import MetricsWriter, init_logger
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.preemption import MARKER

    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # no INFO lines from gRPC's fork handlers
    device = mdist.resolve_device(cfg.cluster.device, env.local_rank)
    if device.type == "cpu":
        for pattern in _EXPECTED_CPU_WARNINGS:
            warnings.filterwarnings("ignore", message=pattern)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    mdist.init_distributed(env, device)
    run_dir = [_resolved_run_dir(cfg)]
    if env.world_size > 1:  # `${now:...}` may differ by a second between ranks: rank 0 decides
        dist.broadcast_object_list(run_dir, src=0)
    run_path = Path(run_dir[0])
    cfg.run_dir = str(run_path)
    (run_path / "logs").mkdir(parents=True, exist_ok=True)
    init_logger(env.rank, cfg.logging.level, run_path / "logs" / f"rank{env.rank}.log")
    sys.excepthook = _log_uncaught
    if cfg.logging.level != "DEBUG":  # megatron-core logs whole config objects at INFO
        logging.getLogger("megatron.core").setLevel(logging.WARNING)
    if env.rank == 0:
        _save_config(cfg, run_path)
        (run_path / MARKER).unlink(missing_ok=True)  # a stop record is about the previous start
    groups = state.initialize(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp, ep=cfg.parallel.ep,
                              etp=cfg.parallel.expert_tp(cfg.model), sequence_parallel=cfg.parallel.sequence_parallel,
                              seed=cfg.seed, device=device)
    writer = MetricsWriter(run_path, enabled_tensorboard=cfg.logging.tensorboard, rank=env.rank,
                           wandb_init=_wandb_init(cfg, run_path) if cfg.logging.wandb else None)
    logger.info("%s: run directory %s", job_name, run_path)
    return Runtime(cfg, env, groups, run_path, writer, device)


def _wandb_init(cfg, run_dir: Path) -> dict:
    from omegaconf import OmegaConf

    return {"project": cfg.logging.wandb_project, "entity": cfg.logging.wandb_entity,
            "name": cfg.logging.wandb_name or run_dir.name,
            "config": OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)}


def _save_config(cfg, run_dir: Path) -> None:
    from omegaconf import OmegaConf

    OmegaConf.save(OmegaConf.structured(cfg), run_dir / "config.yaml")


def finish(rt: Runtime) -> None:
    import torch.distributed as dist

    from megatron_rl.parallel import state

    rt.close()
    state.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
