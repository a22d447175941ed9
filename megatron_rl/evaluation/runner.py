"""Offline evaluation of a run's checkpoints (`python -m megatron_rl.eval`): the run's config,
the checkpoints to evaluate, and the loop that loads each one into the trainer and samples every
evaluation set through the same colocated rollout and the same records as training-time
evaluation (`rl.evaluate.evaluation_records`).

Every rank runs the loop (generation is data-parallel, as in training); rank 0 appends the
records to `records.jsonl` as each (checkpoint, set, seed) finishes and writes the report.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Any, Optional, Sequence

logger = logging.getLogger(__name__)

HELD_OUT = "heldout"
REGRESSION = "regression"
_STEP_NAME = re.compile(r"step_(\d+)$")
_SET_NAME = re.compile(r"[A-Za-z][\w.-]*")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One set of weights to evaluate: a training checkpoint (`kind="train"`, a step_N directory
    with meta.json) or an HF export (`kind="hf"`, a directory with config.json)."""

    name: str
    path: str
    kind: str
    step: Optional[int]


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """What to evaluate and how; see `megatron_rl/eval.py` for the command line."""

    run: str
    checkpoints: tuple[Checkpoint, ...]
    out_dir: str
    num_seeds: int = 3
    ks: tuple[int, ...] = (1,)
    regression: tuple[tuple[str, str], ...] = ()  # (set name, spec) per regression set (`regression_sets`)
    confidence: float = 0.95
    num_resamples: int = 10_000


