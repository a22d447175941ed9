"""Tokenizer loading, and the shipped character-level tokenizer used by the CPU demo.

`load_tokenizer(spec)` is the one entry point the rest of the code uses: `"builtin:char"`
loads the committed assets in `megatron_rl/assets/char_tokenizer/`, anything else is a
local Hugging Face tokenizer directory. Loading is always offline.

Character tokenizer layout (ids are part of the checkpoint format; never reorder):

    0      <|endoftext|>   eos and pad (no BOS is ever added)
    1      <|im_start|>
    2      <|im_end|>
    3      "\\n"
    4..98  the 95 printable ASCII characters " " (32) .. "~" (126) in code-point order,
           i.e. id(c) = 4 + ord(c) - 32

That is 99 ids, below the demo model's padded vocab_size of 128. `decode(encode(s)) == s`
for every string of printable ASCII and newlines. Any other character (tab, carriage
return, non-ASCII) is normalised to "?" rather than silently dropped, so lossy input
stays visible. The chat template is Qwen-style (`<|im_start|>role\\ncontent<|im_end|>\\n`).

Regenerate the committed assets after changing the layout with
`python -m megatron_rl.data.tokenizer --write-assets`.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Optional, Sequence, Union

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from megatron_rl.config.schema import CHAR_TOKENIZER_DIR  # the config checks read it too, without transformers

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
# "\n" first, then space..tilde: the order defines the ids (see module docstring).
CHARACTERS: tuple[str, ...] = ("\n",) + tuple(chr(c) for c in range(32, 127))
MAX_VOCAB_SIZE = 128
# Replacement for characters outside CHARACTERS; must itself be in CHARACTERS.
REPLACEMENT_CHAR = "?"

# Tools (OpenAI `tools`, rollout/openai_server.py) are listed in a system turn of their own, by name and argument
# names only (every character is a token here); an assistant turn's tool calls follow its content in the Hermes
# format the endpoint parses. Without tools or tool calls the rendering is the plain Qwen-style one.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools:' }}{% for tool in tools %}"
    "{{ ' ' + tool['function']['name'] + '(' + (tool['function']['parameters']['properties'] | join(',')) + ')' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}{{ '<tool_call>' + "
    "({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson) + '</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

BUILTIN_PREFIX = "builtin:"
BUILTIN_TOKENIZERS: dict[str, Path] = {"char": CHAR_TOKENIZER_DIR}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character tokenizer from code (the committed assets are this, saved)."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    assert len(vocab) <= MAX_VOCAB_SIZE, len(vocab)
    # BPE with an explicit vocab and no merges splits text into single characters; with no
    # pre-tokenizer, spaces are ordinary characters and survive the round trip.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # Without this, BPE (no unk token) silently drops unknown characters.
    backend.normalizer = normalizers.Replace(Regex(r"[^\n -~]"), REPLACEMENT_CHAR)
    # The default decoder joins tokens with spaces; Fuse concatenates them.
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        extra_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        chat_template=CHAT_TEMPLATE,
        # transformers' clean-up would rewrite " ." to "." and break the round trip.
        clean_up_tokenization_spaces=False,
    )


def save_char_tokenizer(out_dir: Union[str, Path]) -> Path:
    """Build the character tokenizer and save it as a Hugging Face tokenizer directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_char_tokenizer().save_pretrained(str(out))
    logger.info("wrote character tokenizer to %s", out)
    return out


def load_tokenizer(spec: str, trust_remote_code: bool = False) -> PreTrainedTokenizerFast:
    """Load a tokenizer offline.

    Args:
        spec: `"builtin:char"` for the shipped character tokenizer, or a path to a local
            Hugging Face tokenizer directory (one containing `tokenizer.json` or the files
            `AutoTokenizer` understands).
        trust_remote_code: let the directory's own tokenizer code run (`model.trust_remote_code`);
            without it such a tokenizer is refused at once (never an interactive prompt).

    Raises:
        ValueError: unknown builtin name, the path does not exist, or the tokenizer is code that
            `trust_remote_code` does not allow.
    """
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX):]
        if name not in BUILTIN_TOKENIZERS:
            allowed = ", ".join(BUILTIN_PREFIX + n for n in sorted(BUILTIN_TOKENIZERS))
            raise ValueError(
                f"unknown builtin tokenizer {spec!r}; allowed: {allowed}, "
                "or a path to a Hugging Face tokenizer directory"
            )
        path = BUILTIN_TOKENIZERS[name]
        if not path.is_dir():
            raise ValueError(
                f"shipped tokenizer assets for {spec!r} are missing at {path}; regenerate them "
                "with `python -m megatron_rl.data.tokenizer --write-assets`"
            )
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            raise ValueError(
                f"tokenizer path {str(path)!r} does not exist; pass 'builtin:char' or a local "
                "Hugging Face tokenizer directory (downloads are disabled)"
            )
    logger.debug("loading tokenizer %r from %s", spec, path)
    if _declares_generic_backend(path):
        # transformers 5 maps some model types (e.g. qwen2) to their own tokenizer class when a
        # config.json sits beside the tokenizer, even when tokenizer_config.json declares the
        # generic backend; that class re-tokenizes differently (it drops our spaces). Load the
        # declared generic class directly so tokenizer.json is used exactly as written.
        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    if _declares_remote_code(path) and not trust_remote_code:
        raise ValueError(f"tokenizer {str(path)!r} is code of its own (tokenizer_config.json auto_map), which runs "
                         "only with model.trust_remote_code=true: set it if you trust that directory")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)


def _declares_remote_code(path: Path) -> bool:
    config = path / "tokenizer_config.json"
    if not config.is_file():
        return False
    auto_map = json.loads(config.read_text()).get("auto_map") or {}
    # the older spelling is the AutoTokenizer pair itself, a list
    return isinstance(auto_map, (list, tuple)) or "AutoTokenizer" in auto_map


def _declares_generic_backend(path: Path) -> bool:
    config = path / "tokenizer_config.json"
    if not (config.is_file() and (path / "tokenizer.json").is_file()):
        return False
    declared = json.loads(config.read_text()).get("tokenizer_class")
    return declared in ("TokenizersBackend", "PreTrainedTokenizerFast")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """CLI: `python -m megatron_rl.data.tokenizer --write-assets [--out-dir DIR]`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write-assets", action="store_true", help="(re)generate the shipped tokenizer files"
    )
    parser.add_argument(
        "--out-dir", type=Path, default=CHAR_TOKENIZER_DIR, help="default: %(default)s"
    )
    args = parser.parse_args(argv)
    if not args.write_assets:
        parser.error("nothing to do; pass --write-assets")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    save_char_tokenizer(args.out_dir)


if __name__ == "__main__":
    main()
