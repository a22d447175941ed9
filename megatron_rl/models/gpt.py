"""Build the Megatron GPT model for the Llama / Qwen2 / Qwen3 dense and Qwen3-MoE / Mixtral / Qwen2-MoE /
GLM-4.5 MoE / DeepSeek-V2 / DeepSeek-V3 / gpt-oss families.

One architecture description (`ModelConfig`: RMSNorm, SwiGLU, RoPE theta and Llama 3.1 scaling,
GQA, Qwen2 QKV bias, Llama and Qwen3 attention (and Llama MLP) biases, Qwen3 QK-norm, tied or untied
embeddings, optionally a mixture of SwiGLU experts, with Qwen2-MoE's gated shared expert; or DeepSeek's
multi-latent attention with YaRN; or gpt-oss's attention sinks, sliding windows, biases and clamped SwiGLU
experts)
becomes a Megatron `TransformerConfig` (`MLATransformerConfig`) and a `GPTModel` stage for this
rank's pipeline position. The local layer spec is used on CPU; the Transformer Engine spec when TE
is importable and the device is a GPU (`uses_te`).
Conversion to and from Hugging Face layouts lives in `megatron_rl.families`.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

from megatron_rl.models import packed_rope
from megatron_rl.parallel.state import ParallelGroups

logger = logging.getLogger(__name__)
Tensor = torch.Tensor

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def transformer_config(model_cfg: Any, groups: ParallelGroups, *, deterministic: bool = False):
    """Megatron `TransformerConfig` for this architecture and parallel layout."""
    from megatron.core.transformer import TransformerConfig

    on_gpu = groups.device.type != "cpu"
    dtype = torch_dtype(model_cfg.dtype)
    config_class, mla = TransformerConfig, {}
    if model_cfg.multi_latent_attention:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config_class, mla = MLATransformerConfig, _mla_fields(model_cfg)
    config = config_class(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        ffn_hidden_size=model_cfg.ffn_hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_query_groups,
        kv_channels=model_cfg.resolved_head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=model_cfg.norm_eps,
        gated_linear_unit=True,
        activation_func=_activation(model_cfg),
        add_bias_linear=model_cfg.linear_bias,
        add_qkv_bias=model_cfg.resolved_qkv_bias,
        qk_layernorm=model_cfg.resolved_qk_layernorm or model_cfg.multi_latent_attention,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=groups.tp_size,
        pipeline_model_parallel_size=groups.pp_size,
        context_parallel_size=groups.cp_size,
        sequence_parallel=groups.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not on_gpu,
        # Fusions that need CUDA kernels stay off on CPU.
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=on_gpu,
        deterministic_mode=deterministic and on_gpu,
        **_recompute_fields(model_cfg),
        **_moe_fields(model_cfg, groups),
        **mla,
        **_gpt_oss_fields(model_cfg),
    )
    if _gpt_yarn(model_cfg):
        _set_yarn(config, model_cfg)
    return config


def _activation(model_cfg: Any):
    """The gated unit's activation: SiLU (SwiGLU), or gpt-oss's quick_gelu (see `_gpt_oss_fields`)."""
    if model_cfg.family == "gpt_oss":
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        return quick_gelu
    import torch.nn.functional as F

    return F.silu


def _gpt_oss_fields(model_cfg: Any) -> dict[str, Any]:
    """gpt-oss's attention and experts in Megatron-core's terms.

    Sinks: one learned logit per head joins each softmax and takes its share of the probability mass
    (transformers' eager_attention_forward concatenates `sinks` to the scores and drops that column after
    the softmax), Megatron's softmax_type "learnable" (`core_attention.softmax_offset`). Sliding windows:
    transformers lets query i see keys j with i - j < sliding_window, Megatron's window_size (left, 0) keys
    with i - j <= left, so left = sliding_window - 1; window_attn_skip_freq as a list marks the windowed
    layers (transformer/utils.py:is_layer_window_attention, 1 = windowed). Experts: transformers computes
    (clamp(up, -limit, limit) + 1) x g sigmoid(1.702 g) with g = min(gate, limit), which is Megatron's
    gated unit with quick_gelu (x sigmoid(1.702 x)), activation_func_clamp_value = limit and
    glu_linear_offset = 1 (moe/experts.py, mlp.py: glu). The router's logits have a bias and the top k are
    softmaxed (Megatron's softmax router after the top k, `_moe_fields`), every linear layer has a bias
    (add_bias_linear), expert outputs with theirs are weighted by the routing probabilities on both sides."""
    if model_cfg.family != "gpt_oss":
        return {}
    windowed = set(model_cfg.sliding_window_layers)
    window = dict(window_size=(model_cfg.sliding_window - 1, 0),
                  window_attn_skip_freq=[int(i in windowed) for i in range(model_cfg.num_layers)])
    return dict(activation_func_clamp_value=model_cfg.swiglu_limit, glu_linear_offset=1.0,
                softmax_type="learnable", **(window if model_cfg.sliding_window is not None else {}))


def _gpt_yarn(model_cfg: Any) -> bool:
    """Whether GPTModel's own rotary embedding is YaRN (multi-latent attention builds its own)."""
    return model_cfg.yarn and model_cfg.rope_scaling_factor is not None and not model_cfg.multi_latent_attention


def _set_yarn(config: Any, model_cfg: Any) -> None:
    """YaRN for GPTModel's rotary embedding (position_embedding_type "yarn"): Megatron-core reads its
    parameters as `yarn_*` attributes of the config, which TransformerConfig does not declare
    (models/gpt/gpt_model.py:172-190; transformer/attention.py applies the cos/sin factor from them,
    yarn_rotary_pos_embedding.py:_yarn_get_concentration_factor_from_config). HF's truncate is
    correction_range_round_to_int."""
    config.yarn_rotary_scaling_factor = model_cfg.rope_scaling_factor
    config.yarn_original_max_position_embeddings = model_cfg.rope_scaling_original_max_position_embeddings
    config.yarn_beta_fast = model_cfg.rope_scaling_beta_fast
    config.yarn_beta_slow = model_cfg.rope_scaling_beta_slow
    config.yarn_mscale = model_cfg.rope_scaling_mscale
    config.yarn_mscale_all_dim = model_cfg.rope_scaling_mscale_all_dim
    config.yarn_correction_range_round_to_int = model_cfg.rope_scaling_truncate


def _mla_fields(model_cfg: Any) -> dict[str, Any]:
    """MLATransformerConfig's fields: the latent and head widths, and RoPE (YaRN when scaled).

    Megatron's names differ from HF's: qk_head_dim is HF's qk_nope_head_dim, qk_pos_emb_head_dim its
    qk_rope_head_dim. DeepSeek checkpoints store the rotated dimensions interleaved in pairs; Megatron's
    RoPE for multi-latent attention de-interleaves them (rope_utils._apply_rotary_pos_emb_bshd), as
    transformers' apply_rotary_pos_emb_interleave does, so weights map one to one. `qk_layernorm` builds
    the latent norms (q_layernorm, kv_layernorm: HF q_a_layernorm, kv_a_layernorm).
    """
    yarn = model_cfg.rope_scaling_factor is not None
    return dict(
        q_lora_rank=model_cfg.q_lora_rank, kv_lora_rank=model_cfg.kv_lora_rank,
        qk_head_dim=model_cfg.qk_nope_head_dim, qk_pos_emb_head_dim=model_cfg.qk_rope_head_dim,
        v_head_dim=model_cfg.v_head_dim, rotary_base=model_cfg.rope_theta, rope_type="yarn" if yarn else "rope",
        # with rope_type "rope" Megatron still reads these two for the softmax scale: mscale_all_dim 0 leaves it
        rotary_scaling_factor=model_cfg.rope_scaling_factor or 1.0,
        original_max_position_embeddings=model_cfg.rope_scaling_original_max_position_embeddings,
        beta_fast=model_cfg.rope_scaling_beta_fast, beta_slow=model_cfg.rope_scaling_beta_slow,
        mscale=model_cfg.rope_scaling_mscale, mscale_all_dim=model_cfg.rope_scaling_mscale_all_dim,
    )


def _recompute_fields(model_cfg: Any) -> dict[str, Any]:
    """TransformerConfig's activation-recomputation fields for `model.recompute`."""
    mode = getattr(model_cfg, "recompute", "none")
    if mode == "none":
        return {}
    if mode == "selective":
        return {"recompute_granularity": "selective"}
    return {"recompute_granularity": "full", "recompute_method": "uniform",
            "recompute_num_layers": model_cfg.recompute_num_layers}


def _moe_fields(model_cfg: Any, groups: ParallelGroups) -> dict[str, Any]:
    """TransformerConfig's mixture-of-experts fields (none for a dense model).

    HF's Qwen3-MoE router takes a softmax over all experts, keeps the top k and renormalises
    them when `norm_topk_prob` (Mixtral's always does): Megatron's softmax score function over
    the top-k logits (`moe_router_pre_softmax=False`) is the same distribution; without
    renormalisation it is the softmax over all experts, then top k (`moe_router_pre_softmax=True`).
    Qwen2-MoE's shared expert is Megatron's `SharedExpertMLP`; its gate, sigmoid(x @ gate_weight.T)
    times the shared output, is `moe_shared_expert_gate` (transformer/moe/shared_experts.py:55-61, 125-131).

    GLM-4.5's router scores experts with a sigmoid, chooses them by score + a per-expert bias (from the
    top groups when there are groups), weighs them by their unbiased scores renormalised and scaled:
    Megatron's sigmoid score function with `moe_router_enable_expert_bias`, `moe_router_num_groups` /
    `moe_router_group_topk` and `moe_router_topk_scaling_factor` (moe_utils.py: topk_routing_with_score_function,
    group_limited_topk); its shared experts have no gate. DeepSeek-V3 routes the same way; DeepSeek-V2 takes
    the softmax over all experts, keeps the top k as they are and scales them (`moe_router_pre_softmax` with
    the scaling factor; groups ranked by their best expert, which ModelConfig enforces).
    """
    if not model_cfg.is_moe:
        return {}
    on_gpu = groups.device.type != "cpu"
    sigmoid = model_cfg.spec.router == "sigmoid"
    grouped = model_cfg.moe_router_num_groups > 1
    return dict(
        num_moe_experts=model_cfg.num_experts,
        moe_ffn_hidden_size=model_cfg.moe_ffn_hidden_size,
        moe_router_topk=model_cfg.moe_router_topk,
        moe_router_score_function="sigmoid" if sigmoid else "softmax",
        moe_router_enable_expert_bias=sigmoid,
        # Auxiliary-loss-free balancing (0: the checkpoint's bias stays); the trainer passes its padding as
        # padding_mask, so that only real tokens count in the expert loads (and in the load-balancing loss).
        moe_router_bias_update_rate=model_cfg.moe_router_bias_update_rate,
        moe_router_num_groups=model_cfg.moe_router_num_groups if grouped else None,
        moe_router_group_topk=model_cfg.moe_router_group_topk if grouped else None,
        moe_router_topk_scaling_factor=(model_cfg.moe_routed_scaling_factor
                                        if model_cfg.spec.grouped_router else None),
        moe_router_pre_softmax=not model_cfg.moe_norm_topk_prob and not sigmoid,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=model_cfg.moe_aux_loss_coeff,
        moe_router_dtype="fp32",
        moe_grouped_gemm=False,
        # The all-to-all dispatcher synchronises through CUDA streams and events
        # (token_dispatcher.py:445, 871-895); the all-gather one is plain collectives.
        moe_token_dispatcher_type="alltoall" if on_gpu else "allgather",
        expert_model_parallel_size=groups.ep_size,
        expert_tensor_parallel_size=groups.etp_size,
        moe_shared_expert_intermediate_size=model_cfg.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=model_cfg.family == "qwen2_moe",
        # Dense layers among the sparse ones: the layer specs come from `decoder_spec`; the list also makes
        # the block's sharded state dict per layer (transformer_block.py:830-834), as mixed layers need.
        # An all-sparse model keeps the default 1, so its training checkpoints keep their layout.
        moe_layer_freq=model_cfg.moe_layer_pattern if model_cfg.moe_dense_layers else 1,
    )


def uses_packed_attention(model_cfg: Any, use_te: bool, cp_size: int) -> bool:
    """Whether the local spec's core attention is `local_attention.PackedAttention` (and the trainer passes
    THD rows): runs without TE or context parallelism whose attention is plain (no multi-latent attention,
    no sinks)."""
    return not use_te and cp_size == 1 and not (model_cfg.multi_latent_attention or model_cfg.attention_sinks)


def layer_spec(model_cfg: Any, use_te: bool, cp_size: int = 1, sparse: bool = True):
    """Megatron's TE layer spec, or its local spec (with the all-gather context-parallel
    attention of `local_attention` in place of the local attention when cp_size > 1, its masked
    attention under multi-latent attention, whose key and value widths differ, or attention sinks,
    and its packed attention otherwise); with experts (a mixture-of-experts model's sparse layer)
    or a dense MLP."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    # moe_grouped_gemm=False: SequentialMLP, one MLP module per local expert (no TE grouped GEMM on CPU).
    moe = dict(num_experts=model_cfg.num_experts if sparse else None, moe_grouped_gemm=False)
    mla = model_cfg.multi_latent_attention
    attention = dict(qk_layernorm=model_cfg.resolved_qk_layernorm or mla, multi_latent_attention=mla)
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(**attention, **moe)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", **attention, **moe)
    if cp_size > 1:
        from megatron_rl.models.local_attention import AllGatherContextAttention

        spec.submodules.self_attention.submodules.core_attention = AllGatherContextAttention
    elif mla or model_cfg.attention_sinks:
        from megatron_rl.models.local_attention import MaskedAttention

        spec.submodules.self_attention.submodules.core_attention = MaskedAttention
    elif uses_packed_attention(model_cfg, use_te, cp_size):  # packed rows attend within each sample only
        from megatron_rl.models.local_attention import PackedAttention

        spec.submodules.self_attention.submodules.core_attention = PackedAttention
    if mla:
        _replicated_mla_down_projections(spec.submodules.self_attention.submodules)
        _latent_norms_at_fixed_eps(spec.submodules.self_attention.submodules, model_cfg, use_te)
    _biases_of_their_own(spec, model_cfg, sparse)
    return spec


MLA_LATENT_NORM_EPS = 1e-6


def _latent_norms_at_fixed_eps(attention: Any, model_cfg: Any, use_te: bool) -> None:
    """Multi-latent attention's latent norms (HF q_a_layernorm, kv_a_layernorm) with transformers' epsilon,
    1e-6 whatever rms_norm_eps says (modeling_deepseek_v3.py: DeepseekV3RMSNorm(config.kv_lora_rank), as in
    DeepSeek's and Moonlight's own code), where Megatron-core gives them layernorm_epsilon
    (multi_latent_attention.py:498-510; TE's spec fuses them into the up projections, which read it from their
    config). Only Moonlight (rms_norm_eps 1e-5) among the shipped models needs it."""
    if model_cfg.norm_eps == MLA_LATENT_NORM_EPS:
        return
    names = ("linear_q_up_proj", "linear_kv_up_proj") if use_te else ("q_layernorm", "kv_layernorm")
    for name in names:
        setattr(attention, name, _with_norm_eps(getattr(attention, name), MLA_LATENT_NORM_EPS))


def _with_norm_eps(module: type, eps: float) -> type:
    """A subclass of `module` (a norm, or a linear with its input norm fused) built with norm epsilon `eps`: the
    `eps` argument and the config's layernorm_epsilon replaced. (Megatron's WrappedTorchNorm builds in __new__.)"""
    import copy

    def with_eps(kwargs: dict[str, Any]) -> dict[str, Any]:
        if "eps" in kwargs:
            kwargs["eps"] = eps
        if "config" in kwargs:
            kwargs["config"] = copy.copy(kwargs["config"])
            kwargs["config"].layernorm_epsilon = eps
        return kwargs

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        if module.__new__ is object.__new__:
            return object.__new__(cls)
        return module.__new__(cls, *args, **with_eps(kwargs))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        module.__init__(self, *args, **with_eps(kwargs))

    return type(f"{module.__name__}Eps", (module,), {"__new__": __new__, "__init__": __init__})


def _biases_of_their_own(spec: Any, model_cfg: Any, sparse: bool) -> None:
    """The attention output's and the dense MLP's biases one by one, as HF Llama and Qwen3 have them (attention_bias:
    q, k, v and o_proj; mlp_bias: gate, up and down_proj). Megatron-core gives linear_proj and the MLP's linear_fc1
    and linear_fc2 a bias all together or not at all (TransformerConfig.add_bias_linear: attention.py:355,
    mlp.py:128, 147; Q, K and V have add_qkv_bias of their own), so these layers are built from subclasses that
    always take one; nothing else about them changes (gpt-oss, biased everywhere, keeps add_bias_linear)."""
    if model_cfg.linear_bias:
        return
    if model_cfg.attention_output_bias:
        attention = spec.submodules.self_attention.submodules
        attention.linear_proj = _biased(attention.linear_proj)
    if model_cfg.mlp_bias and not (model_cfg.is_moe and sparse):
        mlp = spec.submodules.mlp.submodules
        mlp.linear_fc1, mlp.linear_fc2 = _biased(mlp.linear_fc1), _biased(mlp.linear_fc2)


_BIASED: dict[type, type] = {}


def _biased(linear: type) -> type:
    """A subclass of the Megatron linear layer `linear` built with a bias whatever it is asked for."""
    if linear not in _BIASED:
        def __init__(self, *args: Any, bias: bool = False, **kwargs: Any) -> None:
            linear.__init__(self, *args, bias=True, **kwargs)

        _BIASED[linear] = type(f"Biased{linear.__name__}", (linear,), {"__init__": __init__})
    return _BIASED[linear]


def _replicated_mla_down_projections(attention: Any) -> None:
    """The local spec's multi-latent attention with its down projections replicated on every TP rank,
    as in the TE spec (TELinear, parallel_mode "duplicated"), instead of column-parallel.

    Column-parallel down projections give wrong gradients at TP > 1: the rotary key part of the kv latent
    is all-gathered over the TP ranks (multi_latent_attention.py:608-617), whose backward only keeps each
    rank's slice, but every rank's heads use the whole rotary key, so the contributions of the other ranks'
    heads are lost (the gradient norm of a TP=2 + SP step was 1523.8 instead of 1525.9). Replicated, under
    sequence parallelism (which mixtures of experts need at TP > 1), each rank projects its part of the
    sequence, the rotary key is gathered over the sequence (backward: reduce-scatter, so every head
    counts), and the projections' weights are marked sequence_parallel, so their gradients are summed over
    the TP ranks like the norms'. modelopt's `Linear` is megatron-core's plain replicated linear."""
    from megatron.core.post_training.modelopt.layers import Linear

    attention.linear_q_down_proj = Linear
    attention.linear_kv_down_proj = Linear


