"""Weight sync from Megatron into the hf rollout engine and the colocated phase order.

After a sync at TP=1, TP=2 and PP=2 (and of a Mixtral mixture of experts at EP=2, whose experts
transformers holds fused while the sync sends them one by one, and of a Qwen2-MoE at TP=2 with
sequence parallelism, whose shared expert is split over the TP ranks and whose layer 1 is dense,
and of a GLM-4.5 MoE at PP=2, whose routers' selection bias is a buffer, not a parameter, and of a
DeepSeek-V3 at TP=2 with sequence parallelism, whose multi-latent attention's projections are split
over the TP ranks, and of a gpt-oss at TP=2 with sequence parallelism, whose attention sinks are split over
the TP ranks and whose experts, unsplit, arrive stacked as transformers holds them)
the engine holds exactly the trainer's weights (bit-exact against the converter's HF tensors; at PP=1 the sync
writes them in place, at PP=2 it streams buckets), and the engine's
log-probs of its sampled tokens equal Megatron's recomputed log-probs (fp32; bound 1e-4, observed
~5e-7), so the first update's importance ratio is 1. The colocation controller runs its phases in
the documented order, the engine really gives up its weights between rollouts, and versions
advance per sync.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed.launcher import run_spawned
from tests.distributed.test_gpt_oss import ARCH as GPT_OSS

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

LAYOUTS = {"tp1": (1, 1, 1, 1), "tp2": (2, 1, 1, 2), "pp2": (1, 2, 1, 2), "mixtral_ep2": (1, 1, 2, 2),
           "qwen2_moe_tp2_sp": (2, 1, 1, 2), "glm4_moe_pp2": (1, 2, 1, 2),
           "deepseek_v3_tp2_sp": (2, 1, 1, 2), "gpt_oss_tp2_sp": (2, 1, 1, 2)}  # tp pp ep world
MODELS = {"mixtral_ep2": dict(family="mixtral", ffn_hidden_size=64, num_experts=4, moe_ffn_hidden_size=64,
                              tie_word_embeddings=False),
          "qwen2_moe_tp2_sp": dict(family="qwen2_moe", num_experts=4, moe_ffn_hidden_size=64,
                                   moe_shared_expert_intermediate_size=96, moe_norm_topk_prob=False,
                                   tie_word_embeddings=False, moe_dense_layers=[1]),
          "glm4_moe_pp2": dict(family="glm4_moe", num_experts=4, moe_ffn_hidden_size=64,
                               moe_shared_expert_intermediate_size=128, moe_dense_layers=[0], rotary_percent=0.5,
                               moe_routed_scaling_factor=2.5, tie_word_embeddings=False),
          "deepseek_v3_tp2_sp": dict(family="deepseek_v3", num_query_groups=4, num_experts=4, moe_ffn_hidden_size=64,
                                     moe_shared_expert_intermediate_size=64, moe_dense_layers=[0],
                                     moe_routed_scaling_factor=2.5, tie_word_embeddings=False, q_lora_rank=32,
                                     kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
                                     rope_scaling_factor=8.0, max_position_embeddings=512,
                                     rope_scaling_original_max_position_embeddings=64, rope_scaling_mscale=1.0,
                                     rope_scaling_mscale_all_dim=1.0),
          # gpt-oss: stacked experts (transformers holds them so too), sinks split over TP, experts not (etp=1)
          "gpt_oss_tp2_sp": {k: v for k, v in GPT_OSS.items() if k != "num_layers"}}
SEQUENCE_PARALLEL = {"qwen2_moe_tp2_sp", "deepseek_v3_tp2_sp", "gpt_oss_tp2_sp"}  # Megatron-core trains MoE layers at TP > 1 only with SP
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]
TEMPERATURE = 0.7


def _worker(rank, world, tp, pp, ep, sequence_parallel, model, out):
    from megatron_rl.colocate.controller import ColocationController
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.hf_engine import EngineStateError, HFEngine
    from megatron_rl.trainer.core import Trainer, TrainerOptions
    from megatron_rl.families import get_converter

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    model_cfg = ModelConfig(num_layers=4, **model)
    groups = state.initialize(tp, pp, ep=ep, etp=1 if model_cfg.linear_bias else None,
                              sequence_parallel=sequence_parallel)
    trainer = Trainer(model_cfg, OptimizerConfig(lr=1e-2), groups,
                      TrainerOptions(micro_batch_tokens=256, logprob_temperature=TEMPERATURE))
    trainer.initialize_weights()
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():  # GLM-4.5's selection bias (a router buffer, 0 at init) must travel too
        for name, buffer in sorted(trainer.module.named_buffers()):
            if name.endswith("router.expert_bias"):
                buffer.copy_(0.01 * torch.randn(buffer.shape, generator=gen))
    engine = HFEngine(model_cfg)
    engine.release_memory()
    controller = ColocationController(trainer, engine, bucket_bytes=100_000)
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=12, n=2, seed=1)
    generations = controller.rollout(lambda: engine.generate(PROMPTS, params))
    sync = controller.last_sync

    # the engine's weights vs the trainer's (as an HF state dict)
    full = trainer.full_state_dict()
    expected = get_converter(model_cfg.family).megatron_to_hf(full, model_cfg)
    engine.resume_memory()
    from megatron_rl.weight_sync.stream import sync_weights

    sync_weights(trainer.module, groups, model_cfg, engine, 1)
    held = engine.hf_state_dict()
    weight_diff = max((held[k] - v).abs().max().item() for k, v in expected.items())
    released_error = None
    engine.release_memory()
    try:
        engine.generate(PROMPTS, params)
    except EngineStateError as exc:
        released_error = str(exc)

    samples, diffs = engine_vs_trainer(trainer, PROMPTS, generations)

    # a training step, then a second rollout: the engine must follow (version 2, new weights)
    trainer.train_step(samples)
    again = controller.rollout(lambda: engine.generate(PROMPTS, params))
    if rank == 0:
        torch.save({"phases": controller.phase_log, "diffs": diffs, "weight_diff": weight_diff,
                    "versions": sorted({g.weight_version for g in generations}),
                    "versions_after": sorted({g.weight_version for g in again}),
                    "outputs": [g.output_ids for g in generations], "outputs_after": [g.output_ids for g in again],
                    "released_error": released_error, "sync": (sync.num_tensors, sync.num_bytes, sync.num_buckets),
                    "hf_bytes": sum(v.numel() * v.element_size() for k, v in expected.items()
                                    if not (k == "lm_head.weight" and model_cfg.tie_word_embeddings)),
                    "count": len(generations)}, out)


def engine_vs_trainer(trainer, prompts, generations) -> tuple[list, list[float]]:
    """(`generations` as training samples, each one's largest |engine - trainer| log-prob of its response)."""
    from megatron_rl.trainer.packing import Sample

    samples = []
    for gen in generations:
        prompt = prompts[gen.prompt_index]
        tokens = torch.tensor(prompt + gen.output_ids)
        mask = torch.zeros(len(tokens) - 1)
        mask[len(prompt) - 1:] = 1
        samples.append(Sample(tokens, mask))
    recomputed, _ = trainer.forward_logprobs(samples)
    return samples, [(lp[s.loss_mask.bool()] - torch.tensor(g.logprobs)).abs().max().item()
                     for g, lp, s in zip(generations, recomputed, samples)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sync")
    got = {}
    for name, (tp, pp, ep, world) in LAYOUTS.items():
        run_spawned(_worker, world, tp, pp, ep, name in SEQUENCE_PARALLEL, MODELS.get(name, {}),
                    str(out / f"{name}.pt"))
        got[name] = torch.load(out / f"{name}.pt", weights_only=False)
    return got


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_engine_logprobs_match_megatron(results, layout):
    r = results[layout]
    assert r["count"] == len(PROMPTS) * 2
    assert max(r["diffs"]) <= 1e-4
    # importance ratio of the first update: exp(train - rollout) within 1e-4 of 1
    assert abs(math.exp(max(r["diffs"])) - 1) <= 1e-4


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_engine_holds_exactly_the_trainers_weights(results, layout):
    assert results[layout]["weight_diff"] == 0.0


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sync_moves_all_weights_in_place_or_in_buckets(results, layout):
    num_tensors, num_bytes, num_buckets = results[layout]["sync"]
    assert num_bytes == results[layout]["hf_bytes"]  # every weight once: a tied lm_head is the embedding
    if LAYOUTS[layout][1] == 1:  # PP=1: the engine, in this process, is written in place (no buckets)
        assert num_buckets == 0
    else:  # other stages' tensors arrive by broadcast, a bucket at a time
        assert num_buckets > 1, "the 100 kB bucket limit must split the 1 MB model"


def test_phase_order(results):
    from megatron_rl.colocate.controller import PHASES

    assert results["tp1"]["phases"] == list(PHASES) * 2


def test_versions_advance_and_outputs_follow_the_weights(results):
    r = results["tp1"]
    assert r["versions"] == [1] and r["versions_after"] == [2]
    assert r["outputs"] != r["outputs_after"], "after a training step the engine must generate differently"


def test_generate_while_released_is_refused(results):
    assert "released" in results["tp1"]["released_error"]


def _bucket_worker(rank, world, out):
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.weight_sync.stream import _broadcast_bucket

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    groups = state.initialize(1, 2)
    bucket = [("w", torch.arange(3, dtype=torch.bfloat16)),  # 6 bytes: the fp32 tensor after it is misaligned
              ("model.layers.3.mlp.gate.e_score_correction_bias", torch.tensor([1 + 2 ** -12, -0.3, 1e-3])),
              ("steps", torch.arange(5, dtype=torch.int64))]
    got = _broadcast_bucket(bucket if groups.pp_rank == 1 else None, 1, groups)  # from the last stage
    ended = _broadcast_bucket(None, 1, groups)
    torch.save({"got": got, "sent": bucket, "ended": ended}, f"{out}.{rank}")


def test_pipeline_stages_pass_buckets_in_each_tensors_own_dtype(tmp_path):
    """Weight sync at PP > 1 broadcasts each stage's buckets to the others: every tensor arrives in
    its own dtype, bit-exact (GLM-4.5's fp32 router bias beside bf16 weights was cast to the
    weights' dtype before), also where its bytes start at an offset its dtype cannot view."""
    run_spawned(_bucket_worker, 2, str(tmp_path / "r"), timeout_s=120)
    received = torch.load(tmp_path / "r.0")
    assert received["ended"] is None
    assert [n for n, _ in received["got"]] == [n for n, _ in received["sent"]]
    for (_, got), (_, sent) in zip(received["got"], received["sent"]):
        assert got.dtype == sent.dtype and torch.equal(got, sent)


def _export_worker(rank, world, out):
    from megatron_rl.checkpoint.hf import export_hf
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    groups = state.initialize(1, 1)
    cfg = ModelConfig(**MODELS["glm4_moe_pp2"], num_layers=2)
    trainer = Trainer(cfg, OptimizerConfig(), groups, TrainerOptions(micro_batch_tokens=64))
    trainer.initialize_weights()
    with torch.no_grad():
        trainer.module.decoder.layers[1].mlp.router.expert_bias.copy_(torch.tensor([1 + 2 ** -12, -0.3, 1e-3, 0.5]))
    export_hf(trainer.module, groups, cfg, out, dtype=torch.bfloat16)


def test_a_bf16_export_keeps_what_transformers_keeps_in_fp32(tmp_path):
    """export_hf(dtype=bf16) of a GLM-4.5 MoE: the weights in bf16, the router weight and its
    selection bias in fp32 as transformers holds them (the bias bit-exact: not bf16 numbers)."""
    from safetensors.torch import load_file

    run_spawned(_export_worker, 1, str(tmp_path / "glm"), timeout_s=120)
    tensors = {k: v for f in sorted((tmp_path / "glm").glob("*.safetensors")) for k, v in load_file(f).items()}
    bias = tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and torch.equal(bias, torch.tensor([1 + 2 ** -12, -0.3, 1e-3, 0.5]))
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert tensors["model.layers.1.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.0.mlp.gate_proj.weight"].dtype == torch.bfloat16
