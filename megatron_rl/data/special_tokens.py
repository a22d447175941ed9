"""What a tokenizer and its checkpoint directory say about the special tokens around a text: the ids that end a
sequence, and what starts a plain text. Apart from `data/tokenizer.py` (which loads tokenizers and imports the
config) so that the task and rollout modules that read these import nothing of the project's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def end_of_sequence_ids(tokenizer: Any) -> tuple[int, ...]:
    """Every id that ends a sequence of this model: the tokenizer's eos and, when the tokenizer was loaded from
    an HF checkpoint directory, the `eos_token_id` (a number or a list) of its generation_config.json and
    config.json, which is what transformers' generate, SGLang and vLLM stop at. Several models list more than
    the tokenizer's one: Llama-3.1-Instruct <|end_of_text|>, <|eom_id|> (a tool call's end) and <|eot_id|>;
    Qwen2.5-Instruct <|im_end|> and <|endoftext|>. Ids outside the tokenizer's vocabulary are refused."""
    ids = set() if tokenizer.eos_token_id is None else {int(tokenizer.eos_token_id)}
    where = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((where / name).read_text()).get("eos_token_id") if where.parts else None
        except (OSError, ValueError):
            continue
        for token in value if isinstance(value, list) else [] if value is None else [value]:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < len(tokenizer):
                raise ValueError(f"{where / name}: eos_token_id {value!r} is not a list of ids of the tokenizer "
                                 f"({len(tokenizer)} tokens)")
            ids.add(token)
    return tuple(sorted(ids))


def stop_ids(tokenizer: Any, end_of_turn_ids: list[int]) -> tuple[int, ...]:
    """The ids that end a response besides the tokenizer's eos (which engines stop at anyway): the chat template's
    end-of-turn token (`end_of_turn_ids`, the encoded end of turn; used when it is one token) and the checkpoint's
    other end-of-sequence ids (`end_of_sequence_ids`)."""
    ends = set(end_of_turn_ids if len(end_of_turn_ids) == 1 else []) | set(end_of_sequence_ids(tokenizer))
    return tuple(sorted(ends - {tokenizer.eos_token_id}))


def plain_text_prefix(tokenizer: Any) -> str:
    """The text of what the tokenizer puts before a plain text of its own accord (`tokenizer(text)`, as
    transformers and vLLM's completions encode a prompt): its BOS for Llama, Mistral and Gemma tokenizers, "" for
    Qwen's, SmolLM2's and the shipped one. The project encodes rendered text without special tokens (a chat
    template writes its own BOS), so a plain-text prompt starts with this text instead; encoded, it is the BOS id."""
    bos = getattr(tokenizer, "bos_token", None)
    if not bos or tokenizer.bos_token_id is None:
        return ""
    added = tokenizer("a")["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    return bos if added[:1] == [tokenizer.bos_token_id] and plain[:1] != [tokenizer.bos_token_id] else ""
