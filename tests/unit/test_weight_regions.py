"""`covered_once`, the count behind an in-place weight sync's accounting (each element of each Megatron tensor
copied once, each element of each engine parameter written once): views that split a tensor exactly pass, views
that miss, repeat or overlap elements fail, whatever their layout (row slices, KV-group interleaving,
transposes, gpt-oss's interleaved columns, stride 0)."""

import torch

from megatron_rl.rollout.base import covered_once


def test_views_that_hold_each_element_once_pass():
    t = torch.zeros(12, 8)
    assert covered_once(t, [t])
    assert covered_once(t, [t.t()])  # a permutation of all of it
    assert covered_once(t, list(t.chunk(3)))  # row slices
    groups = t.view(2, 6, 8)  # [q (4 rows), k (1), v (1)] per group, as linear_qkv
    assert covered_once(t, [groups[:, :4], groups[:, 4:5], groups[:, 5:]])
    pairs = t.view(12, 4, 2)  # gpt-oss: gate at the even columns, up at the odd ones
    assert covered_once(t, [pairs[..., 0], pairs[..., 1].t()])


def test_views_that_miss_repeat_or_overlap_elements_fail():
    t = torch.zeros(12, 8)
    assert not covered_once(t, [t[:6]])  # half of it
    assert not covered_once(t, [t[:6], t[:6]])  # the first half twice, as many elements as the tensor has
    assert not covered_once(t, [t[:7], t[5:]]) and not covered_once(t, [t[:7], t[6:11]])
    groups = t.view(2, 6, 8)
    assert not covered_once(t, [groups[:, :4], groups[:, 4:5], groups[:, 4:5]])  # k twice, no v
    pairs = t.view(12, 4, 2)
    assert not covered_once(t, [pairs[..., 0], pairs[..., 0]])
    assert not covered_once(t, [t[0].expand(12, 8)])  # one row 12 times (stride 0)
    assert not covered_once(t, [torch.zeros(12, 8)])  # another tensor's memory
