"""The files a run reads, found before a run directory exists: model.path (config.json, every weight file),
the tokenizer (its vocabulary against the model's and the checkpoint's), the task data, wandb, reward models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from megatron_rl.checks import ConfigError, format_value
from megatron_rl.config.schema import BUILTIN_TOKENIZERS, CHAR_TOKENIZER_DIR


def check_paths(cfg) -> None:
    """Every file the run reads exists and parses: the checkpoint (its weight files), the tokenizer (and its
    vocabulary against the model's), the task data; wandb where asked for."""
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
    _check_sandbox(cfg)  # after the task's files: whether it runs code is read from its first row
    _check_reward_models(cfg)


def _check_reward_models(cfg) -> None:
    """Every task.reward=reward_model's checkpoint: a sequence classifier with num_labels=1 of a supported family,
    its tensors, and the policy's tokenizer (checkpoint/reward_model.py)."""
    from megatron_rl.checkpoint.reward_model import check_reward_model
    from megatron_rl.config.reward_model import reward_model_arch

    tasks = {"task": cfg.task} if not cfg.domains else {f"domains.{n}.task": d.task for n, d in cfg.domains.items()}
    for where, task in tasks.items():
        if task.reward == "reward_model":
            try:
                check_reward_model(Path(task.reward_model.path).expanduser(), cfg.model.tokenizer, _vocabulary,
                                   reward_model_arch)
            except ValueError as exc:
                raise ConfigError(str(exc).replace("task.reward_model", f"{where}.reward_model")) from None


def _check_sandbox(cfg) -> None:
    """The sandbox images exist, and a run whose rewards execute code under apptainer has one: apptainer has no
    image of its own (bwrap runs in the host's), so without one every reward would fail at the first step."""
    sb = cfg.sandbox
    if sb.images and sb.runtime == "process":
        raise ConfigError(f"sandbox.images={{{', '.join(sb.images)}}} with sandbox.runtime=process, which runs code on "
                          "the host in no image: use sandbox=apptainer (or bwrap, with root file system directories)")
    for name, image in sb.images.items():
        path = Path(image).expanduser()
        if not path.exists():
            raise ConfigError(f"sandbox.images.{name}={image} does not exist: give the path on the shared file "
                              "system of an image built with `apptainer build python.sif docs/examples/python.def`")
        if sb.runtime == "bwrap" and not path.is_dir():
            raise ConfigError(f"sandbox.images.{name}={image} is not a directory: the bwrap runtime runs code in a "
                              "root file system directory (apptainer takes .sif files: sandbox=apptainer)")
    if sb.runtime != "apptainer" or sb.images or sb.address:
        return
    from megatron_rl.data.tasks import run_needs_sandbox

    if run_needs_sandbox(cfg):
        raise ConfigError("sandbox.runtime=apptainer (the default under cluster=slurm) needs an image to run the "
                          "task's code in: build one with `apptainer build python.sif docs/examples/python.def` "
                          "and pass +sandbox.images.python=/shared/path/python.sif; or sandbox=bwrap where the "
                          "nodes allow unprivileged user namespaces, or sandbox.address=host:port of a running "
                          "sandbox service")


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
