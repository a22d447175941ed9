"""Weight sync into the hf engine in place (`weight_sync.in_place`), in one process at TP=1, for a dense family
(Qwen2: Q/K/V bias, tied embeddings), a mixture of experts (Qwen3-MoE: experts that transformers holds fused)
and gpt-oss (experts stacked, transposed and interleaved):

- after a sync the engine holds exactly the converter's HF tensors of the trainer's weights (from
  `gather_full_state_dict` and `megatron_to_hf`, read back through transformers' own `revert_weight_conversion`),
  and exactly what an engine synced through the bucketed stream by name holds (the previous path);
- after the trainer's weights change, the next sync writes them into the same memory: every engine parameter
  keeps its data_ptr; after the engine released and resumed its weights, a sync is exact again;
- LoRA (Qwen2): the merged weights, and with merged=False the base weights; a bf16 engine fed by the fp32
  trainer holds the converter's tensors cast to bf16 (a copy_ converts as .to does);
- a converter that leaves part of a Megatron tensor unused, a plan that leaves an engine parameter unwritten and
  a weights_written after the engine reallocated its weights all raise.

TP=2, EP=2 and the other families sync through the same plan in test_rollout_sync.py (through the colocation
controller, bit-exact against the converter).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import run_spawned
from tests.distributed.test_gpt_oss import ARCH as GPT_OSS

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

CASES = {"qwen2": dict(family="qwen2", tie_word_embeddings=True),
         "qwen3_moe": dict(family="qwen3_moe", num_experts=4, moe_ffn_hidden_size=48, head_dim=48,
                           tie_word_embeddings=False),
         "gpt_oss": {**{k: v for k, v in GPT_OSS.items() if k != "num_layers"}, "sliding_window_layers": [0]},
         "qwen2_lora": dict(family="qwen2", tie_word_embeddings=True, lora_rank=4, lora_alpha=16.0),
         "qwen2_bf16_engine": dict(family="qwen2", tie_word_embeddings=False)}


class ByName:
    """An engine reached through update_weights alone: weight sync streams it buckets of HF tensors."""

    def __init__(self, engine) -> None:
        self.update_weights = engine.update_weights


def _worker(rank, world, out):
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.families import get_converter
    from megatron_rl.models.lora import LoRAAdapter
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.rollout.hf_engine import HFEngine
    from megatron_rl.trainer.core import Trainer, TrainerOptions
    from megatron_rl.weight_sync.sharding import gather_full_state_dict
    from megatron_rl.weight_sync.stream import sync_weights

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    groups = state.initialize(1, 1)
    results = {}
    for case, fields in CASES.items():
        cfg = ModelConfig(num_layers=2, **fields)
        trainer = Trainer(cfg, OptimizerConfig(lr=1e-2), groups, TrainerOptions(micro_batch_tokens=64))
        trainer.initialize_weights()
        model = trainer.module
        with torch.no_grad():  # nonzero biases, norms and adapters: a mix-up of any two tensors shows
            for name, module in model.named_modules():
                if isinstance(module, LoRAAdapter):
                    module.b.normal_(0, 0.05)
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        converter = get_converter(cfg.family)

        def expected(merged: bool = True, dtype=None) -> dict[str, torch.Tensor]:
            hf = converter.megatron_to_hf(gather_full_state_dict(model, groups, merged), cfg)
            return {k: v if dtype is None else v.to(dtype) for k, v in hf.items()}

        def exact(engine, want) -> bool:
            held = engine.hf_state_dict()
            return sorted(held) == sorted(want) and all(
                held[k].dtype == v.dtype and torch.equal(held[k], v) for k, v in want.items())

        engine = HFEngine(cfg)
        if case == "qwen2_bf16_engine":
            engine.model.to(torch.bfloat16)
        dtype = torch.bfloat16 if case == "qwen2_bf16_engine" else None
        first = sync_weights(model, groups, cfg, engine, 1)
        r = {"first_exact": exact(engine, expected(dtype=dtype)), "first_buckets": first.num_buckets,
             "bytes": first.num_bytes, "hf_bytes": sum(v.numel() * v.element_size() for k, v in expected().items()
                                                       if not (k == "lm_head.weight" and cfg.tie_word_embeddings))}
        streamed = HFEngine(cfg)
        if dtype is not None:
            streamed.model.to(dtype)
        sync_weights(model, groups, cfg, ByName(streamed), 1, bucket_bytes=50_000)
        r["equals_stream"] = exact(engine, streamed.hf_state_dict())

        pointers = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
        second = sync_weights(model, groups, cfg, engine, 2)
        r["second_exact"] = exact(engine, expected(dtype=dtype))
        r["same_memory"] = pointers == {n: p.data_ptr() for n, p in engine.model.named_parameters()}
        r["second"] = (second.num_buckets, engine.weight_version)

        engine.release_memory()
        engine.resume_memory()
        sync_weights(model, groups, cfg, engine, 3)
        r["after_release_exact"] = exact(engine, expected(dtype=dtype))
        if cfg.lora_rank:
            sync_weights(model, groups, cfg, engine, 4, merged=False)
            r["base_exact"] = exact(engine, expected(merged=False))
        if case in ("qwen2", "qwen3_moe"):
            r["errors"] = _errors(model, groups, cfg, converter)
        results[case] = r
    torch.save(results, out)


def _errors(model, groups, cfg, converter) -> dict[str, str]:
    """What each broken plan or call raises (the message, or "" if nothing did)."""
    from megatron_rl.rollout.hf_engine import HFEngine
    from megatron_rl.weight_sync import in_place

    def message(call) -> str:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 (the message is the result)
            return f"{type(exc).__name__}: {exc}"
        return ""

    errors = {}
    plan = in_place._PLANS[model]
    engine = HFEngine(cfg)
    errors["unwritten"] = message(lambda: engine.weight_targets(plan.regions[:-1], plan))
    mlp = "model.layers.0.mlp.experts.0." if cfg.num_experts else "model.layers.0.mlp."
    up, gate = mlp + "up_proj.weight", mlp + "gate_proj.weight"
    twice = [(gate, *region[1:]) if region[0] == up else region for region in plan.regions]  # gate twice, no up
    errors["written_twice"] = message(lambda: engine.weight_targets(twice, plan))

    original = converter.megatron_to_hf

    def gate_for_up(meg, arch):  # linear_fc1's gate rows copied twice, its up rows never
        out = original(meg, arch)
        if up in out:
            out[up] = out[gate]
        return out

    converter.megatron_to_hf = gate_for_up
    try:
        errors["unused"] = message(lambda: in_place.InPlacePlan.build(model, groups, cfg, HFEngine(cfg), True))
    finally:
        del converter.megatron_to_hf

    engine.weight_targets(plan.regions, plan)
    engine.release_memory()
    engine.resume_memory()
    errors["reallocated"] = message(lambda: engine.weights_written(5, plan))
    return errors


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("in_place") / "r.pt"
    run_spawned(_worker, 1, str(out), timeout_s=240)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_engine_holds_exactly_the_converters_tensors(results, case):
    r = results[case]
    assert r["first_exact"] and r["second_exact"] and r["after_release_exact"]
    assert r["bytes"] == r["hf_bytes"]  # every weight once: a tied lm_head is the embedding


@pytest.mark.parametrize("case", sorted(CASES))
def test_in_place_equals_the_bucketed_stream(results, case):
    assert results[case]["equals_stream"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_sync_writes_into_the_engines_own_memory(results, case):
    r = results[case]
    assert r["same_memory"], "a sync must not reallocate an engine parameter"
    assert r["first_buckets"] == 0 and r["second"] == (0, 2)  # in place, version taken


def test_lora_syncs_merged_or_base_weights(results):
    assert results["qwen2_lora"]["base_exact"]


@pytest.mark.parametrize("case", ["qwen2", "qwen3_moe"])
def test_every_element_is_accounted_for(results, case):
    errors = results[case]["errors"]
    assert errors["unwritten"].startswith("ValueError: weight sync does not write 1 engine parameters"), errors
    # dense: gate_proj written twice and up_proj never; experts: both halves of one fused tensor
    wrong = ("1 engine parameters", "model.layers.0.mlp.experts.gate_up_proj (49152 writes for 49152 elements)") \
        if case == "qwen3_moe" else ("2 engine parameters", "model.layers.0.mlp.up_proj.weight (0 writes")
    assert errors["written_twice"].startswith(f"ValueError: weight sync does not write {wrong[0]}"), errors
    assert wrong[1] in errors["written_twice"], errors
    fc1 = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight" if case == "qwen3_moe" \
        else "decoder.layers.0.mlp.linear_fc1.weight"
    assert f"do not use each element of {fc1} exactly once" in errors["unused"], errors
    assert errors["reallocated"].startswith("EngineStateError: weights_written(5)"), errors
