"""HF sequence-classification checkpoints (discriminative reward models) into a Megatron model with a value head.

A `<Family>ForSequenceClassification` checkpoint is the family's decoder (`model.*` tensors, read by the family's
converter as for a causal LM) with a `score` layer, a bias-free [num_labels, hidden] linear map, in place of
`lm_head`. It loads into `Trainer(head="value")`, whose head (models/value_head.py) is the same map with a bias,
set to 0 here, so the Megatron model computes transformers' score at every position.

`check_reward_model` runs at config time (no torch): the checkpoint exists, is a sequence classifier of a
supported family with num_labels=1, its tensors are exactly the decoder's and `score.weight`, and it was saved
with the policy's tokenizer (the reward model reads the policy's token ids: another vocabulary would score
other text than the policy wrote).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)

# Families whose sequence classifier is the causal LM's decoder plus `score` (checked against transformers)
FAMILIES = {"qwen2": "Qwen2ForSequenceClassification", "llama": "LlamaForSequenceClassification"}
SCORE = "score.weight"


def num_labels_of(hf: dict[str, Any]) -> int:
    """transformers' num_labels: the config's own key, else the size of its id2label map (what save_pretrained
    writes), else 2 (PretrainedConfig's default)."""
    if "num_labels" in hf:
        return int(hf["num_labels"])
    return len(hf["id2label"]) if hf.get("id2label") else 2


def reward_model_config(path: str | Path) -> dict[str, Any]:
    """The checkpoint's config.json, checked to be a supported sequence classifier with num_labels=1;
    ValueError naming the value and the fix."""
    from megatron_rl.checkpoint.hf import read_config

    where = Path(path) / "config.json"
    if not Path(path).is_dir():
        raise ValueError(f"task.reward_model.path={path} does not exist: give the HF checkpoint directory of a "
                         f"reward model ({', '.join(FAMILIES.values())}, num_labels=1)")
    hf = read_config(path)
    architectures = hf.get("architectures") or []
    expected = FAMILIES.get(hf.get("model_type", ""))
    if expected is None or architectures != [expected]:
        kinds = [a for a in architectures if a.endswith("ForSequenceClassification")]
        why = (f"model_type={hf.get('model_type')!r} is not supported for reward models" if kinds
               else "it is no *ForSequenceClassification checkpoint (a reward model has a `score` head)")
        raise ValueError(f"{where}: architectures={architectures}: {why}; supported: {', '.join(FAMILIES.values())}")
    labels = num_labels_of(hf)
    if labels != 1:
        raise ValueError(f"{where}: num_labels={labels}: a reward model gives one score per sample (num_labels=1); "
                         "a classifier with several labels has no single reward")
    return hf


def check_tokenizer(path: str | Path, policy_tokenizer: str, vocabulary) -> None:
    """The reward model's saved tokenizer is the policy's (`vocabulary(spec)`: token -> id, from
    config/checks/paths.py); ValueError when it differs or cannot be compared."""
    theirs, mine = vocabulary(str(path)), vocabulary(policy_tokenizer)
    if theirs is None:
        raise ValueError(f"task.reward_model.path={path} holds no tokenizer.json to compare with model.tokenizer="
                         f"{policy_tokenizer}: the reward model reads the policy's token ids, so it must use the "
                         "same tokenizer; save it in the checkpoint directory (tokenizer.save_pretrained)")
    if mine is None:
        raise ValueError(f"model.tokenizer={policy_tokenizer} has no tokenizer.json to compare with the reward "
                         f"model's ({path}): the reward model reads the policy's token ids, so the two must be the "
                         "same tokenizer")
    if mine != theirs:
        differing = next((t for t in sorted(mine) if theirs.get(t) != mine[t]), None)
        example = (f"{differing!r} is id {mine[differing]} for the policy, "
                   f"{theirs.get(differing, 'absent')} for the reward model" if differing is not None
                   else "the reward model's has tokens the policy's lacks")
        raise ValueError(f"task.reward_model.path={path}: its tokenizer differs from model.tokenizer="
                         f"{policy_tokenizer} ({len(theirs)} vs {len(mine)} tokens; {example}): the reward model "
                         "reads the policy's token ids; use a reward model trained with the policy's tokenizer")


def check_reward_model(path: str | Path, policy_tokenizer: str, vocabulary, arch_of) -> None:
    """Everything about a reward-model checkpoint that can be found before any work (see the module docstring).
    `arch_of(path)`: its decoder's ModelConfig (config/reward_model.py: the config package builds ModelConfigs,
    and importing it from here would close an import circle through the config checks)."""
    from megatron_rl.checkpoint.hf import check_weight_files

    reward_model_config(path)
    check_weight_files(path)
    check_tensors(path, arch_of(path))
    check_tokenizer(path, policy_tokenizer, vocabulary)


def _needed(arch: Any, layers: range, first_stage: bool, last_stage: bool) -> set[str]:
    """The decoder's tensors of a stage (the family's causal-LM names without `lm_head`), `score` on the last."""
    from megatron_rl.families import get_converter

    names = get_converter(arch.family).hf_names(arch, layers, first_stage, last_stage) - {"lm_head.weight"}
    return names | ({SCORE} if last_stage else set())


def check_tensors(path: str | Path, arch: Any, files: Optional[dict[str, Path]] = None) -> None:
    """Every tensor of the checkpoint is one the reward model reads (or its family ignores by name), none is
    missing; ValueError naming them (a `score.bias` too: transformers' score layer has none)."""
    from megatron_rl.checkpoint.hf import _tensor_files, describe_names
    from megatron_rl.families import get_converter

    files = files if files is not None else _tensor_files(Path(path))
    converter = get_converter(arch.family)
    needed = _needed(arch, range(arch.num_layers), True, True)
    unread = [n for n in files if n not in needed and converter.ignored_hf_tensor(n, arch) is None]
    missing = needed - set(files)
    if unread or missing:
        parts = ([f"tensor(s) a reward model does not read: {describe_names(unread)}"] if unread else []) + (
            [f"no tensor {describe_names(missing)}"] if missing else [])
        raise ValueError(f"task.reward_model.path={path}: the checkpoint has " + "; and ".join(parts) +
                         f" (a {FAMILIES[arch.family]} is the decoder's model.* tensors and {SCORE})")


def load_reward_model(model: Any, path: str | Path, arch: Any, groups: Any) -> None:
    """Set this rank's stage of `model` (a GPTModel with a value head: `Trainer(head="value")`) from the
    reward-model checkpoint at `path`: the decoder through the family's converter, `score` into the head."""
    import torch

    from megatron_rl.checkpoint.hf import _tensor_files, read_tensors
    from megatron_rl.families import get_converter
    from megatron_rl.weight_sync.sharding import layer_offset, load_full_state_dict

    reward_model_config(path)
    files = _tensor_files(Path(path))
    check_tensors(path, arch, files)
    offset = layer_offset(model)
    num_local = len(model.decoder.layers) if hasattr(model, "decoder") else 0
    names = _needed(arch, range(offset, offset + num_local), groups.is_first_stage, groups.is_last_stage)
    tensors = read_tensors(path, names, files)
    score = tensors.pop(SCORE, None)
    converter = get_converter(arch.family)
    for name, shape in converter.expected_hf_shapes(arch, set(tensors)).items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{files[name]}: tensor {name!r} has shape {tuple(tensors[name].shape)}, the reward "
                             f"model's config.json needs {shape}")
    converted = converter.hf_to_megatron(tensors, arch)
    if score is not None:
        if tuple(score.shape) != (1, arch.hidden_size):
            raise ValueError(f"{files[SCORE]}: tensor {SCORE!r} has shape {tuple(score.shape)}, a reward model's is "
                             f"(1, {arch.hidden_size})")
        converted["output_layer.weight"] = score
        converted["output_layer.bias"] = torch.zeros(1, dtype=score.dtype)  # transformers' score has no bias
    load_full_state_dict(model, converted, groups)
    logger.info("loaded reward model %s (%d tensors)", path, len(tensors) + (score is not None))
