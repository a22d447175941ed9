"""How a config check words its error: `key=value is invalid: rule` in one line, naming the full key, the
value as a user would type it as an override, what is allowed and how to fix it. Shared by the schema's
checks and the model families' (megatron_rl/families/); imports nothing of the project."""

from __future__ import annotations

from typing import Any, Sequence


class ConfigError(ValueError):
    """A configuration the run cannot start with; the message is one line (whitespace runs collapse)."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


def format_value(value: Any) -> str:
    """Render a config value the way a user would type it as a Hydra override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


def invalid(key: str, value: Any, rule: str) -> ConfigError:
    return ConfigError(f"{key}={format_value(value)} is invalid: {rule}")


def check_choice(key: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise invalid(key, value, f"allowed values are {', '.join(allowed)}; set {key}=<one of them>")


def check_min(key: str, value: float, low: float, *, strict: bool = False) -> None:
    if value < low or (strict and value == low):
        raise invalid(key, value, f"must be {'>' if strict else '>='} {format_value(low)}")


def divisors_str(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