def decoder_spec(model_cfg: Any, config: Any, use_te: bool, cp_size: int = 1):
    """One layer spec for every layer, or, when a mixture of experts has dense layers
    (`model.moe_dense_layers`), this pipeline stage's layer specs one by one (the block's final
    norm as Megatron picks it for a single layer spec: transformer_block.py:255-259)."""
    if not model_cfg.moe_dense_layers:
        return layer_spec(model_cfg, use_te, cp_size)
    from megatron.core.transformer.transformer_block import (
        LayerNormImpl,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    specs = {sparse: layer_spec(model_cfg, use_te, cp_size, sparse) for sparse in (False, True)}
    offset, count = get_transformer_layer_offset(config), get_num_layers_to_build(config)
    return TransformerBlockSubmodules(
        layer_specs=[specs[model_cfg.is_sparse_layer(i)] for i in range(offset, offset + count)],
        layer_norm=LayerNormImpl)


def te_sink_attention_problem(te_version: str, cudnn_version: int, head_dim: int) -> Optional[str]:
    """Why Transformer Engine cannot train attention with learned sinks over the trainer's packed THD rows, or
    None. Before TE 2.12 its backend selection turns every backend off for sinks in THD layout; its fused
    attention runs them there from cuDNN 9.18 (NVIDIA/TransformerEngine#2483, #2568), and before cuDNN 9.26 the
    sinks' backward misreads its inputs for value head widths other than 64, 128 and 256 (#3249, #3470:
    public reports, not reproduced here; gpt-oss's heads are 64 wide)."""
    from packaging.version import Version

    if Version(te_version).release < (2, 12):  # release: a 2.12 pre-release or source build counts as 2.12
        return (f"Transformer Engine {te_version} has no attention backend for sinks over packed (THD) rows; "
                "it needs Transformer Engine >= 2.12 with cuDNN >= 9.18")
    if cudnn_version < 91800:
        return (f"cuDNN {cudnn_version} cannot run attention sinks over packed (THD) rows in Transformer Engine's "
                "fused attention; it needs cuDNN >= 9.18 (91800)")
    if head_dim not in (64, 128, 256) and cudnn_version < 92600:
        return (f"cuDNN {cudnn_version} computes the sinks' gradient wrongly over packed rows for heads "
                f"{head_dim} wide (only 64, 128 and 256 are right before cuDNN 9.26, 92600)")
    return None


def uses_te(groups: ParallelGroups, model_cfg: Any) -> bool:
    """Whether `build_model` builds on the Transformer Engine spec: model.transformer_impl=transformer_engine,
    or auto on a GPU where TE is importable (auto on a GPU without it is refused by `build_model`)."""
    impl = model_cfg.transformer_impl
    if impl == "local":
        return False
    return impl == "transformer_engine" or (groups.device.type != "cpu" and te_available())


def build_model(model_cfg: Any, groups: ParallelGroups, *, deterministic: bool = False,
                use_te: bool | None = None):
    """This rank's pipeline stage of the GPT model, on `groups.device`, with random init.

    Weights are set afterwards from a full state dict (see `megatron_rl.weight_sync.sharding`).
    """
    from megatron.core.models.gpt import GPTModel

    impl = model_cfg.transformer_impl
    if use_te is None:
        use_te = uses_te(groups, model_cfg)
    if use_te and not (groups.device.type != "cpu" and te_available()):
        raise RuntimeError(f"model.transformer_impl={impl} needs Transformer Engine on a GPU, but "
                           + ("the device is the CPU" if groups.device.type == "cpu" else
                              "`import transformer_engine` fails: pip install -e '.[gpu]' (docs/install.md)"))
    if groups.device.type != "cpu" and not use_te:
        # The local spec on a GPU runs Megatron-core paths that assume Transformer Engine for some models
        # (ModelConfig.local_spec_gpu_problem): refused rather than left to fail inside Megatron. Otherwise
        # only when asked for, since TE's fused kernels are the GPU path.
        if impl != "local":
            raise RuntimeError("Transformer Engine is required on GPU (the layer spec of megatron_rl's GPU path), "
                               "but `import transformer_engine` fails: pip install -e '.[gpu]' (docs/install.md); "
                               "or, for a dense model, model.transformer_impl=local (Megatron's local spec, slower)")
        problem = model_cfg.local_spec_gpu_problem(groups.sequence_parallel)
        if problem:
            raise RuntimeError(f"model.transformer_impl=local cannot run {problem} on a GPU (Megatron-core's local "
                               "paths for it assume Transformer Engine): install TE (pip install -e '.[gpu]')")
    if use_te and deterministic:
        # Megatron-core's TE attention refuses deterministic_mode unless TE may only pick deterministic
        # algorithms (transformer_engine.py: NVTE_ALLOW_NONDETERMINISTIC_ALGO must be 0); a value the user set
        # stays (Megatron then names it).
        os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    if use_te and model_cfg.attention_sinks:
        import transformer_engine

        problem = te_sink_attention_problem(transformer_engine.__version__, torch.backends.cudnn.version() or 0,
                                            model_cfg.resolved_head_dim)
        if problem:
            raise RuntimeError(f"model.family={model_cfg.family} on the Transformer Engine spec: {problem}")
    config = transformer_config(model_cfg, groups, deterministic=deterministic)
    packed_rope.install()  # packed rows' RoPE in one gather, not a Python loop per sample
    model = GPTModel(
        config=config,
        transformer_layer_spec=decoder_spec(model_cfg, config, use_te, groups.cp_size),
        vocab_size=model_cfg.vocab_size,
        max_sequence_length=model_cfg.max_position_embeddings,
        pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage,
        parallel_output=True,  # logits stay vocab-parallel: never gathered to the full vocabulary
        share_embeddings_and_output_weights=model_cfg.tie_word_embeddings,
        position_embedding_type="yarn" if _gpt_yarn(model_cfg) else "rope",
        rotary_base=model_cfg.rope_theta,  # a float: a fractional theta must not be truncated
        # Llama 3.1 scaling; its other parameters are Megatron's fixed ones, which ModelConfig enforces.
        # (multi-latent attention builds its own RoPE, YaRN-scaled or not: `_mla_fields`; gpt-oss's YaRN:
        # `_set_yarn`)
        rope_scaling=model_cfg.rope_scaling_factor is not None and not model_cfg.yarn,
        rope_scaling_factor=model_cfg.rope_scaling_factor or 8.0,
        rotary_percent=model_cfg.rotary_percent,
    )
    _mark_sinks_tensor_parallel(model)
    _expert_outputs_of_their_own(model)
    _routers_without_padding(model)
    if groups.etp_size != groups.tp_size:
        _experts_reduced_over_expert_data_parallel(model)
    if not use_te:
        _norms_in_model_dtype(model, torch_dtype(model_cfg.dtype))
    return model.to(groups.device)


def _norms_in_model_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The local spec's norms (Megatron's WrappedTorchNorm: torch.nn.RMSNorm / LayerNorm) are built in fp32
    whatever params_dtype is (Megatron-LM casts them with its Float16Module wrapper, which this project does
    not use); TE's norms and transformers' take the model's dtype. A bf16 model's fp32 norm weights made
    torch fall back from its fused RMSNorm kernel on the GPU ("Mismatch dtype between input and weight")."""
    for module in model.modules():
        if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            module.to(dtype)


def _experts_reduced_over_expert_data_parallel(model: torch.nn.Module) -> None:
    """Works around a Megatron-core bug that loses expert gradients when the expert tensor-parallel size
    differs from the tensor-parallel size without expert parallelism (e.g. gpt-oss at TP=2, etp=1, EP=1).

    Each TP rank then runs whole experts on its own tokens (the dispatcher's TP x EP group has one rank),
    so an expert's gradient is the sum over the TP ranks, which DDP forms for parameters tagged
    `allreduce=False` (reduced over the expert data-parallel group, distributed_data_parallel.py:122).
    Megatron-core tags experts so only when EP > 1 (tensor_parallel/layers.py:886, 1209); untagged, they
    were reduced over the dense data-parallel group only, each TP rank stepped with its own half of the
    gradient (an Adam step off by 2 x lr at TP=2 + SP before this). Tagging also puts them in the expert
    optimizer, whose gradient norm counts them once per expert-model-parallel group. Under sequence
    parallelism Megatron-core also marks the experts' output biases `sequence_parallel`, which
    finalize_model_grads sums over the TP ranks once more (finalize_model_grads.py:_allreduce_non_tensor_
    model_parallel_grads): their gradient is complete after the expert data-parallel reduction, so the mark
    is taken off (the gradient norm read 5.577 instead of 5.160 with it). And the expert optimizer counts a
    parameter in its gradient norm when it is tagged tensor-parallel or this rank is the first of its dense
    TP group (optimizer/__init__.py:468-473 gives it that group), so each TP rank's norm left out or kept the
    untagged output biases: the ranks clipped by different factors and their copies of every replicated
    weight drifted apart (by ~3e-6 per step); tagged, every rank counts its whole experts, once, as its
    expert-model-parallel group (of one) requires."""
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False
            param.sequence_parallel = False
            if not getattr(param, "tensor_model_parallel", False):
                param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1


def _routers_without_padding(model: torch.nn.Module) -> None:
    """Works around two Megatron-core 0.16 bugs of the routers' padding mask (which the trainer passes so that
    padding does not count in the expert loads and the load-balancing loss).

    The expert loads behind the auxiliary-loss-free bias update drop the padded tokens with
    `routing_map & ~padding_mask`, a [tokens, experts] map against a [tokens] mask (moe/router.py:542, after
    routing() flattened the mask at :564), which broadcasts over the experts and fails (or, with as many tokens
    as experts, masks the wrong entries): each router with a selection bias counts with the mask over the tokens.

    The load-balancing loss divides by the number of real tokens in the row over the TP x CP ranks
    (moe_utils.py:222-231, 128-131): zero on the rows without samples that expert parallelism adds for equal
    shapes, so the loss and every router gradient became NaN. That count is taken as at least 1: the padded
    tokens' scores are zeroed (compute_routing_scores_for_aux_loss), so such a row adds a loss of 0."""
    import types

    from megatron.core.transformer.moe.moe_utils import (
        get_tokens_per_expert_and_token_count,
        switch_load_balancing_loss_func,
    )
    from megatron.core.transformer.moe.router import TopKRouter

    def apply_expert_bias(router: Any, routing_map: Tensor, padding_mask: Optional[Tensor] = None) -> None:
        if router.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                router.local_tokens_per_expert += routing_map.sum(dim=0)

    def apply_aux_loss(router: Any, probs: Tensor, scores_for_aux_loss: Tensor, routing_map: Tensor,
                       with_padding_mask: bool = False) -> Tensor:
        coeff = router.get_aux_loss_coeff("aux_loss")
        if coeff == 0:
            return probs
        tokens_per_expert, local_tokens, total_tokens = get_tokens_per_expert_and_token_count(
            routing_map=routing_map, reduce_group=router.tp_cp_group, topk=router.topk,
            with_padding_mask=with_padding_mask)
        if with_padding_mask:
            total_tokens = total_tokens.clamp(min=1)
        aux_loss = switch_load_balancing_loss_func(
            probs=scores_for_aux_loss, tokens_per_expert=tokens_per_expert, total_num_tokens=total_tokens,
            topk=router.topk, num_experts=router.config.num_moe_experts, moe_aux_loss_coeff=coeff,
            fused=router.config.moe_router_fusion)
        return router.attach_and_log_load_balancing_loss(probs, coeff, aux_loss, "load_balancing_loss",
                                                         router.tp_cp_group, valid_token_count=local_tokens)

    for module in model.modules():
        if isinstance(module, TopKRouter):
            module._apply_aux_loss = types.MethodType(apply_aux_loss, module)
            if module.enable_expert_bias:
                module._apply_expert_bias = types.MethodType(apply_expert_bias, module)


