"""The resumable sampler: a permutation per epoch, and resume from its state."""

import pytest

from megatron_rl.data.sampler import EpochSampler


def test_each_epoch_is_a_permutation():
    s = EpochSampler(10, seed=1)
    first, second = s.next_batch(10), s.next_batch(10)
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second


def test_batches_cross_epoch_boundaries():
    s = EpochSampler(4, seed=0)
    batch = s.next_batch(6)
    assert len(batch) == 6 and s.epoch == 1 and s.position == 2


def test_resume_continues_the_same_sequence():
    a = EpochSampler(7, seed=3)
    a.next_batch(5)
    state = a.state_dict()
    expected = a.next_batch(9)
    b = EpochSampler(7, seed=3)
    b.load_state_dict(state)
    assert b.next_batch(9) == expected


def test_resume_refuses_a_different_dataset():
    with pytest.raises(ValueError, match="7 items"):
        EpochSampler(8, seed=3).load_state_dict(EpochSampler(7, seed=3).state_dict())
