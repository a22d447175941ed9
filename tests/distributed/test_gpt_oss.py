"""gpt-oss checkpoints written by `transformers` itself: the architecture read from their config.json, loaded
into Megatron (single process, EP=2, PP=2, TP=2 with sequence parallelism and expert TP 1, the same with EP=2
over the TP ranks), gives the
log-probs and entropies `transformers` computes, and the export loads back into `transformers` bit-exactly.

The checkpoint is made to exercise what gpt-oss adds, each guarded by a test that transformers without it is
far (> 100x the tolerance) from the checkpoint's log-probs, so that a Megatron run ignoring it would fail:
- attention sinks: random sink logits of std 2 (transformers initialises them near 0);
- sliding windows of 16 tokens in layers 0 and 3 (sequences of 77-300 tokens; two share a packed row; under
  PP=2 a window found by the stage's own layer index instead of the global one would fall on layer 2);
- YaRN with truncate false (factor 4 over an original context of 128), the attention sharpened (Q, K x 4)
  so that positions matter;
- the experts' clamped SwiGLU with the +1 on the up projection: expert weights scaled by 40 so that the
  clamp at 7 bites (the guard lifts the limit), the router sharpened (x 8) and biased at random.
Tolerance 2e-5 (fp32), as in test_family_parity.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import run_spawned
from tests.distributed.test_family_parity import TOL, _hf_logprobs, _sequences  # the same sequences and reference

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

ARCH = dict(family="gpt_oss", num_layers=4, hidden_size=128, ffn_hidden_size=64, num_attention_heads=4,
            num_query_groups=2, head_dim=32, vocab_size=128, max_position_embeddings=512, rope_theta=150000.0,
            rope_scaling_factor=4.0, rope_scaling_original_max_position_embeddings=128, rope_scaling_truncate=False,
            norm_eps=1e-5, tie_word_embeddings=False, num_experts=4, moe_ffn_hidden_size=64, moe_router_topk=2,
            sliding_window=16, sliding_window_layers=[0, 3], swiglu_limit=7.0)
LAYOUTS = {"tp1": dict(tp=1, pp=1, ep=1), "ep2": dict(tp=1, pp=1, ep=2), "pp2": dict(tp=1, pp=2, ep=1),
           "tp2_sp": dict(tp=2, pp=1, ep=1),  # experts unsplit (etp=1): Megatron-core's condition for their biases
           "tp2_sp_ep2": dict(tp=2, pp=1, ep=2)}  # and the two TP ranks hold different experts


def _worker(rank: int, world: int, path: str, layouts: list, out_root: str) -> None:
    from megatron_rl.checkpoint.hf import arch_from_hf_config, export_hf
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions
    from megatron_rl.trainer.packing import Sample

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    results = {}
    for layout in layouts:
        cfg = ModelConfig(**arch_from_hf_config(path), path=path)  # as runtime.load_validated does
        par = LAYOUTS[layout]
        groups = state.initialize(par["tp"], par["pp"], ep=par["ep"], etp=1, sequence_parallel=par["tp"] > 1)
        trainer = Trainer(cfg, OptimizerConfig(), groups, TrainerOptions(micro_batch_tokens=320))
        trainer.initialize_weights()
        samples = [Sample(s, torch.ones(len(s) - 1)) for s in _sequences()]
        results[layout] = trainer.forward_logprobs(samples, with_entropy=True)
        export_hf(trainer.module, groups, cfg, Path(out_root) / layout)
        state.destroy()
    if rank == 0:
        torch.save(results, Path(out_root) / f"logprobs-{world}.pt")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.hf import build_hf_model

    path = tmp_path_factory.mktemp("hf") / "gpt_oss"
    model = build_hf_model(ModelConfig(**ARCH), seed=21)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in model.model.layers:  # see the module docstring
            layer.self_attn.sinks.copy_(2.0 * torch.randn(4, generator=gen))
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
            layer.mlp.router.weight.mul_(8.0)
            layer.mlp.router.bias.copy_(torch.randn(4, generator=gen))
            layer.mlp.experts.gate_up_proj.mul_(40.0)
            layer.mlp.experts.gate_up_proj_bias.copy_(torch.randn(4, 128, generator=gen))
            layer.mlp.experts.down_proj_bias.copy_(0.1 * torch.randn(4, 128, generator=gen))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def results(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    run_spawned(_worker, 1, str(checkpoint), ["tp1"], str(out))
    run_spawned(_worker, 2, str(checkpoint), ["ep2", "pp2", "tp2_sp", "tp2_sp_ep2"], str(out))
    return out, {k: v for world in (1, 2) for k, v in torch.load(out / f"logprobs-{world}.pt").items()}


def _distance(a, b) -> float:
    return max((x - y).abs().max().item() for (x, _), (y, _) in zip(a, b, strict=True))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_logprobs_match_transformers(checkpoint, results, layout):
    _, runs = results
    logprobs, entropies = runs[layout]
    for got_lp, got_ent, (lp, ent) in zip(logprobs, entropies, _hf_logprobs(checkpoint), strict=True):
        assert (got_lp.double() - lp).abs().max() <= TOL, (got_lp.double() - lp).abs().max()
        assert (got_ent.double() - ent).abs().max() <= TOL


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_export_is_bit_exact(checkpoint, results, layout):
    from megatron_rl.checkpoint.hf import read_tensors

    out, _ = results
    original, exported = read_tensors(checkpoint), read_tensors(out / layout)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    written, read = (json.loads((p / "config.json").read_text()) for p in (out / layout, checkpoint))
    for key in ("layer_types", "sliding_window", "swiglu_limit", "rope_parameters", "num_local_experts"):
        assert written[key] == read[key], key


def test_sinks_windows_yarn_and_clamp_change_the_reference(checkpoint, tmp_path):
    """Guards the comparison: transformers without the sinks, without sliding windows, with the windows in the
    layers a stage-local layer index would pick under PP=2 (0 and 2), with YaRN's correction range rounded
    (truncate true), or with the SwiGLU clamp lifted, is far from the checkpoint's."""
    from transformers import AutoModelForCausalLM

    reference = _hf_logprobs(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # a sink with no probability mass
    model.save_pretrained(tmp_path / "no_sinks")
    variants = {
        "no sinks": _hf_logprobs(tmp_path / "no_sinks"),
        "no windows": _hf_logprobs(checkpoint, layer_types=["full_attention"] * 4),
        "windows by stage index": _hf_logprobs(checkpoint, layer_types=["sliding_attention", "full_attention"] * 2),
        "truncated yarn": _hf_logprobs(checkpoint, rope_parameters={**config["rope_parameters"], "truncate": True}),
        "no clamp": _hf_logprobs(checkpoint, swiglu_limit=1e9),
    }
    for what, variant in variants.items():
        assert _distance(reference, variant) > 100 * TOL, what


def test_expert_parallel_rank_reads_only_its_rows(checkpoint):
    """An EP rank's stage tensors hold its experts' rows of the stacked expert tensors, converted to
    Megatron's global expert indices, equal to the same experts converted from the whole checkpoint."""
    from megatron_rl.checkpoint.hf import arch_from_hf_config, read_tensors, stage_tensors
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.families import get_converter

    cfg = ModelConfig(**arch_from_hf_config(checkpoint), path=str(checkpoint))
    converter = get_converter("gpt_oss")
    part = stage_tensors(checkpoint, cfg, range(0, 2), True, False, experts=range(2, 4))
    assert part["model.layers.1.mlp.experts.down_proj"].shape == (2, 64, 128)
    mine = converter.hf_to_megatron(part, cfg, first_expert=2)
    everything = converter.hf_to_megatron(read_tensors(checkpoint), cfg)
    experts = {n for n in mine if ".local_experts." in n}
    assert {int(n.split(".local_experts.")[1].split(".")[0]) for n in experts} == {2, 3}
    assert len(experts) == 2 * 2 * 4  # 2 layers x 2 experts x (fc1, fc2) x (weight, bias)
    for name in experts:
        assert torch.equal(mine[name], everything[name]), name