def load_run_config(run: str | Path, out_dir: str | Path, overrides: Sequence[str], needs_held_out: bool = True):
    """The run's saved config.yaml with `overrides` (`key=value`) applied, its output moved to
    `out_dir` and resuming switched off, typed and validated for the world this process is in
    (torchrun / srun) or will launch (cluster.nproc); raises ConfigError."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from megatron_rl.config import ConfigError, to_typed, validate
    from megatron_rl.config.schema import TrainConfig

    path = Path(run) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"--run={run} has no config.yaml: pass the run directory a training job wrote "
                          "(it holds config.yaml, checkpoints/ and metrics.jsonl)")
    bad = [o for o in overrides if "=" not in o or o.startswith(("+", "~")) or o.split("=")[0].startswith("-")]
    if bad:
        raise ConfigError(f"override {bad[0]!r} is invalid: evaluation takes key=value overrides of the run's "
                          "config (e.g. task.eval_samples=8 task.num_eval=100 rollout.temperature=0.7)")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.load(path),
                              {"run_dir": str(out_dir), "mode": "rl", "checkpoint": {"resume": False},
                               "logging": {"wandb": False}},
                              OmegaConf.from_dotlist(list(overrides)))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{path} with overrides {' '.join(overrides) or '(none)'}: {exc}") from None
    typed = to_typed(cfg)
    validate(typed, _world_size(typed))
    if needs_held_out and typed.task.num_eval < 1 and not typed.domains:
        raise ConfigError(f"task.num_eval={typed.task.num_eval}: the held-out set is empty; set task.num_eval>=1")
    return typed


def _world_size(cfg) -> int:
    from megatron_rl.parallel.dist import dist_env_from

    env = dist_env_from()
    if env.source != "single":
        return env.world_size
    return cfg.cluster.nproc if cfg.cluster.launcher == "local" else 1


def resolve_checkpoints(run: str | Path, selectors: Sequence[str]) -> tuple[Checkpoint, ...]:
    """Checkpoints named by `selectors`, in the given order, duplicates dropped: `all` (every
    complete training checkpoint of the run, by step), `latest`, `best` (checkpoint.keep_best's
    choice), `hf` (every HF export under run/hf), a step number, a checkpoint name (step_00000010)
    or a directory path."""
    from megatron_rl.checkpoint.training import find_best, find_latest, list_checkpoints

    root = Path(run) / "checkpoints"
    found: list[Checkpoint] = []
    for sel in selectors:
        if sel == "all":
            found += [_train(p) for _, p in list_checkpoints(root)]
        elif sel == "latest":
            latest = find_latest(root)
            found += [_train(latest)] if latest else []
        elif sel == "best":
            best = find_best(root)
            if best is None:
                raise ValueError(f"--checkpoints best: {root} names no best checkpoint (train with "
                                 "checkpoint.keep_best=N and checkpoint.best_metric=...)")
            found.append(_train(best))
        elif sel == "hf":
            found += [_hf(p) for p in sorted((Path(run) / "hf").glob("step_*")) if (p / "config.json").is_file()]
        elif sel.isdigit():
            found.append(_by_path(root / f"step_{int(sel):08d}", sel))
        elif (root / sel).is_dir():
            found.append(_by_path(root / sel, sel))
        else:
            found.append(_by_path(Path(sel), sel))
    unique = _distinct_names(list({c.path: c for c in found}.values()))
    if not unique:
        raise ValueError(f"--checkpoints {' '.join(selectors)} found no checkpoint under {root}: train with "
                         "checkpoint.save_every=N, or pass checkpoint directories")
    return tuple(unique)


def _distinct_names(found: list[Checkpoint]) -> list[Checkpoint]:
    """Records and reports group by checkpoint name: two checkpoints of one name (step_00000050 of two
    runs) are named after their run directory too, `<run>/<name>` (they were pooled into one before)."""
    counts = collections.Counter(c.name for c in found)
    out = []
    for c in found:
        if counts[c.name] > 1:
            run = Path(c.path).parent.parent.name  # run/checkpoints/step_N, run/hf/step_N
            c = dataclasses.replace(c, name=f"{run}/{c.name}")
        out.append(c)
    names = [c.name for c in out]
    if len(set(names)) < len(names):
        clash = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"two checkpoints would be called {clash!r}: pass checkpoints of differently named runs")
    return out


def _train(path: Path) -> Checkpoint:
    meta = json.loads((path / "meta.json").read_text())
    return Checkpoint(path.name, str(path.resolve()), "train", int(meta["step"]))


def _hf(path: Path) -> Checkpoint:
    match = _STEP_NAME.search(path.name)
    return Checkpoint(f"hf/{path.name}", str(path.resolve()), "hf", int(match.group(1)) if match else None)


def _by_path(path: Path, selector: str) -> Checkpoint:
    if (path / "meta.json").is_file():
        return _train(path)
    if (path / "config.json").is_file():
        return _hf(path)
    raise ValueError(f"checkpoint {selector!r} ({path}) is neither a complete training checkpoint (meta.json) "
                     "nor an HF directory (config.json): allowed are all, latest, best, hf, a step number, a "
                     "checkpoint name or a directory")


def generated_fields(rollout: Any, decode: Any) -> dict[str, Any]:
    """What a record shows of the sample: the text; for an agent episode also its number of model
    turns, how it ended and the numbers its environment reported (`info`)."""
    from megatron_rl.rollout.multiturn import Episode

    out: dict[str, Any] = {"response": decode(rollout.output_ids)}
    if isinstance(rollout, Episode):
        out.update(turns=rollout.num_turns, ended=rollout.status,
                   env={k: v for k, v in rollout.info.items() if isinstance(v, (bool, int, float))})
    return out


def one_line(ckpt: Checkpoint, records: list[dict[str, Any]], spec: EvalSpec, seconds: float) -> str:
    from megatron_rl.evaluation.records import eval_metrics
    from megatron_rl.evaluation.stats import group_by, t_interval

    parts = [f"{ckpt.name}" + (f" (step {ckpt.step})" if ckpt.step is not None else "")]
    for set_name, rows in group_by(records, lambda r: r["set"]).items():
        per_seed = [eval_metrics(seed_rows, spec.ks) for seed_rows in group_by(rows, lambda r: r["seed"]).values()]
        shown = []
        for name in ["accuracy", *(f"pass@{k}" for k in spec.ks)]:
            ci = t_interval([m[name] for m in per_seed], spec.confidence)
            shown.append(f"{name} {ci.mean:.3f}" + ("" if ci.n < 2 else f" ±{(ci.high - ci.low) / 2:.3f}"))
        parts.append(f"{set_name}: " + ", ".join(shown))
    return " | ".join(parts) + f" | {len(records)} samples, {spec.num_seeds} seeds, {seconds:.0f}s"


def load_checkpoint(trainer, ckpt: Checkpoint) -> None:
    """The checkpoint's weights into the trainer (of a training checkpoint only the model: evaluation
    never steps the optimizer, and so any layout can read it, another expert-parallel size included)."""
    if ckpt.kind == "train":
        from megatron_rl.checkpoint.training import load_weights

        load_weights(trainer, Path(ckpt.path))
    else:
        trainer.load_hf(ckpt.path)


def regression_sets(given: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """(set name, spec) of each `--regression [NAME=]SPEC`, checked before any work (raises
    ConfigError): SPEC a file or a task config (`regression_task_config`). One set without a NAME
    is called `regression`; with several, each is named by NAME, else by its task's name
    (task=arithmetic,...: arithmetic) or file name without suffix; names must differ and not be heldout."""
    from megatron_rl.config import ConfigError

    out: list[tuple[str, str]] = []
    for item in given:
        name, named, spec = item.partition("=")
        if not named or not _SET_NAME.fullmatch(name) or name == "task":  # no NAME: the whole item is the spec
            name, spec = "", item
        task = regression_task_config(spec)
        if task is None and not Path(spec).exists():
            raise ConfigError(f"--regression {item}: no such file (a task config is task=NAME,...)")
        if not name and len(given) > 1:
            name = task.name if task is not None else Path(spec).name.split(".")[0]
        out.append((name or REGRESSION, spec))
    names = [name for name, _ in out]
    clash = next((n for n in names if names.count(n) > 1 or n == HELD_OUT), None)
    if clash:
        raise ConfigError(f"--regression: two sets would be called {clash!r} (or it is the held-out set's name): "
                          "name them, --regression NAME=SPEC")
    return tuple(out)


def regression_task_config(spec: str) -> Optional[Any]:
    """The TaskConfig of a regression set given as a task config, `task=NAME[,key=value...]`
    (conf/task/NAME.yaml with those fields changed, e.g. `task=arithmetic,num_eval=200,seed=7`); None
    when `spec` is a file. Raises ConfigError naming the problem."""
    from megatron_rl.config import ConfigError, compose, to_typed

    if not spec.startswith("task="):
        return None
    items = [item.strip() for item in spec.split(",") if item.strip()]
    bad = [item for item in items if "=" not in item]
    if bad:
        raise ConfigError(f"--regression {spec}: {bad[0]!r} is not key=value (the form is task=NAME,key=value,...)")
    name = items[0].split("=", 1)[1]
    try:
        cfg = to_typed(compose([f"task={name}", *(f"task.{item}" for item in items[1:])]))
    except ConfigError as exc:
        raise ConfigError(f"--regression {spec}: {exc}") from None
    if cfg.task.num_eval == 0:
        raise ConfigError(f"--regression {spec}: task.num_eval=0 gives no prompts; set num_eval=N")
    return cfg.task
