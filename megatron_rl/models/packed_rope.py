"""Rotary embeddings for packed (thd) rows in one gather, where megatron-core loops over the samples in Python.

Megatron-core's unfused RoPE for packed rows (`rope_utils._apply_rotary_pos_emb_thd`, megatron-core 0.16) splits
the row into its samples and slices the frequency table once per sample (with `.item()` and `.tolist()` on
`cu_seqlens`), for the query and the key of every layer. An RL step packs hundreds of short samples per row, so
on CPU that loop was about a tenth of the trainer's update (py-spy, the demo's countdown run). This module computes
every token's position in its sample at once, gathers the frequencies in one index, and rotates with Megatron's
own `_apply_rotary_pos_emb_bshd`, so the numbers are Megatron's: `tests/unit/test_packed_rope.py` compares the
two on both of Megatron's frequency layouts (a table of the longest sample's positions, or one row per packed
token), with context parallelism's two-chunk split, interleaved rotation and mscale.

The fused path (config.apply_rope_fusion: Transformer Engine's thd kernel) is left to Megatron, as is everything
but the packed case. `install()` swaps the function that `megatron.core.transformer.attention` calls (the name
it imported) and is idempotent; `uninstall()` restores it. No library does this: it is a vectorised form of one
megatron-core function, which keeps the upstream one as its reference.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

_ORIGINAL: Optional[Any] = None


def packed_positions(cu_seqlens: Tensor, cp_size: int = 1, cp_rank: int = 0,
                     with_offsets: bool = False) -> Tensor:
    """The position in the frequency table of every token of this rank's share of a packed row.

    `cu_seqlens` holds the cumulative lengths of the whole samples (all context-parallel ranks together). With
    `cp_size` > 1 a rank holds 1/cp_size of each sample, as two chunks: chunk `cp_rank` from the front and chunk
    `cp_rank` from the back (Megatron's load-balanced split, `rope_utils._get_thd_freqs_on_this_cp_rank`).
    `with_offsets`: the table holds one row per packed token, so a sample's positions start at its offset in
    the row."""
    full = cu_seqlens[1:] - cu_seqlens[:-1]
    local = torch.div(full, cp_size, rounding_mode="floor")
    n = local.numel()
    sample = torch.repeat_interleave(torch.arange(n, device=cu_seqlens.device), local)
    starts = torch.cumsum(local, 0) - local
    pos = torch.arange(sample.numel(), device=cu_seqlens.device) - starts[sample]
    if cp_size > 1:
        seg = torch.div(local, 2, rounding_mode="floor")[sample]
        back = cp_size * local[sample] - (cp_rank + 1) * seg + (pos - seg)
        pos = torch.where(pos < seg, cp_rank * seg + pos, back)
    if with_offsets:
        pos = pos + cu_seqlens[:-1][sample]
    return pos


def apply_rotary_pos_emb(t: Tensor, freqs: Tensor, config: Any, cu_seqlens: Optional[Tensor] = None,
                         mscale: float = 1.0, cp_group: Any = None) -> Tensor:
    """`rope_utils.apply_rotary_pos_emb`, with the unfused packed case in one gather (the rest is Megatron's)."""
    from megatron.core.models.common.embeddings import rope_utils

    original = _ORIGINAL or rope_utils.apply_rotary_pos_emb
    if cu_seqlens is None or config.apply_rope_fusion:
        return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
    if cp_group is None:
        from megatron.core import parallel_state

        cp_group = parallel_state.get_context_parallel_group()
    with_offsets = freqs.dim() >= 1 and freqs.size(0) == int(cu_seqlens[-1])
    pos = packed_positions(cu_seqlens, cp_group.size(), cp_group.rank(), with_offsets)
    if pos.numel() != t.size(0):
        raise ValueError(f"packed RoPE: cu_seqlens cover {pos.numel()} tokens on this rank, the row has "
                         f"{t.size(0)}")
    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1), freqs[pos], rotary_interleaved=config.rotary_interleaved,
        multi_latent_attention=config.multi_latent_attention, mscale=mscale).squeeze(1)


def install() -> None:
    """Route `megatron.core.transformer.attention`'s RoPE through `apply_rotary_pos_emb` above."""
    global _ORIGINAL
    from megatron.core.transformer import attention

    if attention.apply_rotary_pos_emb is not apply_rotary_pos_emb:
        _ORIGINAL = attention.apply_rotary_pos_emb
        attention.apply_rotary_pos_emb = apply_rotary_pos_emb


def uninstall() -> None:
    global _ORIGINAL
    from megatron.core.transformer import attention

    if _ORIGINAL is not None:
        attention.apply_rotary_pos_emb = _ORIGINAL
        _ORIGINAL = None
