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
