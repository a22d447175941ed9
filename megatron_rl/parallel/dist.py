"""Process topology and torch.distributed start-up; the only module that names devices and backends.

Ranks and the rendezvous address come from (in order) torchrun-style variables
(`RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT`, also set by our local launcher),
Slurm variables (`SLURM_PROCID`/`SLURM_NTASKS`/`SLURM_STEP_NODELIST`), or nothing
(a single process). Slurm's compressed node lists are expanded here in Python
so that no rank shells out to `scontrol` in start-up.

torch is imported by the functions that use it, not by this module: the local launcher and the
config checks read ranks, node lists and ports here without loading torch (~2 s of CPU a process).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import random
import re
import socket
from typing import TYPE_CHECKING, Mapping, Optional

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

logger = logging.getLogger(__name__)

DEFAULT_PORT_BASE = 29500


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "single"


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list: `gpu[01-03,07],cpu1` -> gpu01 gpu02 gpu03 gpu07 cpu1.

    Zero padding of ranges is kept (`n[08-10]` -> n08 n09 n10). Nested brackets are not
    part of Slurm's syntax for host names and are rejected.
    """
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if match is None:
            if "[" in item or "]" in item:
                raise ValueError(f"cannot parse Slurm node list {nodelist!r} at {item!r}")
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        if "[" in suffix:
            raise ValueError(f"cannot parse Slurm node list {nodelist!r}: more than one bracket in {item!r}")
        for part in ranges.split(","):
            if "-" in part:
                lo, hi = part.split("-", 1)
                width = len(lo)
                for i in range(int(lo), int(hi) + 1):
                    hosts.append(f"{prefix}{i:0{width}d}{suffix}")
            else:
                hosts.append(f"{prefix}{part}{suffix}")
    return hosts


# Where a Slurm job's rendezvous port lies: below Linux's default ephemeral range (32768-60999), whose ports any
# process's outgoing connection may hold on rank 0's node (EADDRINUSE when the store binds: `free_port`), and
# below SGLang's default ports (30000 and up).
SLURM_PORT_RANGE = (20000, 30000)


def _slurm_port(environ: Mapping[str, str]) -> int:
    if "MASTER_PORT" in environ:
        return int(environ["MASTER_PORT"])
    # Every rank computes it alone, so it comes from the job id (several jobs may share a node: theirs differ);
    # the same on every start of a requeued job.
    job_id = int(environ.get("SLURM_JOB_ID", "0"))
    lo, hi = SLURM_PORT_RANGE
    return lo + job_id % (hi - lo)


def dist_env_from(environ: Mapping[str, str] = os.environ) -> DistEnv:
    """Read this process's rank, world and rendezvous address from the environment."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        world = int(environ["WORLD_SIZE"])
        return DistEnv(
            rank=int(environ["RANK"]),
            world_size=world,
            local_rank=int(environ.get("LOCAL_RANK", environ["RANK"])),
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", world)),
            master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(environ.get("MASTER_PORT", DEFAULT_PORT_BASE)),
            source="torchrun",
        )
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
        hosts = expand_nodelist(nodelist) if nodelist else ["127.0.0.1"]
        tasks_per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE", "1")
        local_world = int(re.match(r"\d+", tasks_per_node).group(0))
        return DistEnv(
            rank=int(environ["SLURM_PROCID"]),
            world_size=int(environ["SLURM_NTASKS"]),
            local_rank=int(environ.get("SLURM_LOCALID", "0")),
            local_world_size=local_world,
            master_addr=environ.get("MASTER_ADDR", hosts[0]),
            master_port=_slurm_port(environ),
            source="slurm",
        )
    return DistEnv(0, 1, 0, 1, "127.0.0.1", int(environ.get("MASTER_PORT", 0)) or free_port(), "single")


_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in open(_EPHEMERAL_RANGE_FILE).read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free right now, chosen outside the kernel's ephemeral range.

    The caller binds it later (a rendezvous store, a server in another process). A port the kernel
    handed out with bind(0) lies in the ephemeral range, and until the caller binds it any process's
    outgoing connection may take it as its local port: with several jobs or test workers on a node,
    gloo and gRPC connections did (EADDRINUSE at init_process_group). Ports outside the range are
    never given to outgoing connections; a random one is tried until a bind succeeds, so two callers
    at once collide only when they draw the same port.
    """
    lo, hi = _ephemeral_range()
    candidates = [(10000, lo - 1), (hi + 1, 65535)]
    candidates = [(a, b) for a, b in candidates if b - a >= 1000]
    rng = random.SystemRandom()
    for _ in range(64 if candidates else 0):
        a, b = rng.choice(candidates)
        port = rng.randint(a, b)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a node that reserves the rest
        s.bind((host, 0))
        return s.getsockname()[1]


