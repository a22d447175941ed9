"""Compose, type and validate the run configuration before any process or device is touched.

``load_config(overrides, world_size)`` is the one entry point: it composes ``conf/config.yaml``
with Hydra's compose API, converts it to a ``TrainConfig`` (running each dataclass's
``__post_init__`` checks) and runs the checking pass (``megatron_rl.config.checks.validate``). Every failure,
whether raised by Hydra, OmegaConf or our checks, surfaces as a ``ConfigError`` whose message is
one line naming the key, the bad value, what is allowed and the fix.

This module imports neither torch nor megatron; composing takes well under a second.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigKeyError,
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from megatron_rl.checks import ConfigError
from megatron_rl.config.checks import validate
from megatron_rl.config.schema import SCHEMAS, TrainConfig

CONF_DIR: Path = Path(__file__).resolve().parents[2] / "conf"
"""The repository's YAML config tree (``conf/config.yaml`` and one folder per group)."""

_MISSING_FIXES: dict[str, str] = {
    "model.path": "pass model.path=<HF checkpoint directory with config.json> "
    "(or pick a model built from config with random init, e.g. model=tiny_qwen2)",
}


def compose(overrides: Sequence[str] = (), config_name: str = "config") -> DictConfig:
    """Compose ``conf/<config_name>.yaml`` with Hydra overrides (``["parallel.tp=2", "model=tiny_llama"]``).

    Works inside a running ``@hydra.main`` app too: the enclosing Hydra instance is set aside
    and restored. Raises ConfigError for unknown keys (also ones added with ``+``), values of
    the wrong type, unknown group options and mandatory values (``???``) left unset.
    """
    overrides = list(overrides)
    enclosing = GlobalHydra.instance().hydra
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="megatron_rl"):
            cfg = hydra_compose(config_name=config_name, overrides=overrides)
    except Exception as exc:  # any composition failure is a user config problem: report it on one line
        raise ConfigError(_compose_error_message(exc, overrides, config_name)) from exc
    finally:
        GlobalHydra.instance().hydra = enclosing
    _check_keys(cfg, TrainConfig, "", overrides)
    return cfg


def to_typed(cfg: DictConfig) -> TrainConfig:
    """Instantiate the composed config as a ``TrainConfig``, running every ``__post_init__`` check."""
    if not OmegaConf.has_resolver("now"):
        from hydra.core.utils import setup_globals

        setup_globals()  # registers ${now:...} when cfg did not come from Hydra
    _check_keys(cfg, TrainConfig, "", [])  # a @hydra.main cfg may carry keys added with "+"
    for name, domain in (cfg.get("domains") or {}).items():  # "task.type=x" alone would not say which task
        try:
            OmegaConf.to_object(domain)
        except ValueError as exc:
            raise ConfigError(str(exc).replace("task.", f"domains.{name}.task.")) from exc
    try:
        typed = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(_omegaconf_message(exc, [], cfg)) from exc
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if not isinstance(typed, TrainConfig):
        raise ConfigError(
            f"config has type {type(typed).__name__}, expected TrainConfig: compose it with "
            "megatron_rl.config.compose() or give conf/config.yaml's defaults list base_config first"
        )
    return typed


def load_config(overrides: Sequence[str], world_size: int) -> TrainConfig:
    """Compose, type and validate: the config a run starts with, or a ConfigError."""
    typed = to_typed(compose(overrides))
    validate(typed, world_size)
    return typed


# ---------------------------------------------------------------------------------------------
# Hydra / OmegaConf errors -> one-line messages


def _schema_at(path: str) -> Optional[type]:
    """The dataclass describing the node at dotted ``path`` ("" = top level), or None."""
    if path == "hydra" or path.startswith("hydra."):
        from hydra.conf import HydraConf

        node: Optional[type] = HydraConf
        parts = path.split(".")[1:]
    else:
        node = TrainConfig
        parts = path.split(".") if path else []
    for part in parts:
        if node is None or not dataclasses.is_dataclass(node):
            return None
        hints = typing.get_type_hints(node)
        node = hints.get(part)
        node = node if isinstance(node, type) and dataclasses.is_dataclass(node) else None
    return node


def _unknown_key_message(full_key: str, overrides: Sequence[str]) -> str:
    parent, _, leaf = full_key.rpartition(".")
    override = _override_for(full_key, overrides)
    where = f"in override '{override}'" if override else "in a config file"
    message = f"unknown key {full_key} ({where})"
    schema = _schema_at(parent)
    if schema is not None:
        allowed = [f.name for f in dataclasses.fields(schema)]
        close = difflib.get_close_matches(leaf, allowed, n=1)
        hint = f"; did you mean {parent + '.' if parent else ''}{close[0]}?" if close else ""
        message += f": allowed keys of {parent or 'the top level'} are {', '.join(allowed)}{hint}"
        if not parent:
            message += f" (config groups: {', '.join(SCHEMAS)})"
    elif override and not override.startswith("+"):  # a mapping's keys (sandbox.images) are added, not set
        message += f": {parent} is a mapping of your own keys; add one with +{override.lstrip('~')}"
    return message


def _override_for(full_key: str, overrides: Sequence[str]) -> Optional[str]:
    """The override that sets ``full_key`` or a key below it, if any."""
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key == full_key or key.startswith(full_key + "."):
            return override
    return None