def _expert_outputs_of_their_own(model: torch.nn.Module) -> None:
    """Works around a Megatron-core bug that stops biased experts (gpt-oss) from training.

    An expert MLP adds its output bias, weighted by the routing probability, in place onto its down
    projection's output (transformer/mlp.py:244-248). That output is a view made inside an autograd function
    wherever the projection returns its input as it is: the local spec's `RowParallelLinear` without expert
    communication (EP 1 and expert TP 1) returns the reduction over a group of one
    (tensor_parallel/layers.py:1286-1296, mappings.py:27), TE's linear a reshaped view of its GEMM output;
    autograd refuses the in-place add there ("Output 0 of _ReduceFromModelParallelRegion is a view and is being
    modified inplace"). A forward hook on each biased expert's down projection hands the MLP a copy instead
    whenever the output is such a view (the same values; one copy of the expert's output)."""
    def own_output(module: torch.nn.Module, args: Any, output: Any) -> Any:
        out, bias = output
        return (out.clone() if out._base is not None else out), bias

    if not model.config.add_bias_linear:
        return
    for name, module in model.named_modules():
        if ".mlp.experts." in name and name.endswith("linear_fc2") and getattr(module, "bias", None) is not None:
            module.register_forward_hook(own_output)


def _mark_sinks_tensor_parallel(model: torch.nn.Module) -> None:
    """Attention sinks (`core_attention.softmax_offset`, one per head) are split over the TP ranks with the
    heads, but neither Megatron-core's attentions nor TE's tag them as tensor-parallel: tagged, weight loading
    and gathering split them like the heads (`weight_sync.sharding`), and the gradient norm counts every
    rank's part (Megatron counts an untagged parameter on TP rank 0 only)."""
    for name, param in model.named_parameters():
        if name.endswith("core_attention.softmax_offset"):
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
