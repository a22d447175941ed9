"""Sequence packing and the data-parallel split, checked against hand-derived layouts."""

import pytest
import torch

from megatron_rl.trainer.packing import Sample, assign_rows, pack, packed_shape, split_for_data_parallel


def _sample(tokens, mask=None, **extras):
    tokens = torch.tensor(tokens)
    mask = torch.ones(len(tokens) - 1) if mask is None else torch.tensor(mask, dtype=torch.float)
    return Sample(tokens, mask, {k: torch.tensor(v, dtype=torch.float) for k, v in extras.items()})


def test_rows_respect_budget_and_cover_every_sample_once():
    lengths = [7, 3, 5, 9, 2, 6, 4]
    rows = assign_rows(lengths, token_budget=10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows)
    # first-fit decreasing by hand: 9 | 7+3 | 6+4 | 5+2, four rows, the longest of 10 tokens; the same
    # samples longest first to the lightest of four rows: 9 | 7+2 | 6+3 | 5+4, every row 9
    assert rows == [[3], [0, 4], [1, 5], [2, 6]]


def test_rows_are_balanced_so_the_last_one_is_not_mostly_padding():
    # first-fit decreasing: 5+5 | 2, rows padded to 10 (8 padding tokens for 12 real ones); balanced:
    # 5+2 | 5, rows of 7
    assert assign_rows([5, 5, 2], token_budget=10) == [[0, 2], [1]]
    assert packed_shape([5, 5, 2], token_budget=10) == (2, 7)
    # where balancing would not shorten the longest row, first-fit's rows stay: 6 | 4+3 (balanced: 6 | 4+3 too)
    assert assign_rows([6, 4, 3], token_budget=8) == [[0], [1, 2]]
    # balancing that would overflow the budget is not taken: first fit 5+5 | 4+3+3; longest first to the
    # lightest row gives 5+4 | 5+3+3 = 11 > 10
    assert assign_rows([5, 5, 4, 3, 3], token_budget=10) == [[0, 1], [2, 3, 4]]


def test_too_long_sample_names_the_fix():
    with pytest.raises(ValueError, match="micro_batch_tokens=4"):
        assign_rows([3, 5], token_budget=4)


def test_packed_row_alignment_positions_and_extras():
    a = _sample([10, 11, 12], mask=[0, 1], adv=[0.5, 0.5])
    b = _sample([20, 21, 22, 23], mask=[1, 1, 0], adv=[1.0, 2.0, 3.0])
    (mb,) = pack([a, b], token_budget=16, pad_multiple=4, pad_token_id=0)
    assert mb.seq_len == 8  # 7 tokens padded up to a multiple of 4
    assert mb.input_ids.tolist() == [[10, 11, 12, 20, 21, 22, 23, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    # position j predicts the next token of the same sample; the last token of each sample predicts nothing
    assert mb.valid.tolist() == [0, 1, 3, 4, 5]
    assert mb.targets[0, mb.valid].tolist() == [11, 12, 21, 22, 23]
    assert mb.sample_ids.tolist() == [0, 0, 1, 1, 1]
    assert mb.loss_mask.tolist() == [0, 1, 1, 1, 0]
    assert mb.extras["adv"].tolist() == [0.5, 0.5, 1.0, 2.0, 3.0]
    assert mb.cu_seqlens.tolist() == [0, 3, 7, 8]


def test_attention_mask_is_causal_within_samples_only():
    (mb,) = pack([_sample([1, 2, 3]), _sample([4, 5])], token_budget=8, pad_multiple=1)
    allowed = ~mb.attention_mask[0, 0]
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(allowed, expected)


def test_padding_attends_only_to_padding():
    (mb,) = pack([_sample([1, 2, 3])], token_budget=8, pad_multiple=8)
    allowed = ~mb.attention_mask[0, 0]
    assert allowed[3:, :3].sum() == 0 and allowed[:3, 3:].sum() == 0
    assert bool(allowed.any(dim=1).all()), "every row must attend somewhere (no NaN softmax)"


def test_all_rows_of_a_call_share_one_length():
    samples = [_sample(list(range(1, n + 1))) for n in (9, 4, 3, 8)]
    micro = pack(samples, token_budget=10, pad_multiple=2)
    assert len({mb.seq_len for mb in micro}) == 1
    assert micro[0].seq_len == 10


def test_data_parallel_split_balances_tokens_deterministically():
    lengths = [10, 9, 8, 7, 6, 5, 4, 3]
    shares = split_for_data_parallel(lengths, 2)
    assert sorted(i for s in shares for i in s) == list(range(8))
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert loads == [26, 26]
    assert shares == split_for_data_parallel(lengths, 2)


def test_data_parallel_split_of_fewer_samples_than_ranks_leaves_shares_empty():
    assert split_for_data_parallel([1, 2, 3], 4) == [[2], [1], [0], []]


def test_no_samples_pack_into_rows_of_padding_only_when_a_shape_is_asked_for():
    assert pack([], 64) == []
    rows = pack([], 64, pad_multiple=4, extras_keys=["advantages"], min_shape=(2, 8))
    assert len(rows) == 2 and all(r.sample_indices == [] and r.input_ids.shape == (1, 8) for r in rows)
    assert all(r.padding.all() and r.valid.numel() == 0 and set(r.extras) == {"advantages"} for r in rows)


def test_sample_validates_mask_length():
    with pytest.raises(ValueError, match=r"loss_mask must have shape \[2\]"):
        Sample(torch.tensor([1, 2, 3]), torch.ones(3))


def test_min_shape_pads_rows_and_appends_rows_without_samples():
    """Expert-parallel ranks must run equal shapes: a rank with one row of 5 tokens takes the shape
    (2 rows of 7) of another rank's samples; its second row holds only padding."""
    a = _sample([1, 2, 3, 4, 5], adv=[1.0, 1.0, 1.0, 1.0])
    assert packed_shape([5], token_budget=8) == (1, 5)
    assert packed_shape([6, 4, 3], token_budget=8) == (2, 7)  # rows 6 | 4+3
    rows = pack([a], token_budget=8, min_shape=(2, 7))
    assert [mb.seq_len for mb in rows] == [7, 7]
    assert rows[0].valid.tolist() == [0, 1, 2, 3] and rows[0].input_ids[0, 5:].tolist() == [0, 0]
    empty = rows[1]
    assert empty.sample_indices == [] and empty.valid.numel() == 0 and empty.loss_mask.numel() == 0
    assert empty.extras["adv"].numel() == 0 and empty.input_ids.tolist() == [[0] * 7]
    assert not empty.attention_mask[0, 0].all(dim=-1).any(), "every padding position attends somewhere"


def test_padding_marks_every_position_no_sample_token_occupies():
    """The routers' padding mask: trailing padding, the rounding of each sample's slot to segment_multiple
    (context parallelism), and rows without samples; a sample's own tokens (its last one included) are not."""
    a, b = _sample([1, 2, 3]), _sample([4, 5, 6, 7, 8])
    rows = pack([a, b], token_budget=12, segment_multiple=4, pad_multiple=4, min_shape=(2, 12))
    # row 0 in sample order: a in slot [0, 4) (3 tokens, 1 padded), b in slot [4, 12) (5 tokens, 3 padded);
    # row 1 empty
    assert rows[0].padding.tolist() == [[False] * 3 + [True] + [False] * 5 + [True] * 3]
    assert rows[1].padding.tolist() == [[True] * 12]
    for mb in rows:
        assert mb.padding.shape == mb.input_ids.shape
