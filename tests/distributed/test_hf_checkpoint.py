"""HF checkpoints in and out, per family: checkpoints written by `transformers` itself load into
Megatron at TP=1, TP=2 and PP=2 (for a mixture of experts - Qwen3-MoE with a dense layer among
the sparse ones, Mixtral, Qwen2-MoE, GLM-4.5 MoE - also EP=2, TP=2 x EP=2 and PP=2 x EP=2 on four
ranks) with the same log-probs as `transformers` computes, and the export loads back into
`transformers` bit-exactly.

Tolerance: fp32 on both sides, different kernels and reduction orders; observed differences
are ~1e-6, the issue's bound is 1e-4.
"""

from __future__ import annotations

import json

from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import run_spawned

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

FAMILY_CONFIGS = {
    "llama": dict(family="llama", tie_word_embeddings=False, num_layers=4),
    "qwen2": dict(family="qwen2", tie_word_embeddings=True, num_layers=4),
    "qwen3": dict(family="qwen3", tie_word_embeddings=True, num_layers=4, head_dim=48),
    # layer 1 dense (HF mlp_only_layers=[1]): at PP=2 one stage holds a dense and a sparse layer
    "qwen3_moe": dict(family="qwen3_moe", tie_word_embeddings=False, num_layers=4, head_dim=48, num_experts=4,
                      moe_ffn_hidden_size=64, moe_router_topk=2, moe_dense_layers=[1]),
    "mixtral": dict(family="mixtral", tie_word_embeddings=False, num_layers=4, ffn_hidden_size=64, num_experts=4,
                    moe_ffn_hidden_size=64, moe_router_topk=2),
    "qwen2_moe": dict(family="qwen2_moe", tie_word_embeddings=False, num_layers=4, num_experts=4,
                      moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=96, moe_router_topk=2,
                      moe_norm_topk_prob=False),
    "glm4_moe": dict(family="glm4_moe", tie_word_embeddings=False, num_layers=4, num_experts=4,
                     moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=128, moe_router_topk=2,
                     moe_dense_layers=[0], rotary_percent=0.5, moe_routed_scaling_factor=2.5,
                     moe_router_num_groups=2, moe_router_group_topk=1),
}
LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "ep2": (1, 1, 2),  # (tp, pp, ep)
           "tp2_ep2": (2, 1, 2), "pp2_ep2": (1, 2, 2)}
CASES = [(family, layout) for family in sorted(FAMILY_CONFIGS) for layout in sorted(LAYOUTS)
         if LAYOUTS[layout][2] == 1 or "num_experts" in FAMILY_CONFIGS[family]]


def _model_cfg(family):
    from megatron_rl.config.schema import ModelConfig

    return ModelConfig(**FAMILY_CONFIGS[family])


def _sequences():
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 99, (n,), generator=gen) for n in (17, 9, 30)]


def _worker(rank: int, world: int, ckpt_root: str, layouts: dict, out_root: str) -> None:
    from megatron_rl.config.schema import OptimizerConfig
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions
    from megatron_rl.trainer.packing import Sample

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    tokenizer = load_tokenizer("builtin:char")
    results = {}
    for family in FAMILY_CONFIGS:
        cfg = _model_cfg(family)
        cfg.path = str(Path(ckpt_root) / family)
        for name, (tp, pp, ep) in layouts.items():
            if (family, name) not in CASES:
                continue
            groups = state.initialize(tp, pp, ep=ep)
            trainer = Trainer(cfg, OptimizerConfig(), groups, TrainerOptions(micro_batch_tokens=64))
            trainer.initialize_weights()
            samples = [Sample(s, torch.ones(len(s) - 1)) for s in _sequences()]
            results[(family, name)], _ = trainer.forward_logprobs(samples)
            from megatron_rl.checkpoint.hf import export_hf

            export_hf(trainer.module, groups, cfg, Path(out_root) / f"{family}-{name}", tokenizer,
                      max_shard_size="100KB")
            state.destroy()
    if rank == 0:
        torch.save(results, Path(out_root) / f"logprobs-{world}.pt")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """HF checkpoints written by transformers' own save_pretrained (qwen2 and qwen3_moe sharded)."""
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.models.hf import build_hf_model

    root = tmp_path_factory.mktemp("hf")
    tokenizer = load_tokenizer("builtin:char")
    for family in FAMILY_CONFIGS:
        model = build_hf_model(_model_cfg(family), seed=21)
        if family == "llama":  # special tokens as Llama 3.1 has them: several end ids, bos apart, sampling defaults
            from transformers import GenerationConfig

            model.config.update({"bos_token_id": 1, "eos_token_id": [0, 3], "pad_token_id": None})
            model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[0, 3], do_sample=True,
                                                       temperature=0.6, top_p=0.9)
        shard = "150KB" if family in ("qwen2", "qwen3_moe") else "50GB"
        model.save_pretrained(root / family, max_shard_size=shard)
        tokenizer.save_pretrained(root / family)
    assert (root / "qwen2" / "model.safetensors.index.json").exists()
    assert (root / "qwen3_moe" / "model.safetensors.index.json").exists()
    assert (root / "llama" / "model.safetensors").exists()
    return root


@pytest.fixture(scope="module")
def results(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    run_spawned(_worker, 1, str(checkpoints), {"tp1": LAYOUTS["tp1"]}, str(out))
    run_spawned(_worker, 2, str(checkpoints), {k: LAYOUTS[k] for k in ("tp2", "pp2", "ep2")}, str(out))
    run_spawned(_worker, 4, str(checkpoints), {k: LAYOUTS[k] for k in ("tp2_ep2", "pp2_ep2")}, str(out))
    logprobs = {k: v for world in (1, 2, 4) for k, v in torch.load(out / f"logprobs-{world}.pt").items()}
    return out, logprobs


def _hf_logprobs(path):
    from transformers import AutoModelForCausalLM

    from tests.reference import teacher_forced_logprobs

    return teacher_forced_logprobs(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
                                   _sequences())


@pytest.mark.parametrize(("family", "layout"), CASES)
def test_megatron_logprobs_match_transformers(checkpoints, results, family, layout):
    _, logprobs = results
    for got, want in zip(logprobs[(family, layout)], _hf_logprobs(checkpoints / family), strict=True):
        assert (got.double() - want).abs().max() <= 1e-4


@pytest.mark.parametrize(("family", "layout"), CASES)
def test_export_round_trip_is_bit_exact(checkpoints, results, family, layout):
    from transformers import AutoModelForCausalLM

    from megatron_rl.data.tokenizer import load_tokenizer

    out, _ = results
    exported = out / f"{family}-{layout}"
    assert (exported / "model.safetensors.index.json").exists(), "the 100KB limit must shard the export"
    original = AutoModelForCausalLM.from_pretrained(checkpoints / family, dtype=torch.float32).state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).state_dict()
    assert sorted(loaded) == sorted(original)
    for key, value in original.items():
        assert torch.equal(loaded[key], value), key
    tokenizer = load_tokenizer(str(exported))
    assert tokenizer.decode(tokenizer("3 5 7 -> 22")["input_ids"]) == "3 5 7 -> 22"
    source, written = (json.loads((d / "config.json").read_text()) for d in (checkpoints / family, exported))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert written.get(key) == source.get(key), key  # the checkpoint's special tokens, not the tokenizer's eos
    if (checkpoints / family / "generation_config.json").exists():
        assert (exported / "generation_config.json").read_text() == \
            (checkpoints / family / "generation_config.json").read_text()
    assert not list(out.glob("*.tmp")), "no temporary directory may be left behind"
