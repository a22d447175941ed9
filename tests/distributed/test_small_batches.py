"""A batch with fewer samples than data-parallel ranks (what the filters can leave): the ranks
without a sample train on a row of padding and take part in the gradient reduction, so that the
step equals the same step on one rank (it raised "cannot feed 2 data-parallel ranks" before)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import run_spawned

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _one_sample():
    from megatron_rl.trainer.packing import Sample

    gen = torch.Generator().manual_seed(3)
    mask = torch.ones(11)
    mask[:3] = 0
    return [Sample(torch.randint(0, 128, (12,), generator=gen), mask, {"advantage": torch.randn(11, generator=gen)})]


def _worker(rank: int, world: int, out_path: str) -> None:
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.models.hf import random_state_dict
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=60)
    groups = state.initialize(1, 1)
    model_cfg = ModelConfig(num_layers=2)
    trainer = Trainer(model_cfg, OptimizerConfig(lr=1e-2), groups, TrainerOptions(micro_batch_tokens=64))
    trainer.load_full_state_dict(random_state_dict(model_cfg, seed=5))

    def pg_loss(inp):
        loss = -(inp.logprobs * inp.extras["advantage"] * inp.loss_mask).sum() / inp.num_tokens
        return loss, {"pg_loss": loss.detach()}

    logprobs, _ = trainer.forward_logprobs(_one_sample())
    metrics = trainer.train_step(_one_sample(), pg_loss)
    after = trainer.full_state_dict()
    if rank == 0:
        torch.save({"logprobs": logprobs, "metrics": metrics, "after": after}, out_path)


@pytest.mark.parametrize("world", [2])
def test_one_sample_on_two_data_parallel_ranks_equals_one_rank(tmp_path, world):
    got, want = tmp_path / "dp2.pt", tmp_path / "dp1.pt"
    run_spawned(_worker, world, str(got))
    run_spawned(_worker, 1, str(want))
    got, want = torch.load(got, weights_only=False), torch.load(want, weights_only=False)
    assert torch.allclose(got["logprobs"][0], want["logprobs"][0], atol=1e-6)
    for key in ("pg_loss", "grad_norm", "num_tokens"):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5), key
    assert want["metrics"]["grad_norm"] > 0
    for name, tensor in want["after"].items():
        assert torch.allclose(got["after"][name], tensor, atol=1e-6), name
