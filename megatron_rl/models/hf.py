"""Hugging Face side of the model: `transformers` configs and random initialisation.

The small models of the tests and the local demo are real HF models: built by
`transformers` from a config with a fixed seed (its own initialisation), converted to
Megatron's layout, and exportable back (`megatron_rl.checkpoint.hf`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from megatron_rl.families import get_converter

logger = logging.getLogger(__name__)
Tensor = torch.Tensor


def hf_config(model_cfg: Any, eos_token_id: int = 0):
    from transformers import AutoConfig

    values = get_converter(model_cfg.family).config_dict(model_cfg, eos_token_id)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def build_hf_model(model_cfg: Any, seed: int, eos_token_id: int = 0) -> torch.nn.Module:
    """A `transformers` causal LM with its own random initialisation under `seed` (fp32)."""
    from transformers import AutoModelForCausalLM

    config = hf_config(model_cfg, eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def fp32_tensors(config: Any) -> tuple[str, ...]:
    """What transformers keeps in fp32 whatever the model's dtype (`_keep_in_fp32_modules_strict` of
    the model class for this config: GLM-4.5's router weight and selection bias), as name endings."""
    from transformers import AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    return tuple(getattr(model_class, "_keep_in_fp32_modules_strict", None) or ())


def kept_in_fp32(name: str, endings: tuple[str, ...]) -> bool:
    return any(name == e or name.endswith("." + e) for e in endings)


def hub_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """`model`'s weights under the names and shapes `save_pretrained` writes (the hub layout).

    `transformers` may hold weights differently in memory (Qwen3-MoE fuses its experts into one
    [E, 2I, H] tensor); the converters work on the checkpoint layout, so this applies the same
    reverse conversion that `save_pretrained` does.
    """
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, model.state_dict())


def random_state_dict(model_cfg: Any, seed: int) -> dict[str, Tensor]:
    """Full Megatron-layout weights of a `transformers` random initialisation of the architecture."""
    hf = hub_state_dict(build_hf_model(model_cfg, seed))
    return {k: v.float() for k, v in get_converter(model_cfg.family).hf_to_megatron(hf, model_cfg).items()}
