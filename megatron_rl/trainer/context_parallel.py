"""Context parallelism: every packed row is split over the `cp` ranks of a context-parallel
group, each rank running the model on its own share of the row's positions.

Layout, the one Transformer Engine's THD context parallelism and Megatron's THD RoPE
(`rope_utils._get_thd_freqs_on_this_cp_rank`) expect: every segment of the row (a sample's
slot, padded to a multiple of 2 * cp by `pack(segment_multiple=2 * cp)`, or the trailing
padding) is cut into 2 * cp equal chunks, and rank r holds chunks r and 2 * cp - 1 - r of
each segment, in row order. Under a causal mask chunk k attends to about k chunks, so the
pair (r, 2cp - 1 - r) gives every rank the same attention work, whatever the mix of short
and long samples in the row.

Attention needs the keys and values of other ranks' chunks. On GPU, Transformer Engine's
attention exchanges them itself (given `cu_seqlens` of the whole row). On CPU the local
layer spec gets `megatron_rl.models.local_attention.AllGatherContextAttention`: keys and values
are all-gathered over the group, and each local chunk attends to the earlier chunks of its
segment and causally to itself, read from the same `cu_seqlens` (no mask is built).

Everything after the model works on the rank's own targets: the loss sums its targets'
contributions (gradients are summed over data- x context-parallel ranks), and log-probs
for the caller are reassembled in row order with `gather_targets`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_rl.trainer.packing import ContextShard, MicroBatch

Tensor = torch.Tensor


def held_positions(cu_seqlens: Tensor, cp_size: int, cp_rank: int) -> Tensor:
    """Row positions that rank `cp_rank` holds, in its local order (see module docstring)."""
    parts = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        length = end - start
        if length % (2 * cp_size):
            raise ValueError(f"a packed segment of {length} tokens is not divisible by 2 * cp = {2 * cp_size}: "
                             "pack with segment_multiple=2 * cp")
        chunk = length // (2 * cp_size)
        first = start + cp_rank * chunk
        second = start + (2 * cp_size - 1 - cp_rank) * chunk
        parts += [torch.arange(first, first + chunk), torch.arange(second, second + chunk)]
    return torch.cat(parts)


def shard(mb: MicroBatch, cp_size: int, cp_rank: int) -> MicroBatch:
    """This rank's share of the packed row `mb`: its positions' tokens and its targets (with
    their loss mask, extras and sample ids). Attention reads the row's `cu_seqlens`, which the
    shard keeps whole; it carries no dense mask."""
    held = held_positions(mb.cu_seqlens, cp_size, cp_rank)
    local_of = torch.full((mb.row_len,), -1, dtype=torch.long)
    local_of[held] = torch.arange(held.numel())
    keep = local_of[mb.valid] >= 0  # the row's targets predicted at this rank's positions
    return dataclasses.replace(
        mb,
        input_ids=mb.input_ids[:, held],
        position_ids=mb.position_ids[:, held],
        padding=mb.padding[:, held],
        targets=mb.targets[:, held],
        attention_mask=None,
        valid=local_of[mb.valid[keep]],
        sample_ids=mb.sample_ids[keep],
        loss_mask=mb.loss_mask[keep],
        loss_rows=None,  # `MicroBatch.to` finds the shard's own
        extras={k: v[keep] for k, v in mb.extras.items()},
        context=ContextShard(target_index=keep.nonzero().flatten(), sample_ids=mb.sample_ids,
                             num_targets=mb.valid.numel()),
    )


def gather_targets(values: Tensor, context: ContextShard, group: dist.ProcessGroup) -> Tensor:
    """Per-target values of this rank's targets [T_local, ...] -> those of the whole row [T_row, ...],
    in row order, on every rank of the context-parallel group (each target has one owner)."""
    row = torch.zeros((context.num_targets, *values.shape[1:]), dtype=values.dtype, device=values.device)
    row[context.target_index] = values
    dist.all_reduce(row, group=group)
    return row
