"""Hugging Face side of the model: `transformers` configs, random initialisation, safetensors I/O.

The small models of the tests and the local demo are real HF models: built by
`transformers` from a config with a fixed seed (its own initialisation), converted to
Megatron's layout, and exportable back. Loading an HF checkpoint directory reads
`model.safetensors` or the shards listed in `model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_rl.models.gpt import hf_config_dict
from megatron_rl.weight_sync.hf_layout import hf_to_megatron

logger = logging.getLogger(__name__)
Tensor = torch.Tensor


def hf_config(model_cfg: Any, eos_token_id: int = 0):
    from transformers import AutoConfig

    values = hf_config_dict(model_cfg, eos_token_id)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def build_hf_model(model_cfg: Any, seed: int, eos_token_id: int = 0) -> torch.nn.Module:
    """A `transformers` causal LM with its own random initialisation under `seed` (fp32)."""
    from transformers import AutoModelForCausalLM

    config = hf_config(model_cfg, eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    return model.eval()


def load_safetensors_dir(path: str | Path, names: Optional[set[str]] = None) -> dict[str, Tensor]:
    """Tensors of an HF checkpoint directory (single file or index + shards).

    With `names`, only those tensors are read (each shard is opened lazily).
    """
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")
    out: dict[str, Tensor] = {}
    for fname in files:
        fpath = path / fname
        if not fpath.exists():
            raise ValueError(f"{fpath}: shard listed in {index.name} is missing")
        with safe_open(str(fpath), framework="pt") as f:
            for key in f.keys():
                if names is None or key in names:
                    out[key] = f.get_tensor(key)
    return out


def initial_state_dict(model_cfg: Any, seed: int) -> dict[str, Tensor]:
    """The full Megatron-layout weights to start from: the checkpoint at `model.path`, or a
    `transformers` random initialisation of the configured architecture."""
    if model_cfg.path:
        hf = load_safetensors_dir(model_cfg.path)
        if model_cfg.tie_word_embeddings and "lm_head.weight" not in hf:
            hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    else:
        hf = build_hf_model(model_cfg, seed).state_dict()
    return {k: v.float() for k, v in hf_to_megatron(hf, model_cfg).items()}
