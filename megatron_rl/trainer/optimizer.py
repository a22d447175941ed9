"""The trainer's optimizer and learning-rate schedule: Megatron-core's, from `optimizer.*`."""

from __future__ import annotations

from typing import Any

import torch


def build_optimizer(model: torch.nn.Module, optim_cfg: Any, options: Any):
    """Megatron's optimizer over `model` and its scheduler (`options`: the trainer's TrainerOptions)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    dtype = model.module.config.params_dtype
    config = OptimizerConfig(
        optimizer=optim_cfg.name,
        lr=optim_cfg.lr,
        min_lr=optim_cfg.min_lr,
        weight_decay=optim_cfg.weight_decay,
        adam_beta1=optim_cfg.adam_beta1,
        adam_beta2=optim_cfg.adam_beta2,
        adam_eps=optim_cfg.adam_eps,
        clip_grad=optim_cfg.clip_grad,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=options.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, [model])
    decay_steps = optim_cfg.lr_decay_steps or options.total_steps
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim_cfg.lr_warmup_steps > 0 else optim_cfg.lr,
        max_lr=optim_cfg.lr,
        min_lr=optim_cfg.min_lr,
        lr_warmup_steps=optim_cfg.lr_warmup_steps,
        lr_decay_steps=max(decay_steps, optim_cfg.lr_warmup_steps + 1),
        lr_decay_style=optim_cfg.lr_decay_style,
        start_wd=optim_cfg.weight_decay,
        end_wd=optim_cfg.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
        # a resumed run follows its own config (e.g. num_steps extended), not the checkpoint's schedule;
        # checkpoint.training.load_checkpoint warns about what changed
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True,
    )
    # Megatron's schedule gives lr(0) = init_lr (0 with warmup): a wasted first step. Step k
    # (0-based) trains with lr(k + 1) instead, so warmup reaches max_lr at step warmup - 1.
    scheduler.step(increment=1)
    return optimizer, scheduler
