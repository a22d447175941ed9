"""Compose, type and validate the run configuration before any process or device is touched.

``load_config(overrides, world_size)`` is the one entry point: it composes ``conf/config.yaml``
with Hydra's compose API, converts it to a ``TrainConfig`` (running each dataclass's
``__post_init__`` checks) and applies the cross-group checks of ``validate``. Every failure,
whether raised by Hydra, OmegaConf or our checks, surfaces as a ``ConfigError`` whose message is
one line naming the key, the bad value, what is allowed and the fix.

This module imports neither torch nor megatron; composing takes well under a second.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
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

from megatron_rl.config.schema import BUILTIN_TOKENIZERS, CHAR_TOKENIZER_DIR, SCHEMAS, TrainConfig, format_value

CONF_DIR: Path = Path(__file__).resolve().parents[2] / "conf"
"""The repository's YAML config tree (``conf/config.yaml`` and one folder per group)."""

_MISSING_FIXES: dict[str, str] = {
    "model.path": "pass model.path=<HF checkpoint directory with config.json> "
    "(or pick a model built from config with random init, e.g. model=tiny_qwen2)",
}


class ConfigError(ValueError):
    """A configuration the run cannot start with; the message is a single line."""

    def __init__(self, message: str) -> None:
        super().__init__(_one_line(message))


def _one_line(text: str) -> str:
    return " ".join(text.split())


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


def validate(cfg: TrainConfig, world_size: int) -> None:
    """Cross-group checks that need the world size or the file system; raises ConfigError."""
    if world_size < 1:
        raise ConfigError(f"world_size={world_size} is invalid: must be >= 1")
    model, par = cfg.model, cfg.parallel
    valid_tp = ", ".join(str(t) for t in _valid_tp_values(cfg, world_size)) or "none (fix pp/cp first)"
    model_desc = (
        f"num_attention_heads={model.num_attention_heads}, num_query_groups={model.num_query_groups}, "
        f"vocab_size={model.vocab_size}"
    )
    if world_size % par.model_parallel_size != 0:
        raise ConfigError(
            f"parallel.tp={par.tp}, parallel.pp={par.pp}, parallel.cp={par.cp} (product {par.model_parallel_size}) "
            f"do not divide world_size={world_size}: valid parallel.tp values for this world size, "
            f"pp={par.pp}, cp={par.cp} and model ({model_desc}) are {valid_tp}"
        )
    for key, value in (
        ("num_attention_heads", model.num_attention_heads),
        ("num_query_groups", model.num_query_groups),
        ("vocab_size", model.vocab_size),
    ):
        if value % par.tp != 0:
            raise ConfigError(
                f"model.{key}={value} is not divisible by parallel.tp={par.tp}: valid parallel.tp values "
                f"for world_size={world_size} and model ({model_desc}) are {valid_tp}"
            )
    if model.num_layers % par.pp != 0:
        raise ConfigError(
            f"model.num_layers={model.num_layers} is not divisible by parallel.pp={par.pp}: "
            f"valid parallel.pp values divide {model.num_layers} ({_divisors(model.num_layers)})"
        )
    _validate_experts(cfg, world_size)
    if model.transformer_impl == "transformer_engine" and cfg.cluster.device == "cpu":
        raise ConfigError("model.transformer_impl=transformer_engine needs a GPU, but cluster.device=cpu: use "
                          "model.transformer_impl=auto (the local spec on CPU)")
    if model.transformer_impl == "local" and cfg.cluster.device == "cuda":
        problem = model.local_spec_gpu_problem(par.sequence_parallel)
        if problem:
            raise ConfigError(f"model.transformer_impl=local cannot run {problem} on a GPU (cluster.device=cuda): "
                              "Megatron-core's local paths for it assume Transformer Engine; use "
                              "model.transformer_impl=auto with TE installed")
    if par.cp > 1 and model.attention_sinks:
        raise ConfigError(
            f"parallel.cp={par.cp} is not supported with model.family={model.family}: its attention (sinks, "
            "sliding windows) runs in the CPU path's own core attention, which does not split sequences, and TE's "
            "context-parallel attention with sinks is unverified; set parallel.cp=1"
        )
    dp = par.dp_size(world_size)
    if cfg.global_batch_size % dp != 0:
        raise ConfigError(
            f"global_batch_size={cfg.global_batch_size} is not divisible by the data-parallel size {dp} "
            f"(world_size={world_size} / (tp*pp*cp={par.model_parallel_size})): use a multiple of {dp}"
        )
    if model.mlp_bias and cfg.rollout.backend == "sglang":
        # sglang/srt/models/llama.py: LlamaMLP builds gate_up_proj and down_proj with bias=False, and its weight
        # loader skips bias tensors it has no parameter for: the engine would sample from another model
        raise ConfigError("model.mlp_bias=true is not supported with rollout.backend=sglang: SGLang's Llama has no "
                          "MLP biases and would drop them; use rollout.backend=hf")
    if world_size % cfg.rollout.tp != 0:
        raise ConfigError(
            f"rollout.tp={cfg.rollout.tp} does not divide world_size={world_size}: "
            f"valid rollout.tp values are {_divisors(world_size)}"
        )
    if cfg.mode == "rl":
        _validate_rl(cfg)
    _validate_paths(cfg)


