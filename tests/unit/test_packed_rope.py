"""Packed-row RoPE in one gather (models/packed_rope.py) against megatron-core's own per-sample loop
(`rope_utils._apply_rotary_pos_emb_thd`), which stays the reference: both frequency layouts, context-parallel
shares, interleaved rotation, mscale, partial rotary dimensions, and the gradient."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_rl.models import packed_rope

rope_utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")


class _Group:
    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _config(interleaved: bool = False) -> types.SimpleNamespace:
    return types.SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=interleaved,
                                 multi_latent_attention=False)


def _freqs(rows: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(rows, 1, 1, dim, generator=g, dtype=torch.float64) * 7


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("with_offsets", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_equals_megatrons_per_sample_loop(cp_size, with_offsets, interleaved):
    lengths = [8, 16, 24, 8, 40, 16]  # each a multiple of 2 * cp_size, as Megatron's CP split needs
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    rows = int(cu[-1]) if with_offsets else max(lengths)
    freqs = _freqs(rows, 8, seed=cp_size)
    for rank in range(cp_size):
        group = _Group(cp_size, rank)
        local = sum(lengths) // cp_size
        t = torch.randn(local, 3, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        ours = packed_rope.apply_rotary_pos_emb(t, freqs, _config(interleaved), cu_seqlens=cu, mscale=1.3,
                                                cp_group=group)
        theirs = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, rotary_interleaved=interleaved,
                                                      mscale=1.3, cp_group=group)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_positions_by_hand():
    cu = torch.tensor([0, 3, 5, 9])
    assert packed_rope.packed_positions(cu).tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert packed_rope.packed_positions(cu, with_offsets=True).tolist() == list(range(9))
    # cp=2, samples of 8 and 4: rank 0 holds chunks 0 and 3 of each, rank 1 chunks 1 and 2
    cu = torch.tensor([0, 8, 12])
    assert packed_rope.packed_positions(cu, 2, 0).tolist() == [0, 1, 6, 7, 0, 3]
    assert packed_rope.packed_positions(cu, 2, 1).tolist() == [2, 3, 4, 5, 1, 2]


def test_the_gradient_equals_megatrons():
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    freqs = _freqs(7, 6, seed=3)
    t = torch.randn(13, 2, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 2, 6, dtype=torch.float64)
    (packed_rope.apply_rotary_pos_emb(t, freqs, _config(), cu_seqlens=cu, cp_group=_Group(1, 0)) * weight).sum().backward()
    ours, t.grad = t.grad, None
    (rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=_Group(1, 0)) * weight).sum().backward()
    torch.testing.assert_close(ours, t.grad, rtol=0, atol=0)


def test_a_row_that_cu_seqlens_do_not_cover_is_refused():
    cu = torch.tensor([0, 4, 8])
    with pytest.raises(ValueError, match="cover 8 tokens on this rank, the row has 9"):
        packed_rope.apply_rotary_pos_emb(torch.zeros(9, 1, 4), _freqs(4, 4, 0), _config(), cu_seqlens=cu,
                                         cp_group=_Group(1, 0))


def test_install_routes_attention_through_it_and_uninstall_restores():
    from megatron.core.transformer import attention

    before = attention.apply_rotary_pos_emb
    packed_rope.install()
    packed_rope.install()  # idempotent: the original is kept, not the wrapper
    try:
        assert attention.apply_rotary_pos_emb is packed_rope.apply_rotary_pos_emb
    finally:
        packed_rope.uninstall()
    assert attention.apply_rotary_pos_emb is (before if before is not packed_rope.apply_rotary_pos_emb
                                              else rope_utils.apply_rotary_pos_emb)
    if before is packed_rope.apply_rotary_pos_emb:
        packed_rope.install()
