"""The one checking pass of a typed config, before any process group, model or file exists.

`validate(cfg, world_size)` runs the areas in order: the parallel layout (`layout.py`), the model against where it
runs (`model.py`), the run's cross-group settings for its mode (`run.py`), then the files it reads (`paths.py`,
last because it opens them) and a distillation teacher's settings and files (`distill.py`). A single group's
fields are checked when the config is typed (each dataclass's `__post_init__` in config/<area>.py, with the same
wording from megatron_rl/checks.py), which `load_config` does just before. Every check raises `ConfigError`
(megatron_rl/checks.py) with a one-line message naming the key, the value, what is allowed and the fix. Nothing
here imports torch, except to read a checkpoint's files (model.path, algorithm.distill.teacher).
"""

from __future__ import annotations

from megatron_rl.checks import ConfigError
from megatron_rl.config.checks.distill import check_distill
from megatron_rl.config.checks.layout import check_layout
from megatron_rl.config.checks.model import check_model
from megatron_rl.config.checks.paths import check_paths
from megatron_rl.config.checks.run import check_run


def validate(cfg, world_size: int) -> None:
    """Every cross-group check of `cfg` for a job of `world_size` training ranks; raises ConfigError."""
    if world_size < 1:
        raise ConfigError(f"world_size={world_size} is invalid: must be >= 1")
    check_layout(cfg, world_size)
    check_model(cfg)
    check_run(cfg)
    check_paths(cfg)
    check_distill(cfg)  # after the student's files: the teacher's tokenizer is compared with model.tokenizer


# A learning rate above this fine-tunes a pretrained model into noise within a few steps (RL post-training
# uses ~1e-6; SFT 1e-5 at most); the tiny models built from config train from random init at 1e-3.
PRETRAINED_LR_LIMIT = 1e-4


def config_warnings(cfg) -> list[str]:
    """Settings that run but are very likely a mistake; the entry points print them before any work."""
    out = []
    if cfg.model.path is not None:
        rates = [("optimizer.lr", cfg.optimizer.lr)]
        if cfg.task.sft_warmup_steps:
            rates.append(("task.sft_warmup_lr", cfg.task.sft_warmup_lr))
        out += [f"{key}={value:g} with a pretrained model (model.path={cfg.model.path}): a learning rate above "
                f"{PRETRAINED_LR_LIMIT:g} wrecks a pretrained model in a few steps; RL post-training uses about 1e-6"
                for key, value in rates if value > PRETRAINED_LR_LIMIT]
    return out
