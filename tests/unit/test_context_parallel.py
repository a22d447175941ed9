"""Context-parallel sharding of packed rows, checked against the whole row's own layout."""

import pytest
import torch

from megatron_rl.trainer.context_parallel import held_positions, shard
from megatron_rl.trainer.packing import Sample, pack


def _samples(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        mask = torch.ones(n - 1)
        mask[: n // 3] = 0
        out.append(Sample(torch.randint(1, 100, (n,), generator=gen), mask, {"adv": torch.randn(n - 1, generator=gen)}))
    return out


def test_each_rank_holds_chunk_r_and_its_mirror_of_every_segment():
    cu = torch.tensor([0, 8, 12])  # segments of 8 and 4 tokens, cp=2: chunks of 2 and of 1
    assert held_positions(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert held_positions(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]


def test_uneven_segment_is_refused():
    with pytest.raises(ValueError, match="segment_multiple"):
        held_positions(torch.tensor([0, 6]), 2, 0)


def test_packing_pads_each_sample_to_the_segment_multiple():
    samples = _samples([5, 9, 4])
    (mb,) = pack(samples, token_budget=64, pad_multiple=8, segment_multiple=4)
    assert mb.cu_seqlens.tolist() == [0, 8, 20, 24]
    assert mb.input_ids[0, 5:8].tolist() == [0, 0, 0]  # slot padding after sample 0's last token
    assert mb.valid.tolist() == [0, 1, 2, 3] + list(range(8, 16)) + [20, 21, 22]
    with pytest.raises(ValueError, match="multiple of segment_multiple"):
        pack(samples, token_budget=64, pad_multiple=6, segment_multiple=4)


@pytest.mark.parametrize("cp", [2, 3])
def test_shards_partition_the_row_and_balance_its_attention(cp):
    samples = _samples([7, 13, 4, 10], seed=cp)
    (mb,) = pack(samples, token_budget=128, pad_multiple=4 * cp, segment_multiple=2 * cp, dense_mask=False)
    gathered = torch.cat([held_positions(mb.cu_seqlens, cp, r) for r in range(cp)])
    assert sorted(gathered.tolist()) == list(range(mb.row_len)), "every position on exactly one rank"
    segment_start = mb.cu_seqlens[torch.bucketize(torch.arange(mb.row_len), mb.cu_seqlens[1:], right=True)]
    row_targets = torch.full((mb.valid.numel(),), -1)
    work = []
    for rank in range(cp):
        part = shard(mb, cp, rank)
        held = held_positions(mb.cu_seqlens, cp, rank)
        assert part.seq_len == mb.row_len // cp and part.attention_mask is None
        assert torch.equal(part.input_ids[0], mb.input_ids[0, held])
        assert torch.equal(part.cu_seqlens, mb.cu_seqlens)  # attention reads the whole row's segments
        # local targets: same target tokens, values and samples as in the row
        index = part.context.target_index
        assert torch.equal(part.targets[0, part.valid], mb.targets[0, mb.valid[index]])
        assert torch.equal(part.extras["adv"], mb.extras["adv"][index])
        assert torch.equal(part.loss_mask, mb.loss_mask[index])
        assert torch.equal(part.sample_ids, mb.sample_ids[index])
        row_targets[index] = rank
        work.append(int((held - segment_start[held] + 1).sum()))  # causal keys of each held query
    assert (row_targets >= 0).all(), "every target predicted on some rank"
    # chunks k and 2cp-1-k of a causal segment of chunk length c attend to
    # c^2 (2cp - 1) + c (c + 1) query-key pairs together, whatever k: equal work
    assert len(set(work)) == 1, f"attention pairs per rank {work}"
    lengths = mb.cu_seqlens.diff()
    assert sum(work) == int((lengths * (lengths + 1) // 2).sum())


def test_gspo_with_context_parallelism_is_refused_before_any_work():
    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.config.checks.run import check_run

    with pytest.raises(ConfigError, match="parallel.cp=2 splits every sequence"):
        load_config(["mode=rl", "parallel.cp=2", "algorithm.policy_loss=gspo"], world_size=2)
    check_run(load_config(["mode=rl", "parallel.cp=2"], world_size=2))  # other losses are fine


def test_rows_for_thd_attention_carry_no_dense_mask():
    samples = _samples([7, 13])
    (dense,) = pack(samples, token_budget=64, pad_multiple=4, segment_multiple=4)
    (thd,) = pack(samples, token_budget=64, pad_multiple=4, segment_multiple=4, dense_mask=False)
    assert thd.attention_mask is None and dense.attention_mask.shape == (1, 1, 24, 24)  # slots 8 + 16
    assert torch.equal(thd.cu_seqlens, dense.cu_seqlens) and torch.equal(thd.input_ids, dense.input_ids)
    part = shard(thd, 2, 1)
    assert part.attention_mask is None and part.seq_len == 12
