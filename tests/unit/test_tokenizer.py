"""Tests for the shipped character tokenizer and `load_tokenizer`."""

import json
import random
from pathlib import Path

import pytest

from megatron_rl.data.tokenizer import (
    CHAR_TOKENIZER_DIR,
    build_char_tokenizer,
    load_tokenizer,
    save_char_tokenizer,
)

# printable ASCII (space..~) plus newline: the alphabet that must round-trip exactly.
ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n"


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def shipped():
    return load_tokenizer("builtin:char")


def _random_strings(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    strings = ["", " ", "  ", "\n", " \n ", "a  b", " leading", "trailing ", "x . , ! ?"]
    for _ in range(count):
        # bias towards whitespace runs, the classic round-trip breaker
        pool = ALPHABET + "  \n"
        strings.append("".join(rng.choice(pool) for _ in range(rng.randint(0, 80))))
    return strings


@pytest.mark.parametrize("which", ["built", "shipped"])
def test_round_trip(which, tokenizer, shipped):
    tok = tokenizer if which == "built" else shipped
    for text in _random_strings(seed=1234, count=2000):
        ids = tok.encode(text)
        assert len(ids) == len(text), text  # one token per character, nothing added
        assert tok.decode(ids) == text, repr(text)


def test_hand_checked_ids(tokenizer):
    # Layout: 0 eos/pad, 1 im_start, 2 im_end, 3 "\n", then " " (32) .. "~" (126) from 4.
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == 0
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert tokenizer.encode("\n") == [3]
    assert tokenizer.encode(" ") == [4]
    assert tokenizer.encode("!") == [5]
    assert tokenizer.encode("0") == [4 + 48 - 32]  # 20
    assert tokenizer.encode("a") == [69]  # 4 + 97 - 32
    assert tokenizer.encode("~") == [98]  # last id
    assert tokenizer.encode("3+4") == [23, 15, 24]
    assert tokenizer.encode("a<|im_end|>b") == [69, 2, 70]


def test_special_tokens(tokenizer):
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 0
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 0
    assert tokenizer.bos_token is None
    assert tokenizer("hi")["input_ids"] == [76, 77]  # no BOS/EOS added
    assert tokenizer.decode([76, 77, 0], skip_special_tokens=True) == "hi"
    assert tokenizer.decode([76, 77, 0]) == "hi<|endoftext|>"


def test_unknown_characters_become_question_mark(tokenizer):
    assert tokenizer.decode(tokenizer.encode("a\tb\u00e9")) == "a?b?"


def test_vocab_size(tokenizer, shipped):
    for tok in (tokenizer, shipped):
        assert len(tok) == 99 <= 128
        assert sorted(tok.get_vocab().values()) == list(range(99))


def test_chat_template(tokenizer, shipped):
    messages = [
        {"role": "system", "content": "Solve it."},
        {"role": "user", "content": "3 5 7 -> 22"},
    ]
    expected = (
        "<|im_start|>system\nSolve it.<|im_end|>\n"
        "<|im_start|>user\n3 5 7 -> 22<|im_end|>\n"
    )
    for tok in (tokenizer, shipped):
        assert tok.apply_chat_template(messages, tokenize=False) == expected
        prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert prompt == expected + "<|im_start|>assistant\n"
        ids = tok.encode(prompt)
        assert ids[0] == 1 and ids[-11:] == [1, 69, 87, 87, 77, 87, 88, 69, 82, 88, 3]


def test_shipped_assets_match_fresh_build(tokenizer, shipped, tmp_path):
    assert shipped.get_vocab() == tokenizer.get_vocab()
    assert shipped.chat_template == tokenizer.chat_template
    assert shipped.all_special_tokens == tokenizer.all_special_tokens
    for text in _random_strings(seed=99, count=200):
        assert shipped.encode(text) == tokenizer.encode(text)
    # The backend definition (normalizer, decoder, model) is identical too.
    save_char_tokenizer(tmp_path)
    fresh = json.loads((tmp_path / "tokenizer.json").read_text())
    committed = json.loads((CHAR_TOKENIZER_DIR / "tokenizer.json").read_text())
    assert fresh == committed, "regenerate: python -m megatron_rl.data.tokenizer --write-assets"


def test_load_from_path(tmp_path):
    save_char_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert tok.encode("a b") == [69, 4, 70]


def test_load_errors(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=str(missing)):
        load_tokenizer(str(missing))
    with pytest.raises(ValueError, match="builtin:char"):
        load_tokenizer("builtin:bytes")


def test_assets_dir_is_inside_package():
    repo_root = Path(__file__).resolve().parents[2]
    assert CHAR_TOKENIZER_DIR == repo_root / "megatron_rl" / "assets" / "char_tokenizer"
    assert (CHAR_TOKENIZER_DIR / "tokenizer.json").is_file()


def test_saved_beside_a_qwen2_config_still_round_trips(tmp_path):
    """transformers 5 would pick Qwen2Tokenizer from config.json and drop spaces; we must not."""
    import json as _json

    from megatron_rl.data.tokenizer import build_char_tokenizer, load_tokenizer

    build_char_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(_json.dumps({"model_type": "qwen2"}))
    tok = load_tokenizer(str(tmp_path))
    assert tok.decode(tok("3 5 7 -> 22")["input_ids"]) == "3 5 7 -> 22"


_REMOTE_TOKENIZER = '''
from transformers import PreTrainedTokenizer


class DigitTokenizer(PreTrainedTokenizer):
    """A tokenizer that is only code: one token per character of '0123456789 +=', then the end token."""

    vocab_files_names = {}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, **kwargs):
        self._chars = list("0123456789 +=")
        super().__init__(eos_token="</s>", pad_token="</s>", **kwargs)

    @property
    def vocab_size(self):
        return len(self._chars) + 1

    def get_vocab(self):
        return {**{c: i for i, c in enumerate(self._chars)}, "</s>": len(self._chars)}

    def _tokenize(self, text):
        return list(text)

    def _convert_token_to_id(self, token):
        return self.get_vocab()[token]

    def _convert_id_to_token(self, index):
        return "</s>" if index == len(self._chars) else self._chars[index]

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
'''


def test_remote_code_tokenizer_runs_only_when_trusted(tmp_path):
    """A tokenizer that is code of its own (Kimi-K2's, Moonlight's): refused with a message naming
    model.trust_remote_code (never transformers' interactive prompt), loaded with it."""
    (tmp_path / "digit_tokenizer.py").write_text(_REMOTE_TOKENIZER)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "DigitTokenizer", "auto_map": {"AutoTokenizer": ["digit_tokenizer.DigitTokenizer", None]}}))
    with pytest.raises(ValueError, match="model.trust_remote_code=true"):
        load_tokenizer(str(tmp_path))
    tokenizer = load_tokenizer(str(tmp_path), trust_remote_code=True)
    assert type(tokenizer).__name__ == "DigitTokenizer"
    assert tokenizer("12+3").input_ids == [1, 2, 11, 3]
    assert (tokenizer.eos_token_id, tokenizer.decode([4, 12, 4])) == (13, "4=4")
    # the older auto_map spelling (the AutoTokenizer pair alone) is code too
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "DigitTokenizer", "auto_map": ["digit_tokenizer.DigitTokenizer", None]}))
    with pytest.raises(ValueError, match="model.trust_remote_code=true"):
        load_tokenizer(str(tmp_path))
