"""One rollout engine per block of ranks (`rollout.spmd.BlockEngine`), two gloo ranks, k = 2.

Rank 0 (the block leader) owns a real `HFEngine`; rank 1 owns none and reaches it through the
block. Expected values come from k = 1: each rank's own `HFEngine` loaded with the same weights
and asked the same requests with the same seeds (the hf engine is deterministic per seed), so
the block must return exactly those completions, log-probs and versions. Also: weight buckets
are loaded once per block (not once per rank), ranks may call `generate` a different number
of times, identical requests are generated once, engine errors reach every rank, ranks out of
step fail instead of hanging, and the colocated loop (trainer TP=2 -> weight sync -> generate)
runs through the block with the engine holding exactly the trainer's weights.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import run_spawned

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

TEMPERATURE = 0.8
REQUESTS = {  # rank -> its generate calls (prompts, seed); rank 0 makes one call more
    0: [([[5, 6, 7, 8], [9, 10]], 11), ([[12, 13, 14]], 12), ([[20, 21]], 13)],
    1: [([[30, 31, 32]], 21), ([[40, 41, 42, 43], [44]], 22)],
}


def _counting_engine_class():
    from megatron_rl.rollout.hf_engine import HFEngine

    class CountingHFEngine(HFEngine):
        """The real hf engine, counting what it loads (to see that each bucket arrives once)."""

        loaded_tensors = 0
        update_calls = 0

        def update_weights(self, named_tensors, version, flush=True):
            tensors = list(named_tensors)
            self.loaded_tensors += len(tensors)
            self.update_calls += 1
            super().update_weights(tensors, version, flush)

    return CountingHFEngine


def _as_tuples(gens):
    return [(g.prompt_index, g.output_ids, g.logprobs, g.finish_reason, g.weight_version) for g in gens]


def _worker(rank, world):
    import torch.distributed as dist

    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.hf import build_hf_model, hub_state_dict
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.rollout.base import EngineStateError, SamplingParams
    from megatron_rl.rollout.hf_engine import HFEngine
    from megatron_rl.rollout.spmd import BlockEngine

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    model_cfg = ModelConfig(family="qwen2")
    weights = list(hub_state_dict(build_hf_model(model_cfg, seed=3)).items())
    buckets = [weights[: len(weights) // 2], weights[len(weights) // 2:]]

    def params(seed, n=2):
        return SamplingParams(temperature=TEMPERATURE, max_new_tokens=10, n=n, seed=seed)

    # k = 1: this rank's own engine, the expected values
    own = HFEngine(model_cfg)
    own.update_weights(weights, version=5)
    expected = [_as_tuples(own.generate(p, params(s))) for p, s in REQUESTS[rank]]
    shared_expected = _as_tuples(own.generate([[50, 51, 52]], params(99, n=3)))
    del own

    block = state.rollout_block(2, local_rank=rank, local_world_size=2)
    assert block.ranks == (0, 1) and block.index == rank
    engine = _counting_engine_class()(model_cfg) if block.is_leader else None
    blk = BlockEngine(block, engine)
    assert blk.weight_version == 0

    blk.release_memory()
    if block.is_leader:
        assert engine.health()["released"] == ["kv_cache", "weights"]
    with pytest.raises(EngineStateError):  # raised by the leader's engine, on every rank
        blk.generate([[1, 2]], params(1))
    blk.resume_memory(["weights"])
    blk.update_weights(buckets[0], version=5, flush=False)
    assert blk.weight_version == 0  # not flushed yet
    blk.update_weights(buckets[1], version=5, flush=True)
    assert blk.weight_version == 5
    if block.is_leader:  # every tensor loaded once for the block, not once per rank
        assert (engine.update_calls, engine.loaded_tensors) == (2, len(weights))
    blk.resume_memory(["kv_cache"])

    # Ragged calls: rank 1 is done after 2 calls and waits in release_memory while rank 0 makes a third.
    got = [_as_tuples(blk.generate(p, params(s))) for p, s in REQUESTS[rank]]
    assert got == expected
    # The same request from both ranks (one TP group): generated once, the same answer for both.
    tokens_before = engine.generated_tokens if block.is_leader else 0
    shared = _as_tuples(blk.generate([[50, 51, 52]], params(99, n=3)))
    assert shared == shared_expected
    if block.is_leader:
        assert engine.generated_tokens - tokens_before == sum(len(g[1]) for g in shared)
    blk.release_memory()

    # Ranks out of step fail on both ranks instead of hanging.
    with pytest.raises(RuntimeError, match="out of step"):
        blk.pause() if rank == 0 else blk.resume()
    health = blk.health()
    assert health["block_ranks"] == [0, 1] and health["weight_version"] == 5
    dist.barrier()
    _colocated(rank, block)


def _colocated(rank, block):
    """Trainer at TP=2 (both ranks hold half of each layer), one engine for the block."""
    import torch.distributed as dist

    from megatron_rl.colocate.controller import ColocationController
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.parallel import state
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.spmd import BlockEngine
    from megatron_rl.trainer.core import Trainer, TrainerOptions
    from megatron_rl.trainer.packing import Sample
    from megatron_rl.families import get_converter

    groups = state.initialize(2, 1)
    model_cfg = ModelConfig(num_layers=2)
    trainer = Trainer(model_cfg, OptimizerConfig(lr=1e-2), groups,
                      TrainerOptions(micro_batch_tokens=256, logprob_temperature=TEMPERATURE))
    trainer.initialize_weights()
    engine = _counting_engine_class()(model_cfg) if block.is_leader else None
    blk = BlockEngine(block, engine)
    blk.release_memory()
    controller = ColocationController(trainer, blk, bucket_bytes=50_000)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=8, n=2, seed=4)
    gens = controller.rollout(lambda: blk.generate(prompts, params))
    assert {g.weight_version for g in gens} == {1} and blk.weight_version == 1
    both: list = [None, None]
    dist.all_gather_object(both, _as_tuples(gens))
    assert both[0] == both[1]  # TP ranks asked the same: one generation, one answer
    # the trainer's own log-probs of the sampled tokens: the engine held the trainer's weights
    samples = [Sample(torch.tensor(prompts[g.prompt_index] + g.output_ids),
                      torch.cat([torch.zeros(len(prompts[g.prompt_index]) - 1), torch.ones(len(g.output_ids))]))
               for g in gens]
    recomputed, _ = trainer.forward_logprobs(samples)
    worst = max((lp[s.loss_mask.bool()] - torch.tensor(g.logprobs)).abs().max().item()
                for lp, g, s in zip(recomputed, gens, samples))
    assert worst < 1e-4, worst  # fp32, as in test_rollout_sync.py (observed ~5e-7)
    expected = get_converter("qwen2").megatron_to_hf(trainer.full_state_dict(), model_cfg)  # collective
    blk.resume_memory(["weights"])  # released after the rollout: sync again to compare the weights
    from megatron_rl.weight_sync.stream import sync_weights

    sync_weights(trainer.module, groups, model_cfg, blk, 2, bucket_bytes=50_000)
    if block.is_leader:
        held = engine.hf_state_dict()
        assert max((held[k] - v).abs().max().item() for k, v in expected.items()) == 0.0
        # two syncs, each tensor once per sync (a tied lm_head is the embedding: not sent)
        assert model_cfg.tie_word_embeddings and engine.loaded_tensors == 2 * (len(expected) - 1)
    assert blk.weight_version == 2


def test_block_engine_matches_per_rank_engines_and_loads_weights_once():
    run_spawned(_worker, 2, timeout_s=400)
