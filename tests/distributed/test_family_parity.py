"""Mixtral, Qwen2-MoE, GLM-4.5 MoE, DeepSeek-V3, Llama 3.1 (rope-scaled) and Qwen2 with YaRN checkpoints
written by `transformers` itself: the architecture read from their config.json, loaded into Megatron (single
process; Mixtral also at EP=2 and PP=2, Qwen2-MoE at EP=2 and at TP=2 with sequence parallelism, GLM-4.5 MoE
at EP=2, PP=2 and TP=2 with sequence parallelism, DeepSeek-V3 at EP=2, PP=2, TP=2 with sequence parallelism
and CP=2, the rope-scaled Llama and the YaRN Qwen2 at CP=2),
gives the log-probs and entropies `transformers` computes, and the export loads back into
`transformers` bit-exactly with the same config.

Tolerance 2e-5 (fp32), as in test_moe_parity.py; observed differences are ~1e-6.

Llama 3.1 scaling changes only frequencies with wavelengths above 2048 positions
(original_max_position_embeddings 8192 / high_freq_factor 4, both fixed in Megatron-core), whose
rotation over a few hundred tokens is small; with `transformers`' initialisation (std 0.02) the
attention is then nearly uniform and blind to it. The checkpoint's Q and K projections are
therefore scaled by 8 (sharper attention), and a guard test checks that `transformers` without
the scaling differs from it by far more than the tolerance: a Megatron run that ignored the
scaling would fail the comparison.

Qwen2 with YaRN as Qwen's model cards give it (factor 4, the original context shorter than the test's
sequences, transformers' other defaults), Q and K scaled by 8 as for Llama 3.1; guarded by transformers
without YaRN and with YaRN's frequencies but attention factor 1.

Qwen2-MoE adds a shared expert scaled by sigmoid(x @ w_gate) and routes without renormalising the
top-k weights; a guard test checks that fixing the gate at 0.5 or renormalising moves
`transformers`' log-probs by far more than the tolerance, so neither can go unnoticed.

GLM-4.5 MoE: a dense first layer, RoPE on half of each head, a sigmoid router that chooses experts
by score + a per-expert bias from the best of two groups and scales their weights by 2.5, two
shared experts without a gate. The checkpoint gets a random bias (transformers initialises it to 0)
and a router 8 times sharper, so that the bias changes which experts are chosen; a guard test
checks that zeroing the bias, rotating whole heads, or not scaling moves `transformers`' log-probs
by far more than the tolerance.

DeepSeek-V3: multi-latent attention (compressed queries and key-values, YaRN-scaled RoPE on 8 of each
head's 24 query/key dimensions, with YaRN's softmax scale) and GLM's router; a second checkpoint projects
queries directly (q_lora_rank null, as DeepSeek-V2-Lite) with plain RoPE and tied embeddings. Query and
key-value up projections are scaled by 6 and the router by 8, the selection bias random; a guard test
checks that transformers without YaRN, with the rotated dimensions read as halves instead of interleaved
pairs, or without YaRN's softmax scale, is far from the checkpoint's.

DeepSeek-V2: direct queries, YaRN with DeepSeek-V2-Lite's mscale 0.707, 8 experts in 4 groups, 3 per token
from the 2 groups with the best expert, softmax weights scaled by 1.5 and not renormalised, checked at
TP=1, EP=2 and TP=2 + SP; guarded by transformers choosing from all experts and without the scaling.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import run_spawned

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

CHECKPOINTS = {
    "mixtral": dict(family="mixtral", num_layers=4, tie_word_embeddings=False, ffn_hidden_size=64, num_experts=4,
                    moe_ffn_hidden_size=64, moe_router_topk=2),
    "llama3_1": dict(family="llama", num_layers=4, tie_word_embeddings=False, rope_theta=500000.0,
                     rope_scaling_factor=8.0, max_position_embeddings=16384),
    # Qwen's long-context recipe (factor 4 over the original context, transformers' other YaRN defaults), at a
    # scale the test's sequences exceed
    "qwen2_yarn": dict(family="qwen2", num_layers=2, tie_word_embeddings=False, qkv_bias=True,
                       rope_scaling_type="yarn", rope_scaling_factor=4.0, max_position_embeddings=512,
                       rope_scaling_original_max_position_embeddings=128),
    "qwen2_moe": dict(family="qwen2_moe", num_layers=4, tie_word_embeddings=False, num_experts=4,
                      moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=96, moe_router_topk=2,
                      moe_norm_topk_prob=False),
    "glm4_moe": dict(family="glm4_moe", num_layers=4, tie_word_embeddings=False, num_experts=4,
                     moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=128, moe_router_topk=2,
                     moe_dense_layers=[0], moe_router_num_groups=2, moe_router_group_topk=1,
                     moe_routed_scaling_factor=2.5, rotary_percent=0.5),
    "deepseek_v3": dict(family="deepseek_v3", num_layers=4, tie_word_embeddings=False, num_query_groups=4,
                        num_experts=4, moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=64,
                        moe_router_topk=2, moe_dense_layers=[0], moe_router_num_groups=2, moe_router_group_topk=1,
                        moe_routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=24, rope_scaling_factor=8.0, max_position_embeddings=512,
                        rope_scaling_original_max_position_embeddings=64, rope_scaling_mscale=1.0,
                        rope_scaling_mscale_all_dim=1.0),
    "deepseek_v2": dict(family="deepseek_v2", num_layers=4, tie_word_embeddings=False, num_query_groups=4,
                        num_experts=8, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=64,
                        moe_router_topk=3, moe_norm_topk_prob=False, moe_router_num_groups=4, moe_router_group_topk=2,
                        moe_routed_scaling_factor=1.5, moe_dense_layers=[0], q_lora_rank=None, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, rope_scaling_factor=8.0,
                        max_position_embeddings=512, rope_scaling_original_max_position_embeddings=64,
                        rope_scaling_mscale=0.707, rope_scaling_mscale_all_dim=0.707),
    "deepseek_v3_direct_q": dict(family="deepseek_v3", num_layers=2, tie_word_embeddings=True, num_query_groups=4,
                                 num_experts=4, moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=128,
                                 moe_router_topk=2, moe_routed_scaling_factor=1.5, q_lora_rank=None, kv_lora_rank=16,
                                 qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16),
}
LAYOUTS = {"tp1": dict(tp=1, pp=1, cp=1, ep=1), "ep2": dict(tp=1, pp=1, cp=1, ep=2),
           "pp2": dict(tp=1, pp=2, cp=1, ep=1), "cp2": dict(tp=1, pp=1, cp=2, ep=1),
           "tp2_sp": dict(tp=2, pp=1, cp=1, ep=1)}  # Megatron-core runs MoE layers at TP > 1 only with SP
CASES = [("mixtral", "tp1"), ("mixtral", "ep2"), ("mixtral", "pp2"), ("llama3_1", "tp1"), ("llama3_1", "cp2"),
         ("qwen2_yarn", "tp1"), ("qwen2_yarn", "cp2"),
         ("qwen2_moe", "tp1"), ("qwen2_moe", "ep2"), ("qwen2_moe", "tp2_sp"),
         ("glm4_moe", "tp1"), ("glm4_moe", "ep2"), ("glm4_moe", "pp2"), ("glm4_moe", "tp2_sp"),
         ("deepseek_v3", "tp1"), ("deepseek_v3", "ep2"), ("deepseek_v3", "pp2"), ("deepseek_v3", "tp2_sp"),
         ("deepseek_v3", "cp2"), ("deepseek_v3_direct_q", "tp1"), ("deepseek_v3_direct_q", "tp2_sp"),
         ("deepseek_v2", "tp1"), ("deepseek_v2", "ep2"), ("deepseek_v2", "tp2_sp")]
LENGTHS = (300, 77, 180)
TOL = 2e-5


def _sequences():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 128, (n,), generator=gen) for n in LENGTHS]


def _worker(rank: int, world: int, ckpt_root: str, cases: list, out_root: str) -> None:
    from megatron_rl.checkpoint.hf import arch_from_hf_config, export_hf
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions
    from megatron_rl.trainer.packing import Sample

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    results = {}
    for name, layout in cases:
        path = Path(ckpt_root) / name
        cfg = ModelConfig(**arch_from_hf_config(path), path=str(path))  # as runtime.load_validated does
        par = LAYOUTS[layout]
        groups = state.initialize(par["tp"], par["pp"], par["cp"], ep=par["ep"], sequence_parallel=par["tp"] > 1)
        trainer = Trainer(cfg, OptimizerConfig(), groups, TrainerOptions(micro_batch_tokens=320))
        trainer.initialize_weights()
        samples = [Sample(s, torch.ones(len(s) - 1)) for s in _sequences()]
        results[(name, layout)] = trainer.forward_logprobs(samples, with_entropy=True)
        export_hf(trainer.module, groups, cfg, Path(out_root) / f"{name}-{layout}")
        state.destroy()
    if rank == 0:
        torch.save(results, Path(out_root) / f"logprobs-{world}.pt")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.hf import build_hf_model

    root = tmp_path_factory.mktemp("hf")
    for name, fields in CHECKPOINTS.items():
        model = build_hf_model(ModelConfig(**fields), seed=21)
        if name in ("llama3_1", "qwen2_yarn"):
            with torch.no_grad():
                for layer in model.model.layers:  # sharper attention: see the module docstring
                    layer.self_attn.q_proj.weight.mul_(8.0)
                    layer.self_attn.k_proj.weight.mul_(8.0)
        if name == "glm4_moe":
            gen = torch.Generator().manual_seed(3)
            with torch.no_grad():
                for layer in model.model.layers[1:]:  # the sparse ones: see the module docstring
                    layer.mlp.gate.weight.mul_(8.0)
                    layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(4, generator=gen))
        if name.startswith("deepseek"):
            gen = torch.Generator().manual_seed(4)
            with torch.no_grad():
                for layer in model.model.layers:  # sharper attention and routing: see the module docstring
                    for proj in ("q_b_proj", "q_proj", "kv_b_proj"):
                        if getattr(layer.self_attn, proj, None) is not None:
                            getattr(layer.self_attn, proj).weight.mul_(6.0)
                for layer in model.model.layers[len(fields.get("moe_dense_layers", [])):]:
                    layer.mlp.gate.weight.mul_(8.0)
                    if name.startswith("deepseek_v3"):
                        layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(4, generator=gen))
        model.save_pretrained(root / name)
    return root


@pytest.fixture(scope="module")
def results(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    run_spawned(_worker, 1, str(checkpoints), [c for c in CASES if c[1] == "tp1"], str(out))
    run_spawned(_worker, 2, str(checkpoints), [c for c in CASES if c[1] != "tp1"], str(out))
    return out, {k: v for world in (1, 2) for k, v in torch.load(out / f"logprobs-{world}.pt").items()}


def _hf_logprobs(path, **config_overrides):
    """Per-sequence (log-probs, entropies) from transformers, in float64 after the logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, **config_overrides)
    from tests.reference import teacher_forced_logprobs

    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    return teacher_forced_logprobs(model, _sequences(), entropies=True)


