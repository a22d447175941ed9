"""What each family does with every key of a checkpoint's config.json, and the check that refuses the rest.

An importer accounts for every key. Each one is, for a family (`DenseDecoderConverter.hf_fields`):

- mapped: `arch_from_config` reads it into ModelConfig and refuses the values it cannot express;
- fixed: it changes what the model computes and one value is supported (`partial_rotary_factor` 1 outside
  GLM-4.5); any other value is refused;
- ignored: it cannot change what the trainer or the engine compute, for the reason given (bookkeeping,
  generation defaults, training-only losses of transformers, keys transformers derives itself);
- unknown (none of those): refused when its value could switch something on, that is anything but null,
  false, 0, an empty string, list or dict. A key the family's model code does not read changes nothing in
  transformers, but it may in another implementation of the architecture (SGLang's, the checkpoint's own
  code), and a checkpoint that states a feature the import would drop is not what it claims to be: the run
  stops and names the key. Absent or off, such a key means nothing and is ignored.

The RoPE entry (`rope_scaling`, or `rope_parameters` when there is none: transformers' order) is closed too:
its keys are those of its rope_type (`ROPE_KEYS`; the type itself is checked by `arch_from_config`), and its
`partial_rotary_factor` is classified as the top-level key is. Every refused key is named in one error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

# Keys of every config.json that say nothing about the computation.
_BOOKKEEPING = ("architectures", "transformers_version", "_name_or_path", "auto_map", "_commit_hash",
                "_attn_implementation_autoset", "attn_implementation", "name_or_path", "id2label", "label2id",
                "problem_type", "finetuning_task", "task_specific_params", "tokenizer_class", "prefix",
                "is_decoder", "is_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size",
                "tie_encoder_decoder", "decoder_start_token_id", "sep_token_id", "output_attentions",
                "output_hidden_states", "output_scores", "return_dict", "use_return_dict", "return_dict_in_generate",
                "torchscript", "pruned_heads", "tf_legacy_loss", "use_bfloat16", "keys_to_ignore_at_inference")
# generate()'s defaults: the rollout config sets sampling, the tokenizer the special tokens
_GENERATION = ("bos_token_id", "eos_token_id", "pad_token_id", "max_length", "min_length", "do_sample",
               "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
               "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
               "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "forced_bos_token_id",
               "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
               "begin_suppress_tokens", "use_cache")

# The keys of each RoPE entry type (`partial_rotary_factor` besides, classified as the top-level key)
_ROPE_COMMON = ("rope_type", "type", "rope_theta")
ROPE_KEYS = {
    "default": _ROPE_COMMON,
    "llama3": _ROPE_COMMON + ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": _ROPE_COMMON + ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                            "mscale_all_dim", "truncate", "attention_factor"),
}


@dataclass(frozen=True)
class HFFields:
    """A family's classification of config.json keys (see the module docstring); each key in one kind."""

    mapped: frozenset[str] = frozenset()
    fixed: Mapping[str, tuple[Any, str]] = field(default_factory=dict)
    """key -> (the one supported value, what the key does)"""
    ignored: Mapping[str, str] = field(default_factory=dict)
    """key -> why it cannot change the computation"""

    def but(self, *, mapped: Iterable[str] = (), fixed: Optional[Mapping[str, tuple[Any, str]]] = None,
            ignored: Optional[Mapping[str, str]] = None) -> HFFields:
        """These fields with keys added (or moved) into the kinds given."""
        fixed, ignored, mapped = dict(fixed or {}), dict(ignored or {}), frozenset(mapped)
        moved = mapped | set(fixed) | set(ignored)
        return HFFields(mapped=(self.mapped - moved) | mapped,
                        fixed={**{k: v for k, v in self.fixed.items() if k not in moved}, **fixed},
                        ignored={**{k: v for k, v in self.ignored.items() if k not in moved}, **ignored})

    def known(self) -> set[str]:
        return set(self.mapped) | set(self.fixed) | set(self.ignored)


BASE_FIELDS = HFFields(
    ignored={**{k: "bookkeeping" for k in _BOOKKEEPING},
             **{k: "a generation default (the rollout config and the tokenizer decide)" for k in _GENERATION},
             "model_type": "selects the family's converter",
             "torch_dtype": "the stored dtype (model.dtype sets the compute dtype)",
             "dtype": "the stored dtype (model.dtype sets the compute dtype)",
             "initializer_range": "random initialisation only (weights come from the checkpoint)",
             "attention_dropout": "dropout acts only in transformers' training mode; the trainer trains without",
             "chunk_size_feed_forward": "computes the feed-forward in chunks: the same values",
             "pretraining_tp": "splits the projections' matmuls in older transformers: the same values"},
    fixed={"partial_rotary_factor": (1.0, "RoPE on part of each head, which only glm4_moe reads")},
)


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, type(None), list, dict)) else repr(value)


def _refusal(key: str, value: Any, fields: HFFields, model_type: str, shown: str = "") -> Optional[str]:
    """Why the top-level key `key` with `value` is refused (named `shown`, default `key`), or None."""
    shown = shown or key
    if key in fields.mapped or key in fields.ignored:
        return None
    if key in fields.fixed:
        supported, what = fields.fixed[key]
        return None if value == supported else f"{shown}={_show(value)} ({what}: only {_show(supported)} is supported)"
    if not value:
        return None
    return (f"{shown}={_show(value)} (a key the model_type={model_type} import does not read: the checkpoint may "
            "compute something the import would not; remove the key if it changes nothing)")


def check_config_keys(hf: dict[str, Any], fields: HFFields, where: Path) -> None:
    """Raise one ValueError naming every key of the config.json `hf` that `fields` refuses (see the module
    docstring), the RoPE entry's keys included."""
    model_type = hf.get("model_type", "?")
    refused = [r for key, value in hf.items() if (r := _refusal(key, value, fields, model_type))]
    name = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(name)
    if isinstance(rope, dict):
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        allowed = ROPE_KEYS.get(rope_type)  # None: a type arch_from_config refuses by name
        for key, value in rope.items():
            if key == "partial_rotary_factor":
                refused.append(_refusal(key, value, fields, model_type, f"{name}.{key}"))
            elif allowed is not None and key not in allowed and value is not None:
                refused.append(f"{name}.{key}={_show(value)} (not a parameter of rope_type {rope_type!r}: the "
                               "import would drop it)")
    refused = [r for r in refused if r]
    if refused:
        raise ValueError(f"{where}: " + "; ".join(refused))
