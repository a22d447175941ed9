"""rollout.weight_sync=adapters with real trainers and the hf engine: the colocation controller pushes a LoRA
model's frozen base weights once, then its adapters alone, and the engine's log-probs of its samples equal
Megatron's recomputed ones (fp32; bound 1e-4, as the merged sync's in test_rollout_sync.py) at TP=2 with
sequence parallelism and at PP=2: after the first sync, after a training step moved the adapters (only they
travel), and after an HF export was loaded into the trainer (the base travels again). A step's sync moves
r (in + out) numbers per adapted HF module, counted here from the architecture.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import run_spawned
from tests.distributed.test_rollout_sync import engine_vs_trainer

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

LAYOUTS = {"tp2_sp": (2, 1, True), "pp2": (1, 2, False)}  # tp, pp, sequence parallel
RANK, ALPHA = 4, 32.0
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]
TEMPERATURE = 0.7


def _worker(rank, world, tp, pp, sequence_parallel, out):
    from megatron_rl.checkpoint.hf import export_hf
    from megatron_rl.colocate.controller import ColocationController
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.models.lora import LoRAAdapter
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.hf_engine import HFEngine
    from megatron_rl.trainer.core import Trainer, TrainerOptions

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    model_cfg = ModelConfig(num_layers=4, lora_rank=RANK, lora_alpha=ALPHA)
    groups = state.initialize(tp, pp, sequence_parallel=sequence_parallel)
    trainer = Trainer(model_cfg, OptimizerConfig(lr=1e-2), groups,
                      TrainerOptions(micro_batch_tokens=256, logprob_temperature=TEMPERATURE))
    trainer.initialize_weights()
    with torch.no_grad():  # adapters that already change the model (B = 0 at init); the same on every rank
        for name, module in trainer.module.named_modules():
            if isinstance(module, LoRAAdapter):
                gen = torch.Generator().manual_seed(sum(map(ord, name)))
                module.b.copy_(0.05 * torch.randn(module.b.shape, generator=gen))
    engine = HFEngine(model_cfg)
    engine.release_memory()
    controller = ColocationController(trainer, engine, bucket_bytes=100_000, weight_sync="adapters")
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=12, n=2, seed=1)

    def rollout() -> dict:
        generations = controller.rollout(lambda: engine.generate(PROMPTS, params))
        samples, diffs = engine_vs_trainer(trainer, PROMPTS, generations)
        return {"diff": max(diffs), "bytes": controller.last_sync.num_bytes, "released": engine.health()["released"],
                "versions": sorted({g.weight_version for g in generations}), "samples": samples}

    first = rollout()
    trainer.train_step(first["samples"])  # moves the adapters only
    second = rollout()
    # a load, as offline evaluation loads a merged HF export: the merged weights become the base, B = 0
    export_hf(trainer.module, groups, model_cfg, f"{out}.export")
    trainer.load_hf(f"{out}.export")
    third = rollout()
    # what an adapter-only sync brings back to the accelerator (no distributed optimizer: every parameter is
    # moved by itself): the adapters alone, where a full sync moves every parameter
    names = {id(p): name for name, p in trainer.module.named_parameters()}
    moved = sorted({names[id(p)].rsplit(".", 1)[-1] for p in trainer._params_moved_alone(adapters_only=True)})
    everything = len(trainer._params_moved_alone()) == len(names)
    if rank == 0:
        torch.save({"rollouts": [{k: v for k, v in r.items() if k != "samples"} for r in (first, second, third)],
                    "moved": moved, "full_moves_everything": everything}, out)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("adapter_sync")
    got = {}
    for name, (tp, pp, sequence_parallel) in LAYOUTS.items():
        run_spawned(_worker, tp * pp, tp, pp, sequence_parallel, str(out / f"{name}.pt"))
        got[name] = torch.load(out / f"{name}.pt", weights_only=False)
    return got


def sync_sizes() -> tuple[int, int]:
    """(bytes of one adapter sync, of the base weights), fp32. The adapters from the architecture: q, k, v, o,
    gate, up and down of every layer, each with A [r, in] and B [out, r]; the base as transformers holds the
    model, each tensor once (the tied lm_head is the embedding)."""
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.hf import build_hf_model, hub_state_dict

    m = ModelConfig(num_layers=4)
    h, q, kv, f = m.hidden_size, m.num_attention_heads * m.resolved_head_dim, \
        m.num_query_groups * m.resolved_head_dim, m.ffn_hidden_size
    shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h)]  # (in, out)
    adapters = m.num_layers * sum(RANK * (i + o) for i, o in shapes)
    hub = hub_state_dict(build_hf_model(m, seed=0))
    assert m.tie_word_embeddings
    return 4 * adapters, 4 * sum(t.numel() for k, t in hub.items() if k != "lm_head.weight")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_engine_computes_the_trainers_logprobs(results, layout):
    for step, r in enumerate(results[layout]["rollouts"]):
        assert r["diff"] <= 1e-4, (step, r["diff"])
        assert r["versions"] == [step + 1]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_base_travels_once_and_then_the_adapters_alone(results, layout):
    adapter_bytes, base_bytes = sync_sizes()
    first, second, third = results[layout]["rollouts"]
    assert first["bytes"] == base_bytes + adapter_bytes
    assert second["bytes"] == adapter_bytes < base_bytes / 10
    assert third["bytes"] == first["bytes"]  # weights were loaded into the trainer: the base again
    # between rollouts the engine keeps its weights and gives back its KV cache
    assert all(r["released"] == ["kv_cache"] for r in results[layout]["rollouts"])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_an_adapter_only_sync_brings_back_the_adapters_alone(results, layout):
    assert results[layout]["moved"] == ["a", "b"]  # LoRAAdapter's factors; the frozen weights stay off
    assert results[layout]["full_moves_everything"]
