"""What `models.gpt.build_model` refuses before building anything on a GPU (checked without one: the
refusals come first)."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_rl.config.schema import ModelConfig
from megatron_rl.models.gpt import build_model, te_available


@pytest.mark.skipif(te_available(), reason="Transformer Engine is installed here")
def test_a_gpu_without_transformer_engine_is_refused_with_the_fix():
    groups = types.SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match=r"Transformer Engine is required on GPU.*pip install -e '\.\[gpu\]'"):
        build_model(ModelConfig(num_layers=2), groups)