@pytest.mark.parametrize(("name", "layout"), CASES)
def test_megatron_logprobs_match_transformers(checkpoints, results, name, layout):
    _, runs = results
    logprobs, entropies = runs[(name, layout)]
    for got_lp, got_ent, (lp, ent) in zip(logprobs, entropies, _hf_logprobs(checkpoints / name), strict=True):
        assert (got_lp.double() - lp).abs().max() <= TOL, (got_lp.double() - lp).abs().max()
        assert (got_ent.double() - ent).abs().max() <= TOL


def test_rope_scaling_changes_the_reference(checkpoints):
    """Guards the llama3_1 comparison: transformers without the scaling is far from it."""
    theta = CHECKPOINTS["llama3_1"]["rope_theta"]
    scaled = _hf_logprobs(checkpoints / "llama3_1")
    plain = _hf_logprobs(checkpoints / "llama3_1", rope_parameters={"rope_type": "default", "rope_theta": theta})
    assert max((a - b).abs().max().item() for (a, _), (b, _) in zip(scaled, plain)) > 100 * TOL


def test_qwen2_yarn_changes_the_reference(checkpoints):
    """Guards the qwen2_yarn comparison: transformers without YaRN, or with YaRN's frequencies but no
    attention factor (1 instead of 0.1 ln 4 + 1), is far from it."""
    path = checkpoints / "qwen2_yarn"
    rope = json.loads((path / "config.json").read_text())["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0 and rope["original_max_position_embeddings"] == 128
    reference = _hf_logprobs(path)
    variants = [_hf_logprobs(path, rope_parameters={"rope_type": "default", "rope_theta": rope["rope_theta"]}),
                _hf_logprobs(path, rope_parameters={**rope, "attention_factor": 1.0})]
    for variant in variants:
        assert max((a - b).abs().max().item() for (a, _), (b, _) in zip(reference, variant)) > 100 * TOL


def test_shared_expert_gate_and_routing_change_the_reference(checkpoints, tmp_path):
    """Guards the qwen2_moe comparison: transformers with the shared expert's gate fixed at
    sigmoid(0) = 0.5, or with renormalised top-k weights, is far from the checkpoint's."""
    from transformers import AutoModelForCausalLM

    reference = _hf_logprobs(checkpoints / "qwen2_moe")
    model = AutoModelForCausalLM.from_pretrained(checkpoints / "qwen2_moe", dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.shared_expert_gate.weight.zero_()
    model.save_pretrained(tmp_path / "gate_fixed")
    variants = [_hf_logprobs(tmp_path / "gate_fixed"), _hf_logprobs(checkpoints / "qwen2_moe", norm_topk_prob=True)]
    for variant in variants:
        assert max((a - b).abs().max().item() for (a, _), (b, _) in zip(reference, variant)) > 100 * TOL


def test_glm4_moe_bias_partial_rope_and_scaling_change_the_reference(checkpoints, tmp_path):
    """Guards the glm4_moe comparison: transformers without the selection bias, with RoPE on whole
    heads, or without the routed scaling factor is far from the checkpoint's."""
    from transformers import AutoModelForCausalLM

    path = checkpoints / "glm4_moe"
    reference = _hf_logprobs(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.abs().max() > 0.1  # the checkpoint's, loaded
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.zero_()
    model.save_pretrained(tmp_path / "no_bias")
    theta = json.loads((path / "config.json").read_text())["rope_parameters"]["rope_theta"]
    variants = [_hf_logprobs(tmp_path / "no_bias"), _hf_logprobs(path, routed_scaling_factor=1.0),
                _hf_logprobs(path, rope_parameters={"rope_type": "default", "rope_theta": theta,
                                                    "partial_rotary_factor": 1.0})]
    for variant in variants:
        assert max((a - b).abs().max().item() for (a, _), (b, _) in zip(reference, variant)) > 100 * TOL


def test_deepseek_v3_yarn_interleave_and_softmax_scale_change_the_reference(checkpoints):
    """Guards the deepseek_v3 comparison: transformers without YaRN, reading the rotated dimensions as
    halves instead of interleaved pairs, or without YaRN's softmax scale is far from the checkpoint's."""
    path = checkpoints / "deepseek_v3"
    rope = json.loads((path / "config.json").read_text())["rope_parameters"]
    assert rope["rope_type"] == "yarn"
    reference = _hf_logprobs(path)
    variants = [_hf_logprobs(path, rope_parameters={"rope_type": "default", "rope_theta": rope["rope_theta"]}),
                _hf_logprobs(path, rope_interleave=False),
                _hf_logprobs(path, rope_parameters={**rope, "mscale_all_dim": 0.0, "mscale": 1.0})]
    for variant in variants:
        assert max((a - b).abs().max().item() for (a, _), (b, _) in zip(reference, variant)) > 100 * TOL


def test_deepseek_v2_groups_and_scaling_change_the_reference(checkpoints):
    """Guards the deepseek_v2 comparison: transformers choosing from all experts (greedy) or without the
    routed scaling factor is far from the checkpoint's."""
    path = checkpoints / "deepseek_v2"
    reference = _hf_logprobs(path)
    variants = [_hf_logprobs(path, topk_method="greedy"), _hf_logprobs(path, routed_scaling_factor=1.0)]
    for variant in variants:
        assert max((a - b).abs().max().item() for (a, _), (b, _) in zip(reference, variant)) > 100 * TOL


@pytest.mark.parametrize(("name", "layout"), CASES)
def test_export_round_trip_is_bit_exact(checkpoints, results, name, layout):
    from transformers import AutoModelForCausalLM

    from megatron_rl.checkpoint.hf import arch_from_hf_config

    out, _ = results
    exported = out / f"{name}-{layout}"
    original = AutoModelForCausalLM.from_pretrained(checkpoints / name, dtype=torch.float32)
    loaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    assert type(loaded) is type(original)
    want, got = original.state_dict(), loaded.state_dict()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert arch_from_hf_config(exported) == arch_from_hf_config(checkpoints / name)
    written = json.loads((exported / "config.json").read_text())
    if name in ("llama3_1", "qwen2_yarn"):
        assert written["rope_parameters"] == json.loads((checkpoints / name / "config.json").read_text())[
            "rope_parameters"]
    elif name == "glm4_moe":
        assert (written["model_type"], written["n_routed_experts"], written["n_shared_experts"],
                written["first_k_dense_replace"], written["n_group"], written["routed_scaling_factor"],
                written["rope_parameters"]["partial_rotary_factor"]) == ("glm4_moe", 4, 2, 1, 2, 2.5, 0.5)
    elif name.startswith("deepseek"):
        want = json.loads((checkpoints / name / "config.json").read_text())
        keys = ("model_type", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "n_routed_experts", "n_shared_experts", "first_k_dense_replace", "n_group", "topk_group",
                "routed_scaling_factor", "rope_parameters", "topk_method", "scoring_func")
        assert {k: written[k] for k in keys} == {k: want[k] for k in keys}
    elif name == "qwen2_moe":
        widths = (written["moe_intermediate_size"], written["shared_expert_intermediate_size"])
        assert (written["model_type"], written["num_experts"], widths, written["norm_topk_prob"]) == (
            "qwen2_moe", 4, (64, 96), False)
    else:
        assert (written["model_type"], written["num_local_experts"], written["intermediate_size"]) == ("mixtral", 4, 64)
