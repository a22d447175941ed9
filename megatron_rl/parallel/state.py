"""The only module that calls Megatron's `parallel_state`: builds the TP/PP/CP/DP (and expert
EP / expert-TP) groups once and hands them to the rest of the framework as an explicit
`ParallelGroups` value."""

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
    dp_size: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    dp_cp_group: dist.ProcessGroup
    mp_group: dist.ProcessGroup  # TP x PP: ranks that hold one copy of the model together
    pp_last_rank: int  # global rank of the last stage of this rank's pipeline
    pp_first_rank: int
    sequence_parallel: bool
    device: torch.device
    # Experts: split over `ep_size` ranks carved out of the data-parallel ranks; within an
    # expert, split over the expert tensor-parallel group (Megatron's default: size tp).
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


def initialize(tp: int, pp: int, cp: int = 1, *, ep: int = 1, sequence_parallel: bool = False,
               seed: int = 1234, device: Optional[torch.device] = None) -> ParallelGroups:
    """Create Megatron's model-parallel groups over the default process group and seed its RNGs.

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
    if world % (tp * ep * pp):
        raise ValueError(f"world size {world} is not divisible by tp*ep*pp = {tp}*{ep}*{pp}")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
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
        dp_size=ps.get_data_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        mp_group=ps.get_model_parallel_group(),
        pp_last_rank=ps.get_pipeline_model_parallel_last_rank(),
        pp_first_rank=ps.get_pipeline_model_parallel_first_rank(),
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
