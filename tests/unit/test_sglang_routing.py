"""Rollout routing replay with SGLang (algorithm.routing_replay=rollout): the engine asks for
`return_routed_experts` and turns meta_info["routed_experts"] (base64 of int32 [prompt + output - 1,
every layer, k], as sglang/srt's detokenizer encodes it) into `Generation.routing` over the MoE layers.
SGLang's capture pins host memory with CUDA, so on CPU the engine path is checked against a recording
transport (no SGLang process); the factory refuses R3 with SGLang on CPU and sets the server flag."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest
import torch

from megatron_rl.config import ConfigError
from megatron_rl.config.schema import ModelConfig
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.factory import sglang_engine_config
from megatron_rl.rollout.sglang_engine import SGLangEngine, SGLangEngineConfig
from tests.unit.test_rollout_factory import rl_config

LAYERS, SPARSE, TOPK = 4, (1, 2, 3), 2  # layer 0 dense (DeepSeek's first_k_dense_replace)


def _routed(rows: int, seed: int) -> np.ndarray:
    found = np.random.default_rng(seed).integers(0, 8, size=(rows, LAYERS, TOPK)).astype(np.int32)
    found[:, 0] = -1  # SGLang leaves a dense layer's rows unwritten
    return found


class _Transport:
    def __init__(self, outputs: list[dict]) -> None:
        self.outputs, self.asked = outputs, []

    def generate(self, input_ids, sampling_params, return_routed_experts=False, lora=None):
        assert lora is None  # no LoRA adapter loaded
        self.asked.append(return_routed_experts)
        return self.outputs


def offline_engine(config: SGLangEngineConfig, transport: Any, weight_version: int) -> SGLangEngine:
    """An SGLangEngine without an engine process, answering through `transport`: generate's bookkeeping and
    parsing run (also test_sglang_finish_reason.py's)."""
    import threading

    engine = SGLangEngine.__new__(SGLangEngine)
    engine.config = config
    engine._transport, engine._released, engine._paused = transport, set(), False
    engine._deterministic, engine._warned, engine.weight_version, engine._lora = True, set(), weight_version, None
    engine._idle, engine._in_flight = threading.Condition(), 0
    return engine


def _engine(outputs: list[dict], layout=(LAYERS, SPARSE, TOPK)) -> SGLangEngine:
    return offline_engine(SGLangEngineConfig(model_path="unused", routing_layout=layout), _Transport(outputs), 3)


def _output(output_ids: list[int], routed: np.ndarray, reason: str = "stop") -> dict:
    return {"output_ids": output_ids,
            "meta_info": {"finish_reason": {"type": reason}, "weight_version": "3",
                          "output_token_logprobs": [[-0.5, t, None] for t in output_ids],
                          "routed_experts": base64.b64encode(routed.tobytes()).decode()}}


def test_generations_carry_the_moe_layers_routing():
    prompts = [[5, 6, 7], [8, 9]]
    first, second = _routed(3 + 4 - 1, seed=0), _routed(2 + 2 - 1, seed=1)
    engine = _engine([_output([10, 11, 12, 1], first), _output([13, 1], second)])
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=4, return_routing=True))
    assert engine._transport.asked == [True]
    for gen, routed in zip(gens, (first, second)):
        assert gen.routing.dtype == torch.int16
        assert torch.equal(gen.routing, torch.from_numpy(routed[:, list(SPARSE)]).to(torch.int16))
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=4))
    assert engine._transport.asked[-1] is False and all(g.routing is None for g in gens)


def test_missing_or_short_routing_is_an_error():
    engine = _engine([_output([10, 11, 1], _routed(3, seed=0))])  # prompt 3 + output 3 - 1 = 5 rows needed
    with pytest.raises(RuntimeError, match="cover 3 tokens"):
        engine.generate([[5, 6, 7]], SamplingParams(return_routing=True))
    out = _output([10, 1], _routed(4, seed=0))
    del out["meta_info"]["routed_experts"]
    with pytest.raises(RuntimeError, match="enable_return_routed_experts"):
        _engine([out]).generate([[5, 6, 7]], SamplingParams(return_routing=True))
    with pytest.raises(ValueError, match="no routing_layout"):
        _engine([out], layout=None).generate([[5, 6, 7]], SamplingParams(return_routing=True))


def test_the_factory_asks_sglang_for_routed_experts_on_cuda_only():
    cfg = rl_config(backend="sglang")
    cfg.model = ModelConfig(family="deepseek_v3", num_layers=4, num_query_groups=4, num_experts=8,
                            moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=64, moe_dense_layers=[0],
                            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24)
    cfg.algorithm.routing_replay = "rollout"
    config = sglang_engine_config(cfg, device_type="cuda", model_path="/m", base_gpu_id=0, random_seed=0)
    assert config.server_args["enable_return_routed_experts"] is True
    assert config.routing_layout == (4, (1, 2, 3), cfg.model.moe_router_topk)
    with pytest.raises(ConfigError, match="needs CUDA"):
        sglang_engine_config(cfg, device_type="cpu", model_path="/m", base_gpu_id=0, random_seed=0)
    cfg.algorithm.routing_replay = "none"
    assert "enable_return_routed_experts" not in sglang_engine_config(
        cfg, device_type="cuda", model_path="/m", base_gpu_id=0, random_seed=0).server_args
