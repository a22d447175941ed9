"""The CPU path's packed attention (models/local_attention.py:PackedAttention) against the dense
computation it replaces: scores of the whole row under a block-diagonal causal mask, by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch


def _attention():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl.models.local_attention import PackedAttention

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               kv_channels=8, attention_dropout=0.0)
    return PackedAttention(config, 1, None, "self")


def test_each_sample_attends_causally_within_itself_only():
    attention = _attention()
    bounds = [0, 5, 12, 13, 16]  # samples of 5, 7 and 1 tokens, then 3 of padding (a segment of its own)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(16, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(16, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(16, 2, 8, generator=gen, dtype=torch.float64)
    out = attention(q, k, v, None, packed_seq_params=SimpleNamespace(cu_seqlens_q=torch.tensor(bounds)))
    segment = torch.repeat_interleave(torch.arange(4), torch.tensor(bounds).diff())
    allowed = (segment[:, None] == segment[None, :]) & torch.ones(16, 16, dtype=torch.bool).tril()
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # query heads 0, 1 share group 0
    scores = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(8)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    expected = torch.einsum("hqk,khd->qhd", probs, vv).reshape(16, 32)
    assert out.shape == (16, 32) and torch.allclose(out, expected, atol=1e-12)
    out[:5].sum().backward()  # the first sample's outputs depend on its own queries only
    assert q.grad[:5].abs().sum() > 0 and torch.equal(q.grad[5:], torch.zeros_like(q.grad[5:]))


def _dense(q, k, v, bounds):
    """The row's attention under a block-diagonal causal mask, computed whole (grouped-query heads shared)."""
    t = q.shape[0]
    segment = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.tensor(bounds).diff())
    allowed = (segment[:, None] == segment[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(q.shape[-1])
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vv).reshape(t, -1)


def test_samples_of_mixed_lengths_in_several_length_groups_match_the_dense_row_and_its_gradients():
    from megatron_rl.models.local_attention import _length_groups

    # a long sample, a run of short ones of nearby lengths, single tokens and trailing padding: the long one
    # and the single tokens cannot share a padded call with the short ones, so the row takes several
    lengths = [3, 40, 6, 5, 1, 7, 6, 1, 12, 4]
    assert len(_length_groups(lengths)) >= 3
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    t = bounds[-1]
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(t, h, 8, generator=gen, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2)]
    weight = torch.randn(t, 32, generator=gen, dtype=torch.float64)  # a loss that reads every output
    out = _attention()(*inputs, None, packed_seq_params=SimpleNamespace(cu_seqlens_q=torch.tensor(bounds)))
    got = torch.autograd.grad((out * weight).sum(), inputs)
    expected = _dense(*inputs, bounds)
    want = torch.autograd.grad((expected * weight).sum(), inputs)
    assert torch.allclose(out, expected, atol=1e-12)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-12)


def test_length_groups_bound_the_padding_and_cover_every_sample_once():
    from megatron_rl.models.local_attention import _length_groups

    lengths = [30, 2, 29, 28, 3, 1, 2, 500, 31]
    groups = _length_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:  # padded scores within twice the samples' own, no sample padded beyond twice its length
        longest = max(lengths[i] for i in g)
        assert len(g) * longest**2 <= 2 * sum(lengths[i] ** 2 for i in g)
        assert all(longest <= 2 * lengths[i] for i in g)
    # by hand, longest first: 500 alone (31 < 250); 31, 30, 29, 28 (4 x 961 <= 2 x 3486); 3, 2, 2
    # (3 x 9 <= 2 x 17); 1 alone (3 > 2 x 1)
    assert groups == [[7], [8, 0, 2, 3], [4, 1, 6], [5]]
