"""What `models.gpt.build_model` refuses before building anything on a GPU (checked without one: the
refusals come first)."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_rl.config.schema import ModelConfig
from megatron_rl.models.gpt import build_model, te_available, uses_te


@pytest.mark.skipif(te_available(), reason="Transformer Engine is installed here")
def test_a_gpu_without_transformer_engine_is_refused_with_the_fix():
    groups = types.SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match=r"Transformer Engine is required on GPU.*pip install -e '\.\[gpu\]'"):
        build_model(ModelConfig(num_layers=2), groups)


def _gpu_groups(sequence_parallel: bool = False):
    return types.SimpleNamespace(device=torch.device("cuda", 0), sequence_parallel=sequence_parallel)


@pytest.mark.skipif(te_available(), reason="Transformer Engine is installed here")
def test_the_local_spec_on_a_gpu_is_refused_where_megatron_assumes_transformer_engine():
    """model.transformer_impl=local passes the TE check on a GPU, and is refused, naming the reason, for the models
    whose local Megatron-core paths need TE (a dense model gets past the checks: here it then fails for want of a
    CUDA device, not with the TE refusal)."""
    moe = ModelConfig(family="qwen3_moe", num_layers=2, num_experts=4, moe_ffn_hidden_size=64,
                      transformer_impl="local")
    dense = ModelConfig(num_layers=2, transformer_impl="local")
    with pytest.raises(RuntimeError, match="transformer_impl=local cannot run a mixture of experts on a GPU"):
        build_model(moe, _gpu_groups())
    with pytest.raises(RuntimeError, match="transformer_impl=local cannot run sequence parallelism on a GPU"):
        build_model(dense, _gpu_groups(sequence_parallel=True))
    with pytest.raises(Exception) as info:
        build_model(dense, _gpu_groups())
    assert "Transformer Engine" not in str(info.value)


def test_transformer_impl_picks_the_spec():
    cpu = types.SimpleNamespace(device=torch.device("cpu"), sequence_parallel=False)
    assert not uses_te(cpu, ModelConfig(num_layers=2))
    assert not uses_te(_gpu_groups(), ModelConfig(num_layers=2, transformer_impl="local"))
    assert uses_te(_gpu_groups(), ModelConfig(num_layers=2, transformer_impl="transformer_engine"))
    assert uses_te(_gpu_groups(), ModelConfig(num_layers=2)) == te_available()
    with pytest.raises(RuntimeError, match="transformer_impl=transformer_engine needs Transformer Engine on a GPU, "
                                           "but the device is the CPU"):
        build_model(ModelConfig(num_layers=2, transformer_impl="transformer_engine"), cpu)
    with pytest.raises(ValueError, match="model.transformer_impl"):
        ModelConfig(transformer_impl="te")


def test_the_config_refuses_the_local_spec_on_cuda_for_a_mixture_of_experts_before_any_work():
    from megatron_rl.config import ConfigError, load_config

    moe = ["model=tiny_qwen3_moe", "cluster.device=cuda", "rollout.backend=hf", "model.transformer_impl=local"]
    with pytest.raises(ConfigError, match="transformer_impl=local cannot run a mixture of experts on a GPU"):
        load_config(moe, world_size=1)
    load_config(moe[:3], world_size=1)  # auto: TE's spec
    load_config(["cluster.device=cuda", "rollout.backend=hf", "model.transformer_impl=local"], world_size=1)  # dense
    with pytest.raises(ConfigError, match="transformer_impl=transformer_engine needs a GPU, but cluster.device=cpu"):
        load_config(["cluster.device=cpu", "model.transformer_impl=transformer_engine"], world_size=1)
