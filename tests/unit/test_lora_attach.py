"""`attach_lora` refuses expert targets on experts it cannot adapt one by one (tests/distributed/test_lora*.py
test the adapters themselves)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.config.schema import ModelConfig
from megatron_rl.models.lora import attach_lora


class GroupedExperts(torch.nn.Module):
    """Experts held as one module (as Megatron's grouped-GEMM MLPs): no `local_experts`."""


def _model_with(experts: torch.nn.Module) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.layer_number = 1
    layer.mlp = torch.nn.Module()
    layer.mlp.experts = experts
    model = torch.nn.Module()
    model.config = SimpleNamespace(sequence_parallel=False, gated_linear_unit=True)
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([layer])
    return model


def test_expert_targets_need_a_module_per_expert():
    cfg = ModelConfig(family="qwen3_moe", num_layers=1, num_experts=4, moe_ffn_hidden_size=64, lora_rank=4,
                      lora_targets=["linear_qkv", "experts.linear_fc1"])
    groups = SimpleNamespace(ep_rank=0, tp_size=1, etp_size=1)
    with pytest.raises(ValueError, match="one MLP module per expert .* layer 0's experts are a GroupedExperts"):
        attach_lora(_model_with(GroupedExperts()), cfg, groups)
    # without expert targets there is nothing to adapt there, and nothing to refuse
    assert attach_lora(_model_with(GroupedExperts()), dataclasses.replace(cfg, lora_targets=["linear_qkv"]),
                       groups) == []