def _missing_message(key: str) -> str:
    fix = _MISSING_FIXES.get(key, f"pass {key}=<value>")
    return f"{key}=??? is required but not set: {fix}"


def _omegaconf_message(
    exc: OmegaConfBaseException, overrides: Sequence[str], cfg: Optional[DictConfig] = None
) -> str:
    full_key = str(getattr(exc, "full_key", "") or "")
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, InterpolationResolutionError) and cfg is not None and full_key:
        raw = _raw_value(cfg, full_key)
        return f"{full_key}={raw} is invalid: {reason}; set {full_key} explicitly or fix the key it refers to"
    if isinstance(exc, ConfigKeyError) or ("not in" in reason and "Key '" in reason):
        return _unknown_key_message(full_key, overrides)
    if isinstance(exc, MissingMandatoryValue) or "Missing mandatory value" in reason:
        missing = reason.rsplit("Missing mandatory value:", 1)[-1].strip() or full_key
        return _missing_message(missing)
    override = _override_for(full_key, overrides) if full_key else None
    if isinstance(exc, ValidationError) and override and "=" in override:
        value = override.split("=", 1)[1]
        schema = _schema_at(full_key.rpartition(".")[0])
        expected = ""
        if schema is not None:
            field_type = typing.get_type_hints(schema).get(full_key.rpartition(".")[2])
            expected = f"; {full_key} expects {_type_name(field_type)}" if field_type is not None else ""
        return f"{full_key}={value} is invalid: {reason}{expected}"
    return f"{full_key}: {reason}" if full_key else reason


def _raw_value(cfg: DictConfig, full_key: str) -> Any:
    """The value at ``full_key`` without resolving interpolations (``${model.path}``)."""
    node: Any = OmegaConf.to_container(cfg, resolve=False)
    for part in full_key.split("."):
        if not isinstance(node, dict) or part not in node:
            return "?"
        node = node[part]
    return node


def _type_name(annotation: Any) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args:  # Optional[X]
        return f"{_type_name(args[0])} or null"
    return getattr(annotation, "__name__", str(annotation))


def _compose_error_message(exc: BaseException, overrides: Sequence[str], config_name: str) -> str:
    if isinstance(exc, MissingConfigException):
        return _missing_option_message(exc, config_name)
    if isinstance(exc, OverrideParseException):
        return "; ".join(str(exc).splitlines()[:2]) + " (quote values with spaces or '=': key='a=b')"
    cause: Optional[BaseException] = exc
    while cause is not None:
        if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
            return _omegaconf_message(cause, overrides)
        cause = cause.__cause__ or cause.__context__
    return f"cannot compose config '{config_name}' with overrides {overrides}: {' '.join(str(exc).split())}"


def _missing_option_message(exc: MissingConfigException, config_name: str) -> str:
    missing = str(exc.missing_cfg_file or "")
    group, _, option = missing.rpartition("/")
    schema_names = {f"base_{g}" for g in SCHEMAS}
    options = exc.options or sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    options = [o for o in options if o not in schema_names]
    if not group:
        available = sorted(p.stem for p in CONF_DIR.glob("*.yaml"))
        return (
            f"config_name={missing or config_name} not found in {CONF_DIR}: "
            f"available configs are {', '.join(available)}"
        )
    listed = ", ".join(options) if options else "none"
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    if first_line.startswith("In '") and not first_line.startswith(f"In '{config_name}'"):
        # A defaults list inside a YAML file names the missing option, not the command line.
        schema_hint = f"; its schema is base_{group}" if group in SCHEMAS else ""
        return f"{first_line.rstrip('.')}: available {group} options are {listed}{schema_hint}"
    return (
        f"{group}={option} is not an available option: {group} options are {listed} "
        f"(or add conf/{group}/{option}.yaml)"
    )


def _check_keys(node: DictConfig, schema: Optional[type], prefix: str, overrides: Sequence[str]) -> None:
    """Reject keys a schema does not have (``+`` overrides bypass struct mode) and unset ``???`` values."""
    is_schema = schema is not None and dataclasses.is_dataclass(schema)
    fields = {f.name for f in dataclasses.fields(schema)} if is_schema else None
    hints = typing.get_type_hints(schema) if is_schema else {}
    for key in node.keys():
        full_key = f"{prefix}{key}"
        if fields is not None and key not in fields:
            raise ConfigError(_unknown_key_message(full_key, overrides))
        if OmegaConf.is_missing(node, key):
            raise ConfigError(_missing_message(full_key))
        if OmegaConf.is_interpolation(node, key):
            continue
        child = node[key]
        if isinstance(child, DictConfig):
            child_schema = hints.get(str(key))
            if typing.get_origin(child_schema) is dict:  # dict[str, <dataclass>], e.g. domains
                for name in child.keys():
                    if OmegaConf.is_missing(child, name):  # sandbox.images.python: ??? in a recipe
                        raise ConfigError(_missing_message(f"{full_key}.{name}"))
                    if isinstance(child[name], DictConfig):
                        _check_keys(child[name], typing.get_args(child_schema)[1], f"{full_key}.{name}.", overrides)
                continue
            _check_keys(child, child_schema if isinstance(child_schema, type) else None, f"{full_key}.", overrides)