def load_config(overrides: Sequence[str], world_size: int) -> TrainConfig:
    """Compose, type and validate: the config a run starts with, or a ConfigError."""
    typed = to_typed(compose(overrides))
    validate(typed, world_size)
    return typed


def _validate_experts(cfg: TrainConfig, world_size: int) -> None:
    """Megatron-core's own conditions on expert parallelism, checked before any process starts."""
    model, par = cfg.model, cfg.parallel
    if par.etp is not None and par.etp != par.tp and not model.is_moe:
        raise ConfigError(f"parallel.etp={par.etp} is invalid for a dense model (model.family={model.family}): "
                          "it splits experts; set parallel.etp=null")
    if par.ep > 1 and not model.is_moe:
        raise ConfigError(
            f"parallel.ep={par.ep} is invalid for a dense model (model.family={model.family}): "
            "expert parallelism needs model.num_experts; set parallel.ep=1"
        )
    if not model.is_moe:
        return
    if model.num_experts % par.ep != 0:  # megatron/core/transformer/moe/moe_layer.py:101
        raise ConfigError(
            f"parallel.ep={par.ep} does not divide model.num_experts={model.num_experts}: "
            f"valid parallel.ep values divide {model.num_experts} ({_divisors(model.num_experts)})"
        )
    etp = par.expert_tp(model)
    if model.linear_bias and etp != 1:  # megatron/core/transformer/transformer_config.py:1588-1591
        raise ConfigError(
            f"parallel.etp={etp} is invalid for model.family={model.family}: its experts have biases, which "
            "Megatron-core supports only with expert tensor-parallel size 1; set parallel.etp=1 (or null)"
        )
    expert_layout = etp * par.ep * par.pp  # megatron/core/parallel_state.py:789
    if world_size % expert_layout != 0:
        valid = [e for e in range(1, world_size // (etp * par.pp) + 1)
                 if world_size % (etp * e * par.pp) == 0 and model.num_experts % e == 0]
        etp_source = ("parallel.etp" if par.etp is not None
                      else "parallel.etp=null: 1 for biased experts" if model.linear_bias
                      else "parallel.etp=null: parallel.tp")
        raise ConfigError(
            f"parallel.ep={par.ep} is invalid for world_size={world_size} with expert tensor-parallel size "
            f"{etp} ({etp_source}), parallel.pp={par.pp}: etp*ep*pp={expert_layout} must divide the world size "
            f"(experts are split over data-parallel ranks); valid parallel.ep values are {', '.join(map(str, valid))}"
            + ("; or set parallel.etp=1" if etp > 1 else "")
        )
    if par.tp > 1 and not par.sequence_parallel:  # megatron/core/transformer/moe/moe_layer.py:379
        raise ConfigError(
            f"parallel.tp={par.tp} with experts (model.num_experts={model.num_experts}) needs "
            "parallel.sequence_parallel=true: Megatron-core refuses to train MoE layers with tensor "
            "parallelism but without sequence parallelism"
        )


def _validate_rl(cfg: TrainConfig) -> None:
    algo, rollout = cfg.algorithm, cfg.rollout
    if algo.advantage_estimator in algo.GROUP_ESTIMATORS and rollout.n_samples_per_prompt < 2:
        raise ConfigError(
            f"rollout.n_samples_per_prompt={rollout.n_samples_per_prompt} is invalid with "
            f"algorithm.advantage_estimator={algo.advantage_estimator}: group-relative advantages "
            "need >= 2 samples per prompt (all advantages would be 0)"
        )
    eval_tokens = cfg.task.eval_max_new_tokens
    if eval_tokens is not None and eval_tokens >= cfg.model.max_position_embeddings:
        raise ConfigError(f"task.eval_max_new_tokens={eval_tokens} is invalid: must be < model.max_position_embeddings="
                          f"{cfg.model.max_position_embeddings} to leave room for the prompt")
    if rollout.n_samples_per_prompt == 1 and (algo.filter_zero_variance or algo.dynamic_sampling):
        which = "filter_zero_variance" if algo.filter_zero_variance else "dynamic_sampling"
        raise ConfigError(f"algorithm.{which}=true with rollout.n_samples_per_prompt=1: every group of one sample "
                          "has no reward variance, so every sample would be dropped; sample >= 2 per prompt or "
                          f"set algorithm.{which}=false")
    if rollout.max_new_tokens >= cfg.model.max_position_embeddings:
        raise ConfigError(
            f"rollout.max_new_tokens={rollout.max_new_tokens} is invalid: must be < "
            f"model.max_position_embeddings={cfg.model.max_position_embeddings} to leave room for the prompt"
        )


def _validate_paths(cfg: TrainConfig) -> None:
    model = cfg.model
    if model.path is not None:
        path = Path(model.path).expanduser()
        fix = "give an HF checkpoint directory with config.json, or model.path=null to build model.* from config"
        if not path.exists():
            raise ConfigError(f"model.path={model.path} does not exist: {fix}")
        if path.is_file():
            with open(path, "rb") as f:
                gguf = f.read(4) == b"GGUF"
            if gguf:
                raise ConfigError(f"model.path={model.path} is a GGUF file, which Megatron does not load: convert "
                                  "it to an HF directory with `python -m megatron_rl.checkpoint.fetch --gguf "
                                  f"{model.path} --out <dir>` and give model.path=<dir>")
            raise ConfigError(f"model.path={model.path} is a file: {fix}")
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path={model.path} has no config.json: {fix}")
        from megatron_rl.checkpoint.hf import check_weight_files

        try:  # the index, every shard present and as long as its header says: found now, not after a run dir exists
            check_weight_files(path)
        except ValueError as exc:
            raise ConfigError(f"model.path={model.path}: {exc}") from None
    if model.tokenizer not in BUILTIN_TOKENIZERS and not Path(model.tokenizer).expanduser().exists():
        raise ConfigError(
            f"model.tokenizer={model.tokenizer} does not exist: give a HF tokenizer directory "
            f"or one of {', '.join(BUILTIN_TOKENIZERS)}"
        )
    problem = None if model.tokenizer in BUILTIN_TOKENIZERS else _tokenizer_problem(Path(model.tokenizer).expanduser())
    if problem:
        raise ConfigError(f"model.tokenizer={model.tokenizer}: {problem}")
    _check_vocabulary(model)
    if cfg.logging.wandb:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("logging.wandb=true needs wandb: pip install -e '.[wandb]', or set logging.wandb=false")
    task = cfg.task
    for key in ("path", "eval_path") if task.type in ("dataset", "agent") else ():
        value = getattr(task, key)
        if value is not None and not Path(str(value)).expanduser().exists():
            raise ConfigError(f"task.{key}={format_value(value)} does not exist: give a .jsonl or .parquet file or a "
                              "directory written by datasets' save_to_disk for task.type=dataset")
        if value is not None:
            from megatron_rl.data.sources import detect_format

            try:
                detect_format(value)
            except ValueError as err:
                raise ConfigError(f"task.{key}={format_value(value)}: {err}") from None


# A tokenizer directory holds at least one vocabulary: tokenizers' tokenizer.json, a SentencePiece or
# TikToken model (tokenizer.model, spiece.model, tiktoken.model), or a BPE / WordPiece vocab.json / vocab.txt.
_TOKENIZER_VOCABULARIES = ("tokenizer.json", "*.model", "*.tiktoken", "vocab.json", "vocab.txt")


def _tokenizer_problem(path: Path) -> Optional[str]:
    """What keeps the tokenizer directory `path` from loading, found from its files (None: nothing seen):
    no vocabulary file, or a JSON file of it that does not parse (an empty or cut-short copy)."""
    if not path.is_dir():
        return None
    if not any(next(path.glob(pattern), None) for pattern in _TOKENIZER_VOCABULARIES):
        return (f"{path} holds no tokenizer files (none of {', '.join(_TOKENIZER_VOCABULARIES)}): give the "
                "directory the checkpoint's tokenizer was saved in")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        try:
            if (path / name).is_file():
                json.loads((path / name).read_text())
        except (OSError, ValueError) as exc:
            return f"{path / name} is unreadable ({type(exc).__name__}: {exc}): restore it from the checkpoint's source"
    return None


def _vocabulary(spec: str) -> Optional[dict[str, int]]:
    """token -> id of the tokenizer `spec` (builtin:char or a directory), read from its tokenizer.json by the
    `tokenizers` library alone (no transformers, no torch: config checks stay light); None where there is no
    tokenizer.json that parses (SentencePiece and TikToken vocabularies, unusual files: not checked here)."""
    path = CHAR_TOKENIZER_DIR if spec == "builtin:char" else Path(spec).expanduser()
    if not (path / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab(with_added_tokens=True)
    except Exception:  # noqa: BLE001  (a file tokenizers cannot read: transformers may; not judged here)
        return None


def _check_vocabulary(model) -> None:
    """The tokenizer's ids must name the model's tokens: none beyond the embedding (model.vocab_size, from
    model.path's config.json where given), and where the checkpoint directory holds its own tokenizer and
    model.tokenizer is another, the same vocabulary (the same token at every id). A mismatch trains and
    generates on the wrong tokens without any error. Judged from tokenizer.json files where both exist."""
    mine = _vocabulary(model.tokenizer)
    if mine is None:
        return
    size = max(mine.values(), default=-1) + 1
    source = f"{model.path}/config.json" if model.path else "model.vocab_size"
    if size > model.vocab_size:
        raise ConfigError(f"model.tokenizer={model.tokenizer} has {size} tokens, more than the model's vocabulary of "
                          f"{model.vocab_size} ({source}): its ids >= {model.vocab_size} have no embedding; give the "
                          "tokenizer the checkpoint was trained with")
    if model.path is None or Path(model.tokenizer).expanduser().resolve() == Path(model.path).expanduser().resolve():
        return
    theirs = _vocabulary(model.path)
    if theirs is not None and mine != theirs:
        differing = next((t for t in sorted(mine) if theirs.get(t) != mine[t]), None)
        example = (f"{differing!r} is id {mine[differing]} in model.tokenizer, "
                   f"{theirs[differing] if differing in theirs else 'absent'} in the checkpoint's"
                   if differing is not None else "the checkpoint's has tokens model.tokenizer lacks")
        raise ConfigError(f"model.tokenizer={model.tokenizer} does not match the tokenizer saved with model.path="
                          f"{model.path} ({len(mine)} vs {len(theirs)} tokens; {example}): the model would read other "
                          f"tokens than the ids say; set model.tokenizer={model.path}")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _valid_tp_values(cfg: TrainConfig, world_size: int) -> list[int]:
    model, par = cfg.model, cfg.parallel
    return [
        tp
        for tp in range(1, world_size + 1)
        if world_size % (tp * par.pp * par.cp) == 0
        and model.num_attention_heads % tp == 0
        and model.num_query_groups % tp == 0
        and model.vocab_size % tp == 0
    ]


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
    return f"cannot compose config '{config_name}' with overrides {overrides}: {_one_line(str(exc))}"


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
                    if isinstance(child[name], DictConfig):
                        _check_keys(child[name], typing.get_args(child_schema)[1], f"{full_key}.{name}.", overrides)
                continue
            _check_keys(child, child_schema if isinstance(child_schema, type) else None, f"{full_key}.", overrides)
