"""The parallel layout: tp, pp, cp, ep and etp against the world size, the model's shapes and Megatron-core's
conditions; the batch against the data-parallel size; the rollout engines' tp against the world size."""

from __future__ import annotations

from megatron_rl.checks import ConfigError, divisors_str


def check_layout(cfg, world_size: int) -> None:
    """The parallel layout against the world size and the model's shapes (Megatron-core's own conditions),
    the batch against the data-parallel size, the rollout engines' tp against the world size."""
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
            f"valid parallel.pp values divide {model.num_layers} ({divisors_str(model.num_layers)})"
        )
    _check_experts(cfg, world_size)
    dp = par.dp_size(world_size)
    if cfg.global_batch_size % dp != 0:
        raise ConfigError(
            f"global_batch_size={cfg.global_batch_size} is not divisible by the data-parallel size {dp} "
            f"(world_size={world_size} / (tp*pp*cp={par.model_parallel_size})): use a multiple of {dp}"
        )
    if world_size % cfg.rollout.tp != 0:
        raise ConfigError(
            f"rollout.tp={cfg.rollout.tp} does not divide world_size={world_size}: "
            f"valid rollout.tp values are {divisors_str(world_size)}"
        )


def _check_experts(cfg, world_size: int) -> None:
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
            f"valid parallel.ep values divide {model.num_experts} ({divisors_str(model.num_experts)})"
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


def _valid_tp_values(cfg, world_size: int) -> list[int]:
    model, par = cfg.model, cfg.parallel
    return [
        tp
        for tp in range(1, world_size + 1)
        if world_size % (tp * par.pp * par.cp) == 0
        and model.num_attention_heads % tp == 0
        and model.num_query_groups % tp == 0
        and model.vocab_size % tp == 0
    ]
