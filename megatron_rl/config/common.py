"""What the config group modules share: the shipped tokenizers, and two message helpers."""

from __future__ import annotations

from pathlib import Path

from megatron_rl.checks import invalid as _invalid
from megatron_rl.families import families_where

BUILTIN_TOKENIZERS: tuple[str, ...] = ("builtin:char",)
"""Tokenizers shipped with the package, selectable as ``model.tokenizer=builtin:<name>``."""
CHAR_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "char_tokenizer"
"""Where ``builtin:char``'s files are (read by the config checks, which load no transformers, too)."""


def _names(test, sep: str = ", ") -> str:
    """The model families whose spec passes `test`, for a message."""
    return sep.join(families_where(test))


def _check_unit_interval(key: str, value: float, *, low_open: bool, high_open: bool) -> None:
    low_ok = value > 0 if low_open else value >= 0
    high_ok = value < 1 if high_open else value <= 1
    if not (low_ok and high_ok):
        interval = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
        raise _invalid(key, value, f"must lie in {interval}")
