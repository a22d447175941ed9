"""The only module that calls Megatron's `parallel_state`: builds the TP/PP/CP/DP (and expert
EP / expert-TP) groups once and hands them to the rest of the framework as an explicit
`ParallelGroups` value; also the per-node blocks of ranks that share one rollout engine
(`rollout_block`)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """This rank's coordinates in the parallel layout and the groups it talks to."""

    rank: int
    world_size: int
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    cp_size: int
    cp_rank: int
    dp_size: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup  # ranks that split each packed row between them (context parallel)
    dp_group: dist.ProcessGroup
    dp_cp_group: dist.ProcessGroup
    mp_group: dist.ProcessGroup  # TP x PP: ranks that hold one copy of the model together
    pp_last_rank: int  # global rank of the last stage of this rank's pipeline
    sequence_parallel: bool
    device: torch.device
    # Experts: split over `ep_size` ranks carved out of the data-parallel ranks (with an expert
    # tensor-parallel size below tp, of the tensor-parallel ranks too); within an expert, split over the
    # expert tensor-parallel group (size `etp`: tp, or 1 for gpt-oss).
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: Optional[dist.ProcessGroup] = None
    etp_size: int = 1
    etp_rank: int = 0
    etp_group: Optional[dist.ProcessGroup] = None

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_first_model_parallel_rank(self) -> bool:
        """First rank of its TP x PP x CP group: the one that speaks for the group's data-parallel share."""
        return self.tp_rank == 0 and self.pp_rank == 0 and self.cp_rank == 0


def initialize(tp: int, pp: int, cp: int = 1, *, ep: int = 1, etp: Optional[int] = None,
               sequence_parallel: bool = False, seed: int = 1234,
               device: Optional[torch.device] = None) -> ParallelGroups:
    """Create Megatron's model-parallel groups over the default process group and seed its RNGs;
    `etp` is the expert tensor-parallel size (None: tp).

    The default process group must exist (see `megatron_rl.parallel.dist.init_distributed`).
    On a machine without CUDA the megatron-core CPU compatibility layer is switched on first.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_rl.parallel import cpu_compat

    device = device or torch.device("cpu")
    if device.type == "cpu":
        cpu_compat.activate(force=True)
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}")
    etp = tp if etp is None else etp
    if world % (etp * ep * pp):
        raise ValueError(f"world size {world} is not divisible by etp*ep*pp = {etp}*{ep}*{pp}")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    groups = ParallelGroups(
        rank=dist.get_rank(),
        world_size=world,
        tp_size=ps.get_tensor_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        cp_group=ps.get_context_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        mp_group=ps.get_model_parallel_group(),
        pp_last_rank=ps.get_pipeline_model_parallel_last_rank(),
        sequence_parallel=sequence_parallel,
        device=device,
        ep_size=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_group=ps.get_expert_model_parallel_group(),
        etp_size=ps.get_expert_tensor_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp_group=ps.get_expert_tensor_parallel_group(),
    )
    logger.info("parallel layout: tp=%d pp=%d cp=%d dp=%d ep=%d (world %d)", groups.tp_size, groups.pp_size,
                groups.cp_size, groups.dp_size, groups.ep_size, world)
    return groups


def destroy() -> None:
    """Tear down Megatron's groups (the default process group stays)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


@dataclasses.dataclass(frozen=True)
class RolloutBlock:
    """This rank's block of `size` ranks on one node that share one rollout engine (inference
    TP size `size`): the block's first local rank (the leader) owns the engine, the others
    forward their requests and weight buckets to it over `group`."""

    size: int
    index: int  # position in the block; 0 is the leader
    ranks: tuple[int, ...]  # global ranks of the block, leader first
    leader_local_rank: int  # the leader's local rank: its engine starts on this GPU (base_gpu_id)
    group: Optional[dist.ProcessGroup]  # CPU (gloo) group of the block; None when size == 1

    @property
    def is_leader(self) -> bool:
        return self.index == 0

    @property
    def leader(self) -> int:
        return self.ranks[0]


def rollout_block(size: int, local_rank: int, local_world_size: int) -> RolloutBlock:
    """Group the ranks of each node in blocks of `size` consecutive local ranks and create one
    process group per block. Collective over the default group (every rank must call it, with
    the same `size`); with `size == 1` it creates nothing.

    The block groups are gloo groups whatever the device: they carry small Python objects
    (prompts, results, CUDA-IPC handles), never tensor data.
    """
    if size < 1 or local_world_size % size:
        raise ValueError(f"rollout.tp={size} must divide the {local_world_size} ranks per node: "
                         f"blocks of rollout.tp local ranks share one engine")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if size == 1:
        return RolloutBlock(1, 0, (rank,), local_rank, None)
    import socket

    members: list = [None] * dist.get_world_size()
    dist.all_gather_object(members, (socket.gethostname(), local_rank, rank))
    by_host: dict[str, list[tuple[int, int]]] = {}
    for host, local, global_rank in members:
        by_host.setdefault(host, []).append((local, global_rank))
    blocks: list[tuple[int, ...]] = []
    leaders: list[int] = []
    for host in sorted(by_host):
        node = sorted(by_host[host])
        if len(node) % size:
            raise ValueError(f"node {host} runs {len(node)} ranks, not a multiple of rollout.tp={size}")
        for start in range(0, len(node), size):
            blocks.append(tuple(g for _, g in node[start:start + size]))
            leaders.append(node[start][0])
    mine = None
    for ranks, leader_local in zip(blocks, leaders):
        group = dist.new_group(list(ranks), backend="gloo")  # collective: every rank creates every group
        if rank in ranks:
            mine = RolloutBlock(size, ranks.index(rank), ranks, leader_local, group)
    assert mine is not None
    logger.info("rollout block: ranks %s (leader local rank %d), this rank at %d", mine.ranks,
                mine.leader_local_rank, mine.index)
    return mine