def resolve_device(requested: str, local_rank: int = 0) -> torch.device:
    """`auto` picks the GPU of this local rank when CUDA is present, else the CPU."""
    import torch

    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"cluster.device={requested!r} is invalid: use auto, cpu or cuda")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("cluster.device=cuda but no CUDA device is visible: use cluster.device=cpu or auto")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(env: DistEnv, device: torch.device, timeout_s: float = 600.0) -> None:
    """Join the default process group (gloo on CPU, NCCL on GPU); idempotent."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    dist.init_process_group(
        backend=backend_for(device),
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    logger.info("joined process group: rank %d/%d via %s (%s)", env.rank, env.world_size,
                env.source, backend_for(device))


def all_reduce_cpu_scalars(values: list[float], group: Optional[dist.ProcessGroup] = None,
                           device: Optional[torch.device] = None) -> list[float]:
    """Sum a few Python floats over a group (metrics); a no-op without torch.distributed."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device or "cpu")
    dist.all_reduce(t, group=group)
    return t.tolist()


def weight_update_store(host: str, port: int, world_size: int, is_master: bool,
                        timeout_s: float = 600.0) -> dist.TCPStore:
    """The rendezvous store of a weight-update group (rank 0, the trainer, hosts it).

    The store takes any client without credentials (what goes into it is authenticated by
    megatron_rl/disagg/weights.py). A master at a loopback address listens on the loopback only:
    TCPStore itself binds every interface whatever `host` is, so it is handed a socket bound here."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    loopback = "127.0.0.1" if host == "localhost" else host if host.startswith("127.") or host == "::1" else None
    if is_master and loopback is not None:
        listener = socket.socket(socket.AF_INET6 if loopback == "::1" else socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((loopback, port))
            listener.listen(socket.SOMAXCONN)
        except OSError:
            listener.close()
            raise
        return dist.TCPStore(host, listener.getsockname()[1], world_size, is_master=True, wait_for_workers=False,
                             timeout=timeout, master_listen_fd=listener.detach())
    return dist.TCPStore(host, port, world_size, is_master=is_master, wait_for_workers=False, timeout=timeout)


class WeightUpdateGroup:
    """A process group of its own between the trainer's weight-owning rank (rank 0) and the
    generator processes of disaggregated mode (ranks 1..G).

    It is built directly on its own TCPStore (a `ProcessGroupGloo` / `ProcessGroupNCCL` object,
    never registered with torch.distributed), so the default group and Megatron's groups
    neither see nor wait for it, and a generator process never joins them. gloo on CPU, NCCL
    on GPU (SGLang's `init_weights_update_group` builds the same kind of group). The NCCL
    branch is not exercised on this CPU-only machine.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device,
                 timeout_s: float = 600.0) -> None:
        import torch.distributed as dist

        self.rank, self.world_size, self.device = rank, world_size, device
        prefixed = dist.PrefixStore("weight_update_group", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend_for(device) == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In place on every member; blocks until every member has joined this broadcast."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = src
        self.pg.broadcast([tensor], options).wait()


def generator_device(requested: str, index: int, num_local_trainer_ranks: int, tp: int = 1) -> torch.device:
    """The first device of disaggregated generator `index` (its engine spans `tp` GPUs from there): the CPU,
    or the GPUs after the trainer's local ranks, generator i on num_local_trainer_ranks + i * tp onwards.
    A node without that many GPUs is refused: a generator on a trainer rank's GPU (NCCL refuses two ranks
    of one group on a device) or on another generator's would fail later, less clearly."""
    import torch

    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    gpu = generator_gpu(index, num_local_trainer_ranks, tp, torch.cuda.device_count())
    torch.cuda.set_device(gpu)
    return torch.device("cuda", gpu)


def generator_gpu(index: int, num_local_trainer_ranks: int, tp: int, device_count: int) -> int:
    """`generator_device`'s GPU index on a node of `device_count` GPUs (RuntimeError when they run out)."""
    gpu = num_local_trainer_ranks + index * tp
    if gpu + tp > device_count:
        raise RuntimeError(f"generator {index} needs GPUs {gpu}..{gpu + tp - 1} (after the trainer's "
                           f"{num_local_trainer_ranks} local ranks, rollout.tp={tp} GPUs each), but this node has "
                           f"{device_count}: run fewer trainer ranks or generators here, or the generators on nodes "
                           "of their own (rollout.generator_nodes)")
    return gpu
