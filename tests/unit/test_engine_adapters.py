"""The hf engine's LoRA adapters (`HFEngine.update_adapters`, rollout.weight_sync=adapters): on the base
weights a full update loaded, its log-probs are those of the same adapters loaded by `peft` (an independent
implementation) onto the same base, after the first update and after a replacement; malformed updates are
refused and leave the adapters as they were."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config.schema import ModelConfig
from megatron_rl.models.hf import build_hf_model, hub_state_dict
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.hf_engine import EngineStateError, HFEngine

RANK, ALPHA = 4, 16.0
MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
PARAMS = SamplingParams(temperature=0.8, max_new_tokens=10, n=2, seed=3)


@pytest.fixture(scope="module")
def base():
    """(model config, the base model's hub state dict)."""
    cfg = ModelConfig(num_layers=2)
    return cfg, {k: v.clone() for k, v in hub_state_dict(build_hf_model(cfg, seed=1)).items()}


def _adapters(base_model: torch.nn.Module, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in base_model.named_modules():
        if name.endswith(MODULES):
            out_features, in_features = module.weight.shape
            out[name] = (torch.randn(RANK, in_features, generator=gen) / in_features ** 0.5,
                         torch.randn(out_features, RANK, generator=gen) * 0.1)
    return out


def _engine(base) -> HFEngine:
    cfg, state = base
    engine = HFEngine(cfg)
    engine.update_weights(state.items(), version=1)
    return engine


def _peft_logprobs(base, adapters, generations) -> list[torch.Tensor]:
    """Teacher-forced log-probs at the sampling temperature of `peft`'s LoRA model on the same base."""
    from peft import LoraConfig, get_peft_model

    cfg, state = base
    model = build_hf_model(cfg, seed=0)
    model.load_state_dict(state, strict=False)  # the tied lm_head follows the embedding
    peft_model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=sorted(adapters),
                                                  lora_dropout=0.0)).eval()
    with torch.no_grad():
        for name, (a, b) in adapters.items():
            layer = peft_model.base_model.model.get_submodule(name)
            layer.lora_A["default"].weight.copy_(a)
            layer.lora_B["default"].weight.copy_(b)
        out = []
        for g in generations:
            prompt = PROMPTS[g.prompt_index]
            ids = torch.tensor([prompt + g.output_ids])
            logits = peft_model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / PARAMS.temperature
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.output_ids)[:, None]).squeeze(-1))
    return out


def _max_diff(generations, want) -> float:
    return max((torch.tensor(g.logprobs) - w).abs().max().item() for g, w in zip(generations, want))


def test_the_engines_adapters_compute_peft_s_lora(base):
    engine = _engine(base)
    plain = engine.generate(PROMPTS, PARAMS)
    first = _adapters(engine.model, seed=0)
    engine.update_adapters(first, ALPHA / RANK, version=2)
    got = engine.generate(PROMPTS, PARAMS)
    assert {g.weight_version for g in got} == {2} and engine.health()["adapters"] == len(first) == 2 * len(MODULES)
    assert _max_diff(got, _peft_logprobs(base, first, got)) < 1e-5
    # the adapters matter: the base model's log-probs of the same tokens are far from them
    assert _max_diff(got, _peft_logprobs(base, {k: (a, b * 0) for k, (a, b) in first.items()}, got)) > 1e-2
    second = _adapters(engine.model, seed=1)  # a replacement, not a second adapter on top
    engine.update_adapters(second, ALPHA / RANK, version=3)
    again = engine.generate(PROMPTS, PARAMS)
    assert _max_diff(again, _peft_logprobs(base, second, again)) < 1e-5
    # B = 0: the base model again, token for token (the same seed draws the same samples)
    engine.update_adapters({k: (a, b * 0) for k, (a, b) in second.items()}, ALPHA / RANK, version=4)
    zero = engine.generate(PROMPTS, PARAMS)
    assert [g.output_ids for g in zero] == [g.output_ids for g in plain]
    assert _max_diff(zero, [torch.tensor(g.logprobs) for g in plain]) < 1e-6


def test_malformed_adapter_updates_are_refused(base):
    cfg, _ = base
    fresh = HFEngine(cfg)
    adapters = _adapters(fresh.model, seed=0)
    with pytest.raises(EngineStateError, match="base weights first"):
        fresh.update_adapters(adapters, 1.0, version=1)
    engine = _engine(base)
    name = "model.layers.1.self_attn.q_proj"  # after others in order: nothing may be attached before the check
    a, b = adapters[name]
    for bad, words in (({**adapters, name: (a[:, :-1], b)}, "do not fit"),
                       ({**adapters, "model.layers.1.input_layernorm": (a, b)}, "no linear layer")):
        with pytest.raises(ValueError, match=words):
            engine.update_adapters(bad, ALPHA / RANK, version=2)
    assert engine.health()["adapters"] == 0 and engine.weight_version == 1
    engine.update_adapters(adapters, ALPHA / RANK, version=2)
    before = engine.generate(PROMPTS, PARAMS)
    with pytest.raises(ValueError, match="must replace every adapter"):
        engine.update_adapters({k: v for k, v in adapters.items() if k != name}, ALPHA / RANK, version=3)
    after = engine.generate(PROMPTS, PARAMS)
    assert engine.weight_version == 2 and [g.logprobs for g in after] == [g.logprobs for g in before]
    engine.release_memory()
    with pytest.raises(EngineStateError, match="released"):
        engine.update_adapters(adapters, ALPHA / RANK, version=3)
