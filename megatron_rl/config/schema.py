"""Typed configuration schema: one dataclass per config group, registered in Hydra's ConfigStore.

Each dataclass checks its own fields in ``__post_init__`` (ranges, allowed values, checks
between fields of the same group) and raises ``ValueError`` with a one-line message that
names the full key (``parallel.tp``), the bad value, what is allowed and how to fix it.
Checks that span groups or need the world size live in ``megatron_rl.config.loader.validate``.

Importing this module registers the schemas (``base_config`` and ``<group>/base_<group>``)
so that the YAML files in ``conf/`` can name them in their defaults lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from megatron_rl.checks import check_choice as _check_choice
from megatron_rl.checks import check_min as _check_min
from megatron_rl.checks import divisors_str as _divisors_str
from megatron_rl.checks import format_value
from megatron_rl.checks import invalid as _invalid
from megatron_rl.families import FAMILIES, FamilySpec, families_where, family_spec

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


@dataclass
class ModelConfig:
    """Decoder-only transformer architecture, or the HF checkpoint to load it from."""

    name: str = "tiny_qwen2"
    """Display name used in logs and run metadata."""
    family: str = "qwen2"
    """Architecture family: llama, qwen2, qwen3, qwen3_moe, mixtral, qwen2_moe, glm4_moe, deepseek_v2,
    deepseek_v3 (DeepSeek-V3 and its architecture's other checkpoints: Kimi-K2, Moonlight) or gpt_oss
    (gpt-oss-20b, -120b); selects the HF <-> Megatron weight converter."""
    path: Optional[str] = None
    """HF checkpoint directory with config.json; null builds the model from the fields below with random init."""
    tokenizer: str = "builtin:char"
    """``builtin:char`` (the shipped character tokenizer) or a path to a HF tokenizer directory."""
    trust_remote_code: bool = False
    """Let a tokenizer directory's own code run (its tokenizer_config.json auto_map, e.g. the TikToken
    tokenizers of Kimi-K2 and Moonlight): it executes Python from that directory, so only for checkpoints
    you trust. False refuses such a tokenizer with a message naming this setting."""
    num_layers: int = 4
    """Number of transformer blocks."""
    hidden_size: int = 128
    """Width of the residual stream."""
    ffn_hidden_size: int = 352
    """Inner width of the SwiGLU MLP (for qwen3_moe and qwen2_moe: HF's intermediate_size, unused by their
    expert layers; for mixtral and gpt_oss, which have no dense MLP: equal to moe_ffn_hidden_size, HF's
    intermediate_size)."""
    num_attention_heads: int = 4
    """Number of query heads."""
    num_query_groups: int = 2
    """Number of key/value heads (grouped-query attention); must divide num_attention_heads."""
    head_dim: Optional[int] = None
    """Per-head width; null means hidden_size // num_attention_heads."""
    vocab_size: int = 128
    """Rows of the embedding table (before any padding for tensor parallelism)."""
    max_position_embeddings: int = 512
    """Longest sequence (prompt + response) the model is built for."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    rope_scaling_factor: Optional[float] = None
    """Llama 3.1 RoPE scaling (HF rope_scaling with rope_type llama3): frequencies whose wavelength exceeds
    rope_scaling_original_max_position_embeddings / rope_scaling_low_freq_factor are divided by this
    factor, those between that and the high-frequency bound interpolated; null means plain RoPE.
    With YaRN (rope_scaling_type): the YaRN factor instead (HF rope_type yarn; see rope_scaling_beta_fast
    and the fields after it)."""
    rope_scaling_type: Optional[str] = None
    """Which scaling rope_scaling_factor is: llama3 or yarn; null: the family's (yarn for deepseek_v2,
    deepseek_v3 and gpt_oss, which have no other; llama3 for the rest). yarn on llama, qwen2, qwen3, mixtral,
    qwen2_moe, qwen3_moe: the long-context scaling Qwen's model cards give (HF rope_scaling
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})."""
    rope_scaling_low_freq_factor: float = 1.0
    """Llama 3.1 RoPE scaling: HF low_freq_factor. Megatron-core fixes it at 1 (see _check_rope_scaling)."""
    rope_scaling_high_freq_factor: float = 4.0
    """Llama 3.1 RoPE scaling: HF high_freq_factor. Megatron-core fixes it at 4."""
    rope_scaling_original_max_position_embeddings: int = 8192
    """Llama 3.1 RoPE scaling: HF original_max_position_embeddings (the pre-training context). Megatron-core
    fixes it at 8192 for Llama 3.1 scaling; YaRN takes any value (DeepSeek-V3, gpt-oss: 4096)."""
    rope_scaling_beta_fast: float = 32.0
    """YaRN: HF beta_fast (frequencies turning more than this often over the
    original context keep their value)."""
    rope_scaling_beta_slow: float = 1.0
    """YaRN: HF beta_slow (frequencies turning less often than this are divided by the factor)."""
    rope_scaling_mscale: float = 1.0
    """YaRN: HF mscale (with mscale_all_dim, the factor on the rotary cos and sin)."""
    rope_scaling_mscale_all_dim: float = 0.0
    """YaRN: HF mscale_all_dim (multi-latent attention multiplies its softmax scale by
    (0.1 x this x ln(factor) + 1) squared; 0: not)."""
    rope_scaling_truncate: bool = True
    """YaRN: HF truncate (round the bounds of the frequencies YaRN ramps between to whole dimensions);
    gpt-oss: false. Megatron-core's multi-latent attention always rounds, so deepseek_v2/_v3 need true."""
    rotary_percent: float = 1.0
    """Share of each head's dimensions that RoPE rotates (the first ones; HF partial_rotary_factor); the
    rest pass through. Only glm4_moe rotates part (its checkpoints: 0.5); 1 for the other families."""
    norm_eps: float = 1e-6
    """Epsilon of the RMSNorm layers."""
    tie_word_embeddings: bool = True
    """Share the input embedding and output projection weights."""
    qkv_bias: Optional[bool] = None
    """Bias on the Q/K/V projections; null means the family default (qwen2, glm4_moe: true, others: false;
    mixtral: never; qwen2_moe, gpt_oss: always; gpt_oss also has biases on the attention output, router and
    experts). llama, qwen3, qwen3_moe: also on the attention output projection (HF attention_bias puts one on
    q_proj, k_proj, v_proj and o_proj alike; see attention_output_bias)."""
    mlp_bias: bool = False
    """llama: bias on the dense MLP's gate, up and down projections (HF mlp_bias); false for the other families,
    whose MLPs have none in transformers."""
    qk_layernorm: Optional[bool] = None
    """RMSNorm on queries and keys per head; null means the family default (qwen3, qwen3_moe: true, others: false;
    mixtral, qwen2_moe, gpt_oss: never)."""
    num_experts: Optional[int] = None
    """Routed experts in every MoE layer (HF num_experts, num_local_experts); null means a dense model.
    Only the mixture-of-experts families (qwen3_moe, mixtral, qwen2_moe, glm4_moe, deepseek_v2, deepseek_v3,
    gpt_oss)."""
    moe_ffn_hidden_size: Optional[int] = None
    """Inner width of each expert's SwiGLU MLP (HF moe_intermediate_size); required with num_experts."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Inner width of the shared expert's SwiGLU MLP, which every token passes through besides its routed
    experts. qwen2_moe (HF shared_expert_intermediate_size; scaled by a sigmoid gate) and glm4_moe (HF
    n_shared_experts x moe_intermediate_size; no gate) require it; null for the others."""
    moe_router_topk: int = 2
    """Experts each token is routed to (HF num_experts_per_tok)."""
    moe_norm_topk_prob: bool = True
    """Renormalise the top-k routing probabilities to sum to 1 (HF norm_topk_prob; mixtral always does;
    qwen2_moe checkpoints usually do not)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of Megatron's per-layer load-balancing loss (aux_loss); 0 disables it."""
    moe_router_num_groups: int = 1
    """glm4_moe, deepseek_v3: experts form this many equal groups (HF n_group) and each token picks its experts
    from the moe_router_group_topk groups whose top-2 selection scores sum highest (HF topk_group); deepseek_v2:
    the groups with the best single expert (topk_method group_limited_greedy); 1: no groups."""
    moe_router_group_topk: int = 1
    """glm4_moe, deepseek_v2, deepseek_v3: groups each token's experts come from (HF topk_group); see
    moe_router_num_groups."""
    moe_routed_scaling_factor: float = 1.0
    """glm4_moe, deepseek_v2, deepseek_v3: factor on the routed experts' weights (HF routed_scaling_factor)."""
    moe_router_bias_update_rate: float = 0.0
    """glm4_moe, deepseek_v3: auxiliary-loss-free load balancing (Megatron's moe_router_bias_update_rate): once
    per training step each expert's selection bias moves by this much, up when the step's real tokens (not
    padding) chose it less often than the experts' mean, down when more often; 0 keeps the checkpoint's bias
    (DeepSeek-V3's pre-training used 0.001)."""
    q_lora_rank: Optional[int] = None
    """deepseek_v2, deepseek_v3 multi-latent attention: width of the compressed query (HF q_lora_rank;
    DeepSeek-V3: 1536); null projects queries directly, without compression (as DeepSeek-V2-Lite and
    Moonlight do)."""
    kv_lora_rank: Optional[int] = None
    """DeepSeek MLA: width of the compressed key-value latent (HF kv_lora_rank; DeepSeek-V3: 512); required."""
    qk_nope_head_dim: Optional[int] = None
    """DeepSeek MLA: per-head query/key dimensions without RoPE (HF qk_nope_head_dim; DeepSeek-V3: 128)."""
    qk_rope_head_dim: Optional[int] = None
    """DeepSeek MLA: per-head query/key dimensions RoPE turns, the key's shared by all heads (HF
    qk_rope_head_dim; DeepSeek-V3: 64)."""
    v_head_dim: Optional[int] = None
    """DeepSeek MLA: per-head value width (HF v_head_dim; DeepSeek-V3: 128)."""
    moe_dense_layers: list[int] = field(default_factory=list)
    """Layers (0-based, global) whose MLP is a dense SwiGLU of width ffn_hidden_size instead of experts:
    HF's mlp_only_layers plus the layers decoder_sparse_step skips (qwen3_moe, qwen2_moe), or the first
    first_k_dense_replace layers (glm4_moe, deepseek_v2, deepseek_v3); a dense layer has no shared expert.
    Empty: every layer is sparse (mixtral always)."""
    sliding_window: Optional[int] = None
    """gpt_oss: attention in the layers of sliding_window_layers sees only the last this many tokens, itself
    included (HF sliding_window; gpt-oss: 128); null: every layer attends to the whole context."""
    sliding_window_layers: list[int] = field(default_factory=list)
    """gpt_oss: layers (0-based, global) with sliding-window attention (HF layer_types "sliding_attention";
    gpt-oss: the even layers); the others attend to everything. Needs sliding_window."""
    swiglu_limit: Optional[float] = None
    """gpt_oss: the experts' clamped SwiGLU (HF swiglu_limit; gpt-oss: 7): out = (clamp(up, -limit, limit)
    + 1) x g sigmoid(1.702 g), g = min(gate, limit); required there, null for the other families."""
    init_seed: int = 1234
    """Seed of the random initialisation when model.path is null."""
    dtype: str = "float32"
    """Parameter and compute dtype: float32 or bfloat16."""
    fused_logprobs: bool = True
    """Log-probs and entropy from the final hidden states and the output weight shard, chunk by
    chunk (megatron_rl_kernels.fused_logprobs), without forming [tokens, vocab] logits; equal to
    the naive path (false: logits from the output layer, then log-softmax) up to summation order."""

    recompute: str = "none"
    """Activation recomputation (Megatron's recompute_granularity): none, selective (recompute the
    core attention in the backward pass: the [heads, seq, seq] activations are not kept) or full
    (recompute whole transformer layers: keeps only each layer's input; see recompute_num_layers)."""
    recompute_num_layers: int = 1
    """recompute=full: layers per recomputed block (Megatron's uniform recompute_method)."""
    transformer_impl: str = "auto"
    """Layer spec (Megatron's --transformer-impl): auto (Transformer Engine's on a GPU, where it is required; the
    local spec on CPU), transformer_engine (required: a GPU and TE), or local (Megatron's local spec and this
    project's core attention on any device: on a GPU without TE for dense models, slower; refused there for
    mixtures of experts, multi-latent attention and sequence parallelism, whose local paths assume TE)."""

    lora_rank: int = 0
    """LoRA (models/lora.py): rank of the low-rank adapters trained in place of the model's weights, which
    stay frozen; 0 trains every weight. The engine receives the merged weights W + (alpha / rank) B A, or with
    rollout.weight_sync=adapters the base once and then the adapters alone."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: the adapters' output is multiplied by lora_alpha / lora_rank."""
    lora_targets: list[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    """The linear layers that get adapters, by Megatron name: linear_qkv and linear_proj (attention),
    linear_fc1 and linear_fc2 (the dense MLPs), experts.linear_fc1 and experts.linear_fc2 (each routed expert
    of a mixture of experts: an adapter per expert; not by default), shared_experts.linear_fc1 and
    shared_experts.linear_fc2 (the shared experts of Qwen2-MoE, GLM-4.5, DeepSeek; not by default)."""

    RECOMPUTE: ClassVar[tuple[str, ...]] = ("none", "selective", "full")
    TRANSFORMER_IMPLS: ClassVar[tuple[str, ...]] = ("auto", "transformer_engine", "local")
    LORA_TARGETS: ClassVar[tuple[str, ...]] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
                                               "experts.linear_fc1", "experts.linear_fc2",
                                               "shared_experts.linear_fc1", "shared_experts.linear_fc2")
    # fields only the grouped routers use (FamilySpec.grouped_router), with the value every other family has
    GROUPED_ROUTER_ONLY: ClassVar[dict[str, float]] = {
        "moe_router_num_groups": 1, "moe_router_group_topk": 1, "moe_routed_scaling_factor": 1.0}
    # multi-latent attention's widths (MLA families only; kv_lora_rank and the head widths required there)
    MLA_FIELDS: ClassVar[tuple[str, ...]] = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                             "v_head_dim")
    ROPE_SCALING_TYPES: ClassVar[tuple[str, ...]] = ("llama3", "yarn")
    # YaRN's parameters (YaRN families only), with HF's (and Megatron's) defaults
    YARN_ONLY: ClassVar[dict[str, Any]] = {
        "rope_scaling_beta_fast": 32.0, "rope_scaling_beta_slow": 1.0, "rope_scaling_mscale": 1.0,
        "rope_scaling_mscale_all_dim": 0.0, "rope_scaling_truncate": True}
    DTYPES: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")
    # Megatron-core's GPTModel passes only the factor on to RotaryEmbedding._apply_scaling, whose
    # other parameters keep Llama 3.1's values (megatron/core/models/common/embeddings/
    # rotary_pos_embedding.py:92-98 in megatron-core 0.16).
    ROPE_SCALING_FIXED: ClassVar[dict[str, float]] = {
        "rope_scaling_low_freq_factor": 1.0, "rope_scaling_high_freq_factor": 4.0,
        "rope_scaling_original_max_position_embeddings": 8192}

    def __post_init__(self) -> None:
        _check_choice("model.family", self.family, tuple(FAMILIES))
        _check_choice("model.dtype", self.dtype, self.DTYPES)
        _check_choice("model.recompute", self.recompute, self.RECOMPUTE)
        _check_choice("model.transformer_impl", self.transformer_impl, self.TRANSFORMER_IMPLS)
        _check_min("model.recompute_num_layers", self.recompute_num_layers, 1)
        if not self.tokenizer:
            raise _invalid("model.tokenizer", self.tokenizer, "must be builtin:char or a HF tokenizer directory")
        if self.tokenizer.startswith("builtin:") and self.tokenizer not in BUILTIN_TOKENIZERS:
            raise _invalid(
                "model.tokenizer", self.tokenizer,
                f"the shipped tokenizers are {', '.join(BUILTIN_TOKENIZERS)}; otherwise give a HF tokenizer directory",
            )
        for key, value in (
            ("num_layers", self.num_layers), ("hidden_size", self.hidden_size),
            ("ffn_hidden_size", self.ffn_hidden_size), ("num_attention_heads", self.num_attention_heads),
            ("num_query_groups", self.num_query_groups), ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ):
            _check_min(f"model.{key}", value, 1)
        if self.head_dim is not None:
            _check_min("model.head_dim", self.head_dim, 1)
        elif self.hidden_size % self.num_attention_heads != 0 and not self.multi_latent_attention:
            raise _invalid(
                "model.hidden_size", self.hidden_size,
                f"must be divisible by model.num_attention_heads={self.num_attention_heads} "
                "when model.head_dim=null; set model.head_dim explicitly or change the head count",
            )
        if self.num_attention_heads % self.num_query_groups != 0:
            raise _invalid(
                "model.num_query_groups", self.num_query_groups,
                f"must divide model.num_attention_heads={self.num_attention_heads}; "
                f"valid values are {_divisors_str(self.num_attention_heads)}",
            )
        _check_min("model.rope_theta", self.rope_theta, 0, strict=True)
        _check_min("model.norm_eps", self.norm_eps, 0, strict=True)
        _check_min("model.init_seed", self.init_seed, 0)
        self._check_rope_scaling()
        if not 0 < self.rotary_percent <= 1:
            raise _invalid("model.rotary_percent", self.rotary_percent, "must lie in (0, 1]")
        if not self.spec.partial_rotary and self.rotary_percent != 1.0:
            raise _invalid("model.rotary_percent", self.rotary_percent, "only model.family="
                           f"{_names(lambda f: f.partial_rotary, ' or ')} rotates part of each head; "
                           "set model.rotary_percent=1")
        self._check_moe()
        _check_min("model.moe_router_bias_update_rate", self.moe_router_bias_update_rate, 0)
        if self.moe_router_bias_update_rate and (not self.is_moe or self.spec.router != "sigmoid"):
            raise _invalid("model.moe_router_bias_update_rate", self.moe_router_bias_update_rate,
                           "only the sigmoid routers with a selection bias (model.family="
                           f"{_names(lambda f: f.router == 'sigmoid')}) have a bias to update; set it to 0")
        self._check_own_fields()
        if self.spec.check is not None:  # the family's own checks (families/<family>.py)
            self.spec.check(self)
        if self.mlp_bias and not self.spec.mlp_bias:
            raise _invalid("model.mlp_bias", True, f"only model.family={_names(lambda f: f.mlp_bias, ' or ')} has "
                           f"MLP biases (HF mlp_bias); {self.family}'s MLPs have none: set model.mlp_bias=false")
        if not self.spec.grouped_router:
            for key, default in self.GROUPED_ROUTER_ONLY.items():
                if getattr(self, key) != default:
                    raise _invalid(f"model.{key}", getattr(self, key), "only the routers of model.family="
                                   f"{_names(lambda f: f.grouped_router)} use it; "
                                   f"set model.{key}={format_value(default)}")
        self._check_mla()
        self._check_lora()

    def _check_mla(self) -> None:
        """DeepSeek's multi-latent attention as transformers' DeepSeek-V2/-V3 and Megatron-core's
        MLASelfAttention both build it: every head has its own keys and values (expanded from one latent),
        no Q/K/V bias."""
        if not self.multi_latent_attention:
            for key in self.MLA_FIELDS:
                if getattr(self, key) is not None:
                    raise _invalid(f"model.{key}", getattr(self, key), "only model.family="
                                   f"{_names(lambda f: f.mla, ' or ')} (multi-latent attention) uses it; "
                                   f"set model.{key}=null")
            return
        for key in self.MLA_FIELDS[1:]:
            if getattr(self, key) is None:
                raise _invalid(f"model.{key}", None, f"model.family={self.family} needs it (HF {key})")
            _check_min(f"model.{key}", getattr(self, key), 1)
        if self.q_lora_rank is not None:
            _check_min("model.q_lora_rank", self.q_lora_rank, 1)
        if self.qk_rope_head_dim % 2:
            raise _invalid("model.qk_rope_head_dim", self.qk_rope_head_dim,
                           "must be even: RoPE turns dimensions in pairs")
        if self.num_query_groups != self.num_attention_heads:
            raise _invalid("model.num_query_groups", self.num_query_groups, "multi-latent attention expands keys and "
                           f"values for every head: set it to model.num_attention_heads={self.num_attention_heads}")
        for key in ("qkv_bias", "qk_layernorm", "head_dim"):
            if getattr(self, key):
                raise _invalid(f"model.{key}", getattr(self, key), "does not apply to multi-latent attention (its "
                               "latent norms are always there, its head widths are the qk_*/v_head_dim fields, "
                               "and Megatron-core's has no bias); set it to null")

    def _check_lora(self) -> None:
        _check_min("model.lora_rank", self.lora_rank, 0)
        if not self.lora_rank:
            return
        _check_min("model.lora_alpha", self.lora_alpha, 0, strict=True)
        if not self.lora_targets:
            raise _invalid("model.lora_targets", self.lora_targets, "name at least one of "
                           f"{', '.join(self.LORA_TARGETS)}, or set model.lora_rank=0")
        for target in self.lora_targets:
            _check_choice("model.lora_targets", target, self.LORA_TARGETS)
        if len(set(self.lora_targets)) != len(self.lora_targets):
            raise _invalid("model.lora_targets", self.lora_targets, "lists a layer twice")
        if "linear_qkv" in self.lora_targets and self.multi_latent_attention:
            raise _invalid("model.lora_targets", self.lora_targets, f"model.family={self.family}'s multi-latent "
                           "attention has no linear_qkv (its down and up projections get no adapters); leave it out")
        if {"linear_fc1", "linear_fc2"} & set(self.lora_targets) and len(self.sparse_layers) == self.num_layers:
            raise _invalid("model.lora_targets", self.lora_targets, "every layer of this model has experts, so "
                           "linear_fc1 / linear_fc2 (the dense MLPs') would adapt nothing; leave them out (the "
                           "experts' are experts.linear_fc1 / experts.linear_fc2)")
        routed = [t for t in self.expert_lora_targets if t.startswith("experts.")]
        if routed and not self.is_moe:
            raise _invalid("model.lora_targets", self.lora_targets, f"model.family={self.family} has no experts; "
                           f"leave {' / '.join(routed)} out")
        shared = [t for t in self.expert_lora_targets if t.startswith("shared_experts.")]
        if shared and not self.moe_shared_expert_intermediate_size:
            raise _invalid("model.lora_targets", self.lora_targets, f"model.family={self.family} has no shared "
                           f"experts (model.moe_shared_expert_intermediate_size is null); leave {' / '.join(shared)} "
                           "out")

    @property
    def expert_lora_targets(self) -> list[str]:
        """The LoRA targets in the routed and shared experts (experts.linear_fc1, shared_experts.linear_fc2, ...),
        which engines and exports get merged only."""
        return [t for t in self.lora_targets if t.startswith(("experts.", "shared_experts."))] if self.lora_rank \
            else []

    @property
    def yarn(self) -> bool:
        """Whether RoPE is scaled with YaRN when rope_scaling_factor is set (rope_scaling_type, or the family's)."""
        return self.rope_scaling_type == "yarn" or (self.rope_scaling_type is None and self.spec.default_yarn)

    def local_spec_gpu_problem(self, sequence_parallel: bool) -> Optional[str]:
        """Why model.transformer_impl=local cannot run this model on a GPU, or None: Megatron-core's local paths
        assume Transformer Engine for the MoE router's fp32 GEMM and its all-to-all dispatcher, multi-latent
        attention and sequence parallelism's norms (the CPU compatibility layer stands in for them on CPU only)."""
        if self.is_moe:
            return "a mixture of experts"
        if self.multi_latent_attention:
            return "multi-latent attention"
        if sequence_parallel:
            return "sequence parallelism"
        return None

    def _check_rope_scaling(self) -> None:
        if self.rope_scaling_type is not None:
            _check_choice("model.rope_scaling_type", self.rope_scaling_type, self.ROPE_SCALING_TYPES)
            if self.spec.rope_scalings == ("yarn",) and not self.yarn:
                raise _invalid("model.rope_scaling_type", self.rope_scaling_type, f"{self.family} scales RoPE with "
                               "YaRN only; set model.rope_scaling_type=yarn (or null)")
            if self.yarn and "yarn" not in self.spec.rope_scalings:
                raise _invalid("model.rope_scaling_type", self.rope_scaling_type, f"model.family={self.family} has "
                               f"no YaRN scaling here; it is supported for {_names(lambda f: 'yarn' in f.rope_scalings)}")
        if self.yarn:
            self._check_yarn()
            return
        for key, default in self.YARN_ONLY.items():
            if getattr(self, key) != default:
                raise _invalid(f"model.{key}", getattr(self, key), "only YaRN scaling (model.rope_scaling_type=yarn) "
                               f"uses it; set model.{key}={format_value(default)}")
        if self.rope_scaling_factor is None:
            for key, default in self.ROPE_SCALING_FIXED.items():
                if getattr(self, key) != default:
                    raise _invalid(f"model.{key}", getattr(self, key), "only applies with Llama 3.1 rope scaling; "
                                   "set model.rope_scaling_factor, or leave this at its default "
                                   f"{format_value(default)}")
            return
        _check_min("model.rope_scaling_factor", self.rope_scaling_factor, 1)
        for key, fixed in self.ROPE_SCALING_FIXED.items():
            if getattr(self, key) != fixed:
                raise _invalid(f"model.{key}", getattr(self, key),
                               f"Megatron-core applies Llama 3.1 rope scaling with {key.removeprefix('rope_scaling_')}"
                               f"={format_value(fixed)} fixed (RotaryEmbedding._apply_scaling); only "
                               f"{format_value(fixed)} is supported")

    def _check_yarn(self) -> None:
        """The rope_scaling_* fields with YaRN scaling: YaRN's, as Megatron-core's YarnRotaryEmbedding takes
        them."""
        fixed = {k: v for k, v in self.ROPE_SCALING_FIXED.items()
                 if k != "rope_scaling_original_max_position_embeddings"}
        for key, default in fixed.items():
            if getattr(self, key) != default:
                raise _invalid(f"model.{key}", getattr(self, key), f"is a Llama 3.1 scaling parameter; {self.family} "
                               f"scales RoPE with YaRN: set model.{key}={format_value(default)}")
        if self.rope_scaling_factor is None:
            for key, default in self.YARN_ONLY.items():
                if getattr(self, key) != default:
                    raise _invalid(f"model.{key}", getattr(self, key), "only applies with YaRN scaling; set "
                                   f"model.rope_scaling_factor, or leave this at its default {format_value(default)}")
            return
        _check_min("model.rope_scaling_factor", self.rope_scaling_factor, 1)
        if self.multi_latent_attention and not self.rope_scaling_truncate:
            # multi_latent_attention.py builds its YarnRotaryEmbedding without correction_range_round_to_int
            raise _invalid("model.rope_scaling_truncate", False, "Megatron-core's multi-latent attention always "
                           "rounds YaRN's correction range; set model.rope_scaling_truncate=true")
        _check_min("model.rope_scaling_original_max_position_embeddings",
                   self.rope_scaling_original_max_position_embeddings, 1)
        _check_min("model.rope_scaling_beta_fast", self.rope_scaling_beta_fast, 0, strict=True)
        _check_min("model.rope_scaling_beta_slow", self.rope_scaling_beta_slow, 0, strict=True)
        if self.rope_scaling_beta_slow > self.rope_scaling_beta_fast:  # equal: Kimi-K2's 1 and 1
            raise _invalid("model.rope_scaling_beta_slow", self.rope_scaling_beta_slow,
                           f"must not exceed model.rope_scaling_beta_fast={self.rope_scaling_beta_fast}")
        _check_min("model.rope_scaling_mscale", self.rope_scaling_mscale, 0)
        _check_min("model.rope_scaling_mscale_all_dim", self.rope_scaling_mscale_all_dim, 0)
        both = self.rope_scaling_mscale > 0 and self.rope_scaling_mscale_all_dim > 0
        if not both and self.rope_scaling_mscale != 1:
            # HF then scales cos and sin by 0.1 ln(factor) + 1, ignoring mscale; Megatron-core by its ratio
            raise _invalid("model.rope_scaling_mscale", self.rope_scaling_mscale,
                           "unless model.rope_scaling_mscale and rope_scaling_mscale_all_dim are both > 0, only "
                           "mscale=1 is read alike by transformers and Megatron-core; set both (DeepSeek-V3: 1 "
                           "and 1) or mscale=1")

    def _check_moe(self) -> None:
        moe_family = self.spec.moe
        if self.num_experts is None:
            if moe_family:
                raise _invalid("model.num_experts", None, f"model.family={self.family} is a mixture of experts: "
                               "set model.num_experts and model.moe_ffn_hidden_size")
            for key in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
                if getattr(self, key) is not None:
                    raise _invalid(f"model.{key}", getattr(self, key),
                                   f"only applies with model.num_experts; set model.{key}=null")
            if self.moe_dense_layers:
                raise _invalid("model.moe_dense_layers", list(self.moe_dense_layers),
                               "only applies with model.num_experts (every layer of a dense model is dense); "
                               "set model.moe_dense_layers=[]")
            return
        if not moe_family:
            raise _invalid("model.num_experts", self.num_experts,
                           f"model.family={self.family} is dense; experts need model.family="
                           f"{_names(lambda f: f.moe, ' or ')}, or set model.num_experts=null")
        _check_min("model.num_experts", self.num_experts, 1)
        if self.moe_ffn_hidden_size is None:
            raise _invalid("model.moe_ffn_hidden_size", None, "is required with model.num_experts; "
                           "set it to the expert width (HF moe_intermediate_size)")
        _check_min("model.moe_ffn_hidden_size", self.moe_ffn_hidden_size, 1)
        if not 1 <= self.moe_router_topk <= self.num_experts:
            raise _invalid("model.moe_router_topk", self.moe_router_topk,
                           f"must lie in [1, model.num_experts={self.num_experts}]")
        if self.moe_router_topk == 1 and self.moe_norm_topk_prob:
            # Megatron refuses a softmax over the top-1 logit (its gradient is zero):
            # megatron/core/transformer/transformer_config.py:1641.
            fix = "topk >= 2" if self.spec.renormalised_topk else "set model.moe_norm_topk_prob=false or topk >= 2"
            raise _invalid("model.moe_router_topk", 1, "with model.moe_norm_topk_prob=true every routing weight "
                           f"is 1 and Megatron-core refuses it; {fix}")
        _check_min("model.moe_aux_loss_coeff", self.moe_aux_loss_coeff, 0)
        self._check_dense_layers()
        if not self.spec.shared_experts and self.moe_shared_expert_intermediate_size is not None:
            raise _invalid("model.moe_shared_expert_intermediate_size", self.moe_shared_expert_intermediate_size,
                           f"model.family={self.family} has no shared expert (only "
                           f"{_names(lambda f: f.shared_experts, ' and ')} have); "
                           "set model.moe_shared_expert_intermediate_size=null")
        if self.spec.check_moe is not None:  # the family's own (families/<family>.py)
            self.spec.check_moe(self)

    def _check_dense_layers(self) -> None:
        dense = list(self.moe_dense_layers)
        if not dense:
            return
        self.moe_dense_layers = sorted(dense)  # one spelling per layout (checkpoints compare it)
        if self.spec.experts_in_every_layer:
            raise _invalid("model.moe_dense_layers", dense, f"{self.spec.title} has experts in every layer; "
                           "set model.moe_dense_layers=[]")
        self.check_layer_list("moe_dense_layers", dense)
        if len(dense) == self.num_layers:
            raise _invalid("model.moe_dense_layers", dense, "makes every layer dense, which a mixture-of-experts "
                           "family cannot express: leave at least one layer with experts")

    def _check_own_fields(self) -> None:
        """Fields only some family uses (gpt-oss's sliding window and SwiGLU clamp) keep everyone else's value."""
        for spec in FAMILIES.values():
            if spec.name == self.family or not spec.own_fields:
                continue
            for key, default in spec.own_fields.items():
                if getattr(self, key) != default:
                    raise _invalid(f"model.{key}", getattr(self, key), f"only model.family={spec.name} uses it; set "
                                   f"model.{key}={format_value(default)}")

    def check_layer_list(self, key: str, layers: list[int]) -> None:
        """A list of global layer indices (model.moe_dense_layers, model.sliding_window_layers): each in
        [0, num_layers), none twice."""
        wrong = [i for i in layers if not 0 <= i < self.num_layers]
        if wrong:
            raise _invalid(f"model.{key}", layers, f"layer(s) {wrong} outside [0, model.num_layers={self.num_layers})")
        if len(set(layers)) != len(layers):
            raise _invalid(f"model.{key}", layers, "names a layer twice")

    @property
    def spec(self) -> FamilySpec:
        """The family's spec (megatron_rl/families/<family>.py)."""
        return family_spec(self.family)

    @property
    def multi_latent_attention(self) -> bool:
        """Whether attention is DeepSeek's multi-latent attention (Megatron's MLASelfAttention)."""
        return self.spec.mla

    @property
    def attention_sinks(self) -> bool:
        """Whether every attention head has a learned sink logit in its softmax (gpt-oss; Megatron's
        softmax_type "learnable")."""
        return self.spec.attention_sinks

    @property
    def attention_output_bias(self) -> bool:
        """Whether the attention's output projection (Megatron linear_proj, HF o_proj) has a bias: gpt_oss's always,
        llama's, qwen3's and qwen3_moe's with their Q/K/V bias (HF attention_bias covers all four)."""
        return self.linear_bias or (self.spec.attention_bias_all and self.resolved_qkv_bias)

    @property
    def linear_bias(self) -> bool:
        """Whether every linear layer has a bias: attention, router and experts (gpt-oss; Megatron's
        add_bias_linear)."""
        return self.spec.linear_bias

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are mixtures of experts."""
        return self.num_experts is not None

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether global layer `layer` (0-based) has experts."""
        return self.is_moe and layer not in self.moe_dense_layers

    @property
    def sparse_layers(self) -> list[int]:
        """The global (0-based) indices of the layers with experts, ascending."""
        return [i for i in range(self.num_layers) if self.is_sparse_layer(i)]

    @property
    def moe_layer_pattern(self) -> list[int]:
        """Megatron's moe_layer_freq as a list: 1 for a layer with experts, 0 for a dense one."""
        return [int(self.is_sparse_layer(i)) for i in range(self.num_layers)]

    @property
    def resolved_qkv_bias(self) -> bool:
        """qkv_bias with the family default applied."""
        return self.qkv_bias if self.qkv_bias is not None else self.spec.qkv_bias

    @property
    def resolved_qk_layernorm(self) -> bool:
        """qk_layernorm with the family default applied."""
        return self.qk_layernorm if self.qk_layernorm is not None else self.spec.qk_layernorm

    @property
    def resolved_head_dim(self) -> int:
        """head_dim, or hidden_size // num_attention_heads when unset (multi-latent attention: the query and
        key width, qk_nope_head_dim + qk_rope_head_dim)."""
        if self.multi_latent_attention:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads


@dataclass
class ParallelConfig:
    """Megatron model-parallel layout; the data-parallel size is derived from the world size."""

    tp: int = 1
    """Tensor-parallel size (Megatron's tensor_model_parallel_size)."""
    pp: int = 1
    """Pipeline-parallel size (Megatron's pipeline_model_parallel_size)."""
    cp: int = 1
    """Context-parallel size (Megatron's context_parallel_size): every packed row is split over cp
    ranks for sequences too long for one (samples padded to multiples of 2 * cp); not with
    algorithm.policy_loss=gspo, whose ratio needs a whole sequence on one rank."""
    ep: int = 1
    """Expert-parallel size (Megatron's expert_model_parallel_size): experts are split over ep ranks
    taken from the data-parallel ranks; must divide model.num_experts, and etp * ep * pp the world size (etp:
    the expert tensor-parallel size below)."""
    etp: Optional[int] = None
    """Expert tensor-parallel size (Megatron's expert_tensor_parallel_size): experts split over etp ranks
    of each tensor-parallel group; null means tp, except for model.family=gpt_oss, whose biased experts
    Megatron-core runs only with etp=1."""
    sequence_parallel: bool = False
    """Shard activations along the sequence inside tensor-parallel regions; needs tp > 1."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks (ZeRO-1)."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduce-scatter/all-reduce with the backward pass."""

    def __post_init__(self) -> None:
        _check_min("parallel.tp", self.tp, 1)
        _check_min("parallel.pp", self.pp, 1)
        _check_min("parallel.cp", self.cp, 1)
        _check_min("parallel.ep", self.ep, 1)
        if self.etp is not None and self.etp not in (1, self.tp):
            raise _invalid("parallel.etp", self.etp, f"must be 1 or parallel.tp={self.tp} (or null: tp)")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                "parallel.sequence_parallel=true is invalid with parallel.tp=1: sequence parallelism "
                "shards tensor-parallel regions; set parallel.tp>1 or parallel.sequence_parallel=false"
            )

    def expert_tp(self, model: ModelConfig) -> int:
        """etp with its default applied: tp, or 1 for a model whose experts have biases."""
        if self.etp is not None:
            return self.etp
        return 1 if model.linear_bias else self.tp

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one copy of the model: tp * pp * cp."""
        return self.tp * self.pp * self.cp

    def dp_size(self, world_size: int) -> int:
        """Data-parallel size ``world_size // (tp * pp * cp)``; ValueError if it does not divide."""
        if world_size < 1 or world_size % self.model_parallel_size != 0:
            raise ValueError(
                f"world_size={world_size} is not divisible by parallel.tp*parallel.pp*parallel.cp="
                f"{self.tp}*{self.pp}*{self.cp}={self.model_parallel_size}: "
                f"choose sizes whose product divides {world_size}"
            )
        return world_size // self.model_parallel_size


@dataclass
class OptimizerConfig:
    """Optimizer and learning-rate schedule."""

    name: str = "adam"
    """Optimizer: adam (AdamW-style decoupled weight decay) or sgd."""
    lr: float = 1e-3
    """Peak learning rate, reached after the warmup."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay; at most lr."""
    weight_decay: float = 0.0
    """Decoupled weight-decay coefficient."""
    adam_beta1: float = 0.9
    """Adam first-moment decay."""
    adam_beta2: float = 0.999
    """Adam second-moment decay."""
    adam_eps: float = 1e-8
    """Adam denominator epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to lr."""
    lr_decay_style: str = "constant"
    """Decay after warmup: constant, linear or cosine."""
    lr_decay_steps: Optional[int] = None
    """Steps over which lr decays to min_lr; null means until num_steps."""

    NAMES: ClassVar[tuple[str, ...]] = ("adam", "sgd")
    DECAY_STYLES: ClassVar[tuple[str, ...]] = ("constant", "linear", "cosine")

    def __post_init__(self) -> None:
        _check_choice("optimizer.name", self.name, self.NAMES)
        _check_choice("optimizer.lr_decay_style", self.lr_decay_style, self.DECAY_STYLES)
        _check_min("optimizer.lr", self.lr, 0, strict=True)
        _check_min("optimizer.min_lr", self.min_lr, 0)
        if self.min_lr > self.lr:
            raise _invalid("optimizer.min_lr", self.min_lr, f"must be <= optimizer.lr={format_value(self.lr)}")
        _check_min("optimizer.weight_decay", self.weight_decay, 0)
        _check_unit_interval("optimizer.adam_beta1", self.adam_beta1, low_open=False, high_open=True)
        _check_unit_interval("optimizer.adam_beta2", self.adam_beta2, low_open=False, high_open=True)
        _check_min("optimizer.adam_eps", self.adam_eps, 0, strict=True)
        _check_min("optimizer.clip_grad", self.clip_grad, 0)
        _check_min("optimizer.lr_warmup_steps", self.lr_warmup_steps, 0)
        if self.lr_decay_steps is not None:
            _check_min("optimizer.lr_decay_steps", self.lr_decay_steps, 1)


@dataclass
class RolloutConfig:
    """Generation engine and sampling parameters for RL rollouts."""

    backend: str = "hf"
    """Engine: hf (transformers generate, in-process) or sglang (server, time-shared with training)."""
    tp: int = 1
    """Tensor-parallel size of one rollout engine."""
    temperature: float = 1.0
    """Sampling temperature (log-probs are computed at this temperature); 0: greedy decoding (argmax, as in SGLang
    and vLLM), its log-probs at temperature 1."""
    top_p: float = 1.0
    """Nucleus-sampling mass in (0, 1]; 1 disables it."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    max_new_tokens: int = 32
    """Longest response generated per sample."""
    max_batch_size: int = 256
    """hf backend: sequences (prompts x samples) per `generate` call at most, the memory bound of one call: its
    KV cache grows as sequences x (prompt + response) tokens and one step's logits as sequences x vocab. A
    call with more is split into calls of this size, which run one after the other."""
    generate_chunks: int = 1
    """Engine calls a rank's share of a step's prompts is split into (single-turn tasks). 1: one call, the engine's
    best batching; N > 1: the rewards of the first chunks are computed while the next ones generate, worth it
    when verification is slow against generation (sandboxed tests)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: a response ends with the token that completes one of them (the string is kept in
    the response and trained on). Training and evaluation; agent turns stop at them too. With the sglang
    backend the engine then loads the run's tokenizer (SGLang matches them on the text; token ids still go
    in and out); an attached server (rollout.base_url) must have one."""
    n_samples_per_prompt: int = 8
    """Responses sampled per prompt (the group size of group-relative advantages)."""
    mem_fraction_static: float = 0.5
    """SGLang's share of GPU memory for weights and KV cache, in (0, 1)."""
    weight_sync: str = "full"
    """What the trainer pushes into the engine before each rollout. full: every weight (a LoRA model's merged
    W + alpha / r B A). adapters (LoRA runs, model.lora_rank > 0): the frozen base weights once, then only the
    adapters, which the engine applies itself (the hf engine's hooks; SGLang's LoRA serving, started with
    enable_lora): a step moves r (in + out) numbers per adapted module instead of the model. Colocated, the
    engine's base weights then stay resident between rollouts (only its KV cache is released); disaggregated,
    each publish to the generators is the adapters alone after the first."""
    replay_dir: Optional[str] = None
    """Debugging: train on the rollouts a run dumped (logging.dump_rollouts; its run_dir/rollouts) instead
    of generating: step k reads step_k.jsonl (megatron_rl/rollout/dump.py). Colocated mode only."""
    base_url: Optional[str] = None
    """sglang: attach to this running SGLang HTTP server (http://host:port) instead of starting an
    engine in the job; the server's tp_size must equal rollout.tp and the job must be one block
    (world size = rollout.tp)."""
    attention_backend: Optional[str] = None
    """sglang: SGLang's attention_backend (flashinfer, fa3, triton, torch_native, ...); null lets
    SGLang choose on GPU (torch_native on CPU)."""
    chunked_prefill_size: Optional[int] = None
    """sglang: longest prefill chunk in tokens; null keeps SGLang's default, -1 disables chunking."""
    max_total_tokens: Optional[int] = None
    """sglang: KV-cache capacity in tokens; null derives it from mem_fraction_static (set it on CPU)."""
    disable_radix_cache: bool = False
    """sglang: turn off prefix caching (the n samples of a prompt then prefill it n times)."""
    kv_cache_dtype: str = "auto"
    """sglang: KV-cache dtype (auto = the model dtype, or fp8_e5m2 / fp8_e4m3 on GPUs that have it)."""
    log_level: str = "error"
    """sglang: SGLang's own log level: debug, info, warning or error."""
    server_args: dict[str, Any] = field(default_factory=dict)
    """sglang: any other SGLang ServerArgs field by its SGLang name (e.g. {enable_deterministic_inference:
    true}); overrides everything above."""

    agent_scheduler: str = "lockstep"
    """Multi-turn (task.type=agent) episodes: lockstep (all episodes advance turn by turn; sampling is
    reproducible) or async (each episode runs on its own; the engine batches whatever turns are ready
    while others wait on tools: see megatron_rl/rollout/scheduler.py)."""
    max_concurrent_episodes: int = 64
    """agent_scheduler=async: episodes in flight per engine at most."""
    oversample: float = 0.0
    """agent_scheduler=async: start this fraction more groups than the batch needs and cut the
    stragglers once enough groups are complete (their episodes are counted, not trained on)."""
    straggler_policy: str = "abort"
    """What the early cut (oversample > 0) does with unfinished episodes: abort (their groups are
    left out) or partial (kept as partial rollouts, rewarded by verifying the environment as it
    stands, and trained on)."""
    step_deadline_s: Optional[float] = None
    """agent_scheduler=async: episodes still running this long after the rollout started are stopped
    (status deadline, counted) and the step trains on what completed; null: no deadline."""
    mode: str = "colocated"
    """colocated (every rank trains and generates, time-shared) or disaggregated (separate generator
    processes generate while the trainer trains; experience buffer with algorithm.max_staleness;
    see megatron_rl/disagg/ and docs/rollout.md, "Disaggregated mode")."""
    num_generators: int = 1
    """mode=disaggregated: generator processes, each owning one engine."""
    generator_nodes: int = 0
    """mode=disaggregated: 0 = trainer rank 0 starts the generators on its own node; N > 0 = they run
    on N other nodes (under Slurm the last N nodes of the GPU component, num_generators / N per node,
    one GPU each; elsewhere start them with `python -m megatron_rl.disagg.generator --run-dir RUN_DIR`)."""
    generator_timeout_s: float = 300.0
    """mode=disaggregated: the trainer stops with an error when a generator has not connected this long
    after the trainer started, or has sent no heartbeat for this long (it beats every 2 s)."""
    weight_update_timeout_s: float = 1800.0
    """mode=disaggregated: how long a weight broadcast may wait for a generator to reach it. A generator
    takes updates between requests (with partial_rollout_tokens > 0: between chunks and turns), so this
    must exceed the longest request: generation plus its reward wait (up to 300 s) or agent episodes."""
    generator_progress_timeout_s: float = 1800.0
    """mode=disaggregated: the trainer stops with an error naming the generator when the generator's
    main loop has made no progress for this long while its heartbeat goes on (it hangs). The loop
    counts as progressing between requests, engine calls, chunks, turns and weight buckets and while
    it waits (for requests, buffer space, rewards), so this must exceed the longest single engine call
    (a whole request's generation without partial_rollout_tokens) and the engine's start-up."""
    partial_rollout_tokens: int = 0
    """mode=disaggregated: generate in chunks of this many tokens and apply a pending weight update
    between chunks (the sequence continues with the new weights); agent episodes (any value > 0)
    take it between turns instead; 0: updates wait for whole requests."""

    BACKENDS: ClassVar[tuple[str, ...]] = ("hf", "sglang")
    AGENT_SCHEDULERS: ClassVar[tuple[str, ...]] = ("lockstep", "async")
    LOG_LEVELS: ClassVar[tuple[str, ...]] = ("debug", "info", "warning", "error")
    MODES: ClassVar[tuple[str, ...]] = ("colocated", "disaggregated")
    WEIGHT_SYNCS: ClassVar[tuple[str, ...]] = ("full", "adapters")

    def __post_init__(self) -> None:
        _check_choice("rollout.backend", self.backend, self.BACKENDS)
        _check_choice("rollout.mode", self.mode, self.MODES)
        _check_choice("rollout.weight_sync", self.weight_sync, self.WEIGHT_SYNCS)
        _check_min("rollout.num_generators", self.num_generators, 1)
        _check_min("rollout.partial_rollout_tokens", self.partial_rollout_tokens, 0)
        _check_min("rollout.generator_nodes", self.generator_nodes, 0)
        _check_min("rollout.generator_timeout_s", self.generator_timeout_s, 0, strict=True)
        _check_min("rollout.weight_update_timeout_s", self.weight_update_timeout_s, 0, strict=True)
        _check_min("rollout.generator_progress_timeout_s", self.generator_progress_timeout_s, 0, strict=True)
        if self.generator_nodes and self.num_generators % self.generator_nodes:
            raise _invalid("rollout.num_generators", self.num_generators,
                           f"must be a multiple of rollout.generator_nodes={self.generator_nodes} "
                           "(the same number of generators on every generator node)")
        if self.mode == "colocated":
            for key, value, off in (("num_generators", self.num_generators, 1),
                                    ("generator_nodes", self.generator_nodes, 0),
                                    ("partial_rollout_tokens", self.partial_rollout_tokens, 0)):
                if value != off:
                    raise _invalid(f"rollout.{key}", value, "is a disaggregated-mode setting: set "
                                   f"rollout.mode=disaggregated or rollout.{key}={format_value(off)}")
        _check_choice("rollout.agent_scheduler", self.agent_scheduler, self.AGENT_SCHEDULERS)
        _check_min("rollout.max_concurrent_episodes", self.max_concurrent_episodes, 1)
        _check_min("rollout.oversample", self.oversample, 0)
        _check_choice("rollout.straggler_policy", self.straggler_policy, ("abort", "partial"))
        if self.step_deadline_s is not None:
            _check_min("rollout.step_deadline_s", self.step_deadline_s, 0, strict=True)
        if self.oversample and self.agent_scheduler != "async":
            raise _invalid("rollout.oversample", self.oversample, "needs rollout.agent_scheduler=async")
        _check_min("rollout.tp", self.tp, 1)
        _check_min("rollout.temperature", self.temperature, 0)  # 0: greedy
        _check_min("rollout.generate_chunks", self.generate_chunks, 1)
        _check_min("rollout.max_batch_size", self.max_batch_size, 1)
        _check_unit_interval("rollout.top_p", self.top_p, low_open=True, high_open=False)
        if self.top_k != -1 and self.top_k < 1:
            raise _invalid("rollout.top_k", self.top_k, "must be -1 (disabled) or >= 1")
        if self.backend == "sglang" and self.top_k == 1 and self.temperature != 1.0:
            raise _invalid("rollout.top_k", self.top_k, f"with rollout.temperature={self.temperature} and "
                           "rollout.backend=sglang gives log-probs at temperature 1 (SGLang's greedy path) while the "
                           "trainer's are at rollout.temperature: set rollout.temperature=1 with top_k=1")
        _check_min("rollout.max_new_tokens", self.max_new_tokens, 1)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise _invalid("rollout.stop", self.stop, "stop strings must be non-empty strings")
        _check_min("rollout.n_samples_per_prompt", self.n_samples_per_prompt, 1)
        _check_unit_interval("rollout.mem_fraction_static", self.mem_fraction_static, low_open=True, high_open=True)
        _check_choice("rollout.log_level", self.log_level, self.LOG_LEVELS)
        if self.chunked_prefill_size is not None and self.chunked_prefill_size != -1:
            _check_min("rollout.chunked_prefill_size", self.chunked_prefill_size, 1)
        if self.max_total_tokens is not None:
            _check_min("rollout.max_total_tokens", self.max_total_tokens, 1)
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise _invalid("rollout.base_url", self.base_url, "must be an http(s):// URL of a running SGLang "
                           "server, or null to start engines in the job")
        sglang_only = {"base_url": self.base_url, "attention_backend": self.attention_backend,
                       "chunked_prefill_size": self.chunked_prefill_size, "max_total_tokens": self.max_total_tokens,
                       "server_args": self.server_args or None,
                       "disable_radix_cache": self.disable_radix_cache or None,
                       "kv_cache_dtype": None if self.kv_cache_dtype == "auto" else self.kv_cache_dtype}
        if self.backend != "sglang":
            for key, value in sglang_only.items():
                if value is not None:
                    raise _invalid(f"rollout.{key}", value, f"is an SGLang setting but rollout.backend={self.backend}; "
                                   "set rollout.backend=sglang (or rollout=sglang) or drop it")


@dataclass
class AlgorithmConfig:
    """Advantage estimator and policy loss of the RL update."""

    advantage_estimator: str = "grpo"
    """grpo, dr_grpo, rloo, reinforce_pp (group mean, then batch whitening) or gae (with algorithm.critic a
    learned value model's values; without, values 0: with gae_gamma = gae_lambda = 1 every token's advantage
    is its sample's reward, whitened over the batch's tokens; works with one sample per prompt)."""
    gae_gamma: float = 1.0
    """advantage_estimator=gae: discount per response token."""
    gae_lambda: float = 1.0
    """advantage_estimator=gae: GAE's lambda."""
    critic: bool = False
    """advantage_estimator=gae: train a value model (PPO's critic: the policy's architecture and starting
    weights, a zero-initialised value head in place of the output layer, an optimizer of its own) whose
    values V(s_t) enter GAE and which learns GAE's returns after each policy update."""
    critic_lr: float = 1e-5
    """The critic's learning rate (its other optimizer settings are optimizer.*'s)."""
    value_clip: Optional[float] = 0.5
    """The critic's value clipping: its values move at most this far from the pre-update ones in the loss
    (PPO's clipped value loss); null: plain squared error."""
    critic_warmup_steps: int = 0
    """RL steps at the start in which only the critic learns (the policy is not updated)."""
    policy_loss: str = "ppo_clip"
    """ppo_clip, clip_higher (DAPO), gspo (sequence-level ratio) or cispo (clipped IS weights)."""
    eps_clip: float = 0.2
    """Lower clip range of the importance ratio (1 - eps_clip); also the upper one for ppo_clip."""
    eps_clip_high: float = 0.28
    """Upper clip range (1 + eps_clip_high) for clip_higher, gspo and cispo."""
    eps_clip_c: Optional[float] = None
    """Dual clip (ppo_clip, clip_higher): a token with negative advantage A contributes at most -A * eps_clip_c
    (typical 3.0); null: off."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy (a loss term, or the reward's penalty with kl_in_reward);
    0 skips the reference model."""
    ref_update_every: int = 0
    """kl_coef > 0: RL steps after which the reference policy becomes the current policy (the KL then
    anchors to a recent policy instead of the start); 0: the reference stays the policy RL started from."""
    kl_estimator: str = "k3"
    """KL estimator: k1, k2 or k3 (Schulman's approximations)."""
    kl_clamp: Optional[float] = 10.0
    """Bound of each token's KL estimate, clamped to [-kl_clamp, kl_clamp] in the KL loss and in the reward's KL
    penalty (verl clamps its k3, low_var_kl, at 10); a clamped token adds the bound and no gradient. null: unbounded
    (TRL's k3; one token at a log-ratio of 20 then adds 5e8)."""
    kl_in_reward: bool = False
    """Apply kl_coef as a per-token penalty in the reward, r_t - kl_coef * kl_t (PPO-RLHF, REINFORCE++; verl's
    use_kl_in_reward), instead of as a KL loss. kl_t: kl_estimator of the policy's log-probs before the update
    against the reference's. A group estimator sees each sample's reward minus kl_coef times its summed KL, gae
    the per-token penalties."""
    kl_target: Optional[float] = None
    """kl_in_reward: adapt kl_coef (then its initial value) towards this KL per token, with Ziegler et al.'s
    controller (megatron_rl/algorithms/kl.py:KLController); null: kl_coef stays fixed."""
    kl_horizon: int = 10000
    """kl_target: the controller's horizon in samples (larger: slower changes of kl_coef)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    loss_agg_mode: str = "token_mean"
    """Loss normalisation: token_mean, seq_mean_token_sum or seq_mean_token_mean."""
    num_inner_updates: int = 1
    """Optimizer steps taken on each batch of rollouts."""
    routing_replay: str = "none"
    """Mixture-of-experts models (megatron_rl/trainer/routing_replay.py): old (record the experts each token is
    routed to at the old-log-prob forward and route every update's forward the same way, so that the
    importance ratio of later inner updates compares the same experts; needs old_logprobs=recompute),
    rollout (R3: route the old-log-prob forward and every update as the engine did when it generated the
    tokens; the hf engine, or SGLang on CUDA; single-turn tasks; colocated mode) or none. Logs
    routing/drift, the share of expert choices the updated routers would have made differently."""

    ADVANTAGE_ESTIMATORS: ClassVar[tuple[str, ...]] = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "gae")
    GROUP_ESTIMATORS: ClassVar[tuple[str, ...]] = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
    POLICY_LOSSES: ClassVar[tuple[str, ...]] = ("ppo_clip", "clip_higher", "gspo", "cispo")
    KL_ESTIMATORS: ClassVar[tuple[str, ...]] = ("k1", "k2", "k3")
    LOSS_AGG_MODES: ClassVar[tuple[str, ...]] = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean",
                                                 "seq_mean_token_sum_norm")
    OLD_LOGPROBS: ClassVar[tuple[str, ...]] = ("recompute", "rollout")
    ROUTING_REPLAYS: ClassVar[tuple[str, ...]] = ("none", "old", "rollout")

    tis_cap: float = 2.0
    """Cap of the truncated importance-sampling weight that corrects rollout/training log-prob mismatch."""
    rollout_is: str = "token"
    """The rollout correction's weight (megatron_rl/algorithms/losses.py:rollout_correction), from r = the
    trainer's over the engine's probability of a sampled token: token (min(r_t, tis_cap), truncated IS),
    sequence (min(product of the sequence's r, tis_cap)) or none."""
    rollout_mask: str = "none"
    """Drop from the loss what the engine sampled too differently: token (tokens with r_t outside
    [rollout_mask_low, rollout_mask_high]), sequence (sequences whose product of r is outside), geometric
    (sequences whose geometric mean of r is outside) or none."""
    rollout_mask_low: float = 0.5
    """Lower bound of the rollout mask's range (< 1)."""
    rollout_mask_high: float = 2.0
    """Upper bound of the rollout mask's range (> 1)."""
    max_staleness: int = 1
    """rollout.mode=disaggregated: a group generated with weight version v (its oldest token) is trained
    on at trainer version <= v + max_staleness; older groups are dropped (counted). 0 = on-policy."""
    old_logprobs: str = "recompute"
    """recompute (the trainer's forward before the update) or rollout (the engine's log-probs)."""
    loss_norm_len: Optional[int] = None
    """Constant length normaliser for loss_agg_mode=seq_mean_token_sum_norm (Dr. GRPO)."""
    filter_zero_variance: bool = False
    """Drop the samples of groups whose rewards are all equal from the update (zero advantage)."""
    overlong: str = "none"
    """Responses that hit rollout.max_new_tokens: none, filter (dropped from the loss) or penalty
    (DAPO's soft length penalty over the last overlong_penalty_window tokens)."""
    overlong_penalty_window: int = 0
    """Tokens before max_new_tokens where the penalty ramps from 0 to -overlong_penalty (overlong=penalty)."""
    overlong_penalty: float = 1.0
    """Reward subtracted from a response that reaches max_new_tokens (overlong=penalty)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: generate more groups until the batch holds global_batch_size /
    n_samples_per_prompt groups with reward variance (or dynamic_sampling_max_rounds rounds ran)."""
    dynamic_sampling_max_rounds: int = 4
    """Generation rounds per step at most with dynamic_sampling; a short batch is trained on, and logged."""
    domain_calibration: str = "none"
    """Multi-domain runs (`domains`): none (advantages from the raw rewards) or running (each domain's
    rewards become (r - mean_d) / std_d with that domain's running statistics before the advantage
    estimator, so that no domain's reward scale dominates; see megatron_rl/algorithms/calibration.py).
    No effect with advantage_estimator=grpo, which already divides by each group's std."""
    domain_calibration_momentum: float = 0.1
    """Weight of the newest step in a domain's running reward statistics (domain_calibration=running);
    the first 1/momentum updates of a domain are an exact running average (warm-up)."""
    domain_pause_window: int = 0
    """Multi-domain runs: RL steps over which a domain's training reward gain and held-out accuracy
    gain are compared to detect reward hacking; 0 never pauses a domain."""
    domain_pause_min_reward_gain: float = 0.2
    """A domain is paused when its training reward (divided by its task.reward_scale) rose by more
    than this over domain_pause_window steps ..."""
    domain_pause_max_eval_gain: float = 0.02
    """... while its held-out accuracy rose by less than this over the same steps."""

    OVERLONG_MODES: ClassVar[tuple[str, ...]] = ("none", "filter", "penalty")
    DOMAIN_CALIBRATIONS: ClassVar[tuple[str, ...]] = ("none", "running")

    def __post_init__(self) -> None:
        _check_choice("algorithm.advantage_estimator", self.advantage_estimator, self.ADVANTAGE_ESTIMATORS)
        _check_choice("algorithm.policy_loss", self.policy_loss, self.POLICY_LOSSES)
        _check_unit_interval("algorithm.gae_gamma", self.gae_gamma, low_open=False, high_open=False)
        _check_unit_interval("algorithm.gae_lambda", self.gae_lambda, low_open=False, high_open=False)
        _check_choice("algorithm.kl_estimator", self.kl_estimator, self.KL_ESTIMATORS)
        _check_min("algorithm.ref_update_every", self.ref_update_every, 0)
        if self.ref_update_every and self.kl_coef <= 0:
            raise _invalid("algorithm.ref_update_every", self.ref_update_every, "moves the KL's reference "
                           "policy: it needs algorithm.kl_coef > 0")
        if self.kl_in_reward and self.kl_coef <= 0:
            raise _invalid("algorithm.kl_in_reward", self.kl_in_reward, "penalises the reward by kl_coef times the "
                           "KL: it needs algorithm.kl_coef > 0")
        if self.kl_target is not None:
            if not self.kl_in_reward:
                raise _invalid("algorithm.kl_target", self.kl_target, "adapts the KL penalty in the reward: it "
                               "needs algorithm.kl_in_reward=true")
            _check_min("algorithm.kl_target", self.kl_target, 0, strict=True)
        _check_min("algorithm.kl_horizon", self.kl_horizon, 1)
        if self.kl_clamp is not None and self.kl_clamp <= 0:
            raise _invalid("algorithm.kl_clamp", self.kl_clamp, "must be > 0 (verl: 10.0), or null for no bound")
        if self.critic and self.advantage_estimator != "gae":
            raise _invalid("algorithm.critic", self.critic, "a value model is used by advantage_estimator=gae only, "
                           f"not {self.advantage_estimator}: set algorithm.advantage_estimator=gae (algorithm=ppo)")
        _check_min("algorithm.critic_lr", self.critic_lr, 0, strict=True)
        if self.value_clip is not None:
            _check_min("algorithm.value_clip", self.value_clip, 0, strict=True)
        _check_min("algorithm.critic_warmup_steps", self.critic_warmup_steps, 0)
        if self.critic_warmup_steps and not self.critic:
            raise _invalid("algorithm.critic_warmup_steps", self.critic_warmup_steps, "warms up a critic: it needs "
                           "algorithm.critic=true")
        _check_choice("algorithm.loss_agg_mode", self.loss_agg_mode, self.LOSS_AGG_MODES)
        _check_choice("algorithm.old_logprobs", self.old_logprobs, self.OLD_LOGPROBS)
        _check_choice("algorithm.routing_replay", self.routing_replay, self.ROUTING_REPLAYS)
        _check_choice("algorithm.overlong", self.overlong, self.OVERLONG_MODES)
        if self.overlong == "penalty" and self.overlong_penalty_window < 1:
            raise _invalid("algorithm.overlong_penalty_window", self.overlong_penalty_window,
                           "must be >= 1 with overlong=penalty, e.g. a quarter of rollout.max_new_tokens")
        _check_min("algorithm.overlong_penalty", self.overlong_penalty, 0)
        _check_min("algorithm.dynamic_sampling_max_rounds", self.dynamic_sampling_max_rounds, 1)
        _check_min("algorithm.tis_cap", self.tis_cap, 1.0)
        if self.eps_clip_c is not None:
            if self.eps_clip_c <= 1:
                raise _invalid("algorithm.eps_clip_c", self.eps_clip_c, "must be > 1 (typical 3.0) or null")
            if self.policy_loss not in ("ppo_clip", "clip_higher"):
                raise _invalid("algorithm.eps_clip_c", self.eps_clip_c, f"dual clip applies to policy_loss ppo_clip "
                               f"or clip_higher, not {self.policy_loss}")
        _check_choice("algorithm.rollout_is", self.rollout_is, ("token", "sequence", "none"))
        _check_choice("algorithm.rollout_mask", self.rollout_mask, ("none", "token", "sequence", "geometric"))
        if not 0 < self.rollout_mask_low < 1:
            raise _invalid("algorithm.rollout_mask_low", self.rollout_mask_low, "must lie in (0, 1)")
        if self.rollout_mask_high <= 1:
            raise _invalid("algorithm.rollout_mask_high", self.rollout_mask_high, "must be > 1")
        _check_min("algorithm.max_staleness", self.max_staleness, 0)
        if self.loss_agg_mode == "seq_mean_token_sum_norm" and not self.loss_norm_len:
            raise _invalid("algorithm.loss_norm_len", self.loss_norm_len,
                           "loss_agg_mode=seq_mean_token_sum_norm needs a constant length, e.g. rollout.max_new_tokens")
        _check_min("algorithm.eps_clip", self.eps_clip, 0, strict=True)
        _check_min("algorithm.eps_clip_high", self.eps_clip_high, 0, strict=True)
        if self.policy_loss == "clip_higher" and self.eps_clip_high < self.eps_clip:
            raise _invalid(
                "algorithm.eps_clip_high", self.eps_clip_high,
                f"must be >= algorithm.eps_clip={format_value(self.eps_clip)} for policy_loss=clip_higher",
            )
        _check_min("algorithm.kl_coef", self.kl_coef, 0)
        _check_min("algorithm.entropy_coef", self.entropy_coef, 0)
        _check_min("algorithm.num_inner_updates", self.num_inner_updates, 1)
        _check_choice("algorithm.domain_calibration", self.domain_calibration, self.DOMAIN_CALIBRATIONS)
        _check_unit_interval("algorithm.domain_calibration_momentum", self.domain_calibration_momentum,
                             low_open=True, high_open=False)
        _check_min("algorithm.domain_pause_window", self.domain_pause_window, 0)
        _check_min("algorithm.domain_pause_min_reward_gain", self.domain_pause_min_reward_gain, 0)


@dataclass
class TaskConfig:
    """Prompt source and reward of the training task."""

    name: str = "countdown"
    """Display name used in logs and metric names."""
    type: str = "countdown"
    """countdown (generated puzzles), math (generated word problems) or dataset (prompts from `path`)."""
    path: Optional[str] = None
    """Prompt source for type=dataset: a .jsonl or .parquet file, or a directory written by
    Hugging Face datasets' save_to_disk (a DatasetDict's train/test splits are used as such)."""
    eval_path: Optional[str] = None
    """Held-out prompts in any of the same formats; null: the source's test/validation split, or
    else its first num_eval rows."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string, or a list of {role, content} chat messages."""
    answer_key: str = "answer"
    """Column holding the reference answer (rule rewards)."""
    response_key: str = "response"
    """Column holding a full reference response for the warm start (default: \\boxed{answer})."""
    num_train: int = 2000
    """Training prompts generated or read (at most)."""
    max_prompt_tokens: Optional[int] = None
    """Leave out prompts longer than this many tokens (after the chat template), counted in a warning;
    null: keep all. Not for agent tasks (task.max_episode_tokens bounds those)."""
    num_eval: int = 200
    """Held-out evaluation prompts; 0 disables evaluation."""
    seed: int = 0
    """Seed of the prompt generator and of the train/eval split."""
    chat_template: bool = False
    """Render prompts with the tokenizer's chat template (user turn + generation prompt); responses
    then end with the template's end-of-turn token, which also stops generation."""
    system_prompt: Optional[str] = None
    """System message prepended when chat_template=true; for type=agent it replaces the default
    tool instructions (megatron_rl/envs/tools.py)."""
    reward: str = "auto"
    """Verifier: math (final answer, e.g. \\boxed{}, normalised), exact (exact match), countdown
    (expression executed in the sandbox), tests (the row's tests run in the sandbox: passed/total);
    auto: countdown for type=countdown, tests for dataset rows with a `tests` column, else math;
    or your own function, `package.module:function`, called as function(completion, sample) -> float
    with sample = the prompt's dataset row (megatron_rl/rewards/custom.py)."""
    reward_tolerance: float = 1e-6
    """Absolute tolerance of numeric answers (reward=math)."""
    answer_extraction: str = "strict"
    """reward=math: how the final answer is read. strict: the last \\boxed{...}, else the text after the
    last `####`; a response with neither scores 0. last_number: as strict, and else the last number in
    the text, a lenient reading that also rewards numbers that merely come last; the step logs the share
    read that way (reward/last_number_share) beside the share with no formatted answer
    (reward/unformatted_share)."""
    answer_format: str = "boxed"
    """type=math: the answer format each generated question asks for, and its warm-start reference uses:
    boxed (`\\boxed{7}`) or gsm8k (a last line `#### 7`)."""
    math_steps: int = 1
    """type=math: operations per generated word problem (1: `Ann has 3 pens and gets 4 more. How many
    pens does Ann have now?`; more: a chain of gains, losses and boxes bought, each result >= 0)."""
    reward_timeout_s: float = 60.0
    """reward=package.module:function: seconds one call may take once it runs; a late one is no verdict (the
    sample is left unscored), counted in reward/verifier_errors."""
    environment: str = "repo"
    """type=agent: the environment episodes run in (registered in megatron_rl.envs)."""
    generator: str = "repo"
    """type=agent without a path: generated tasks, repo (fix a bug in a small package), function
    (write one function) or countdown (Countdown with feedback, task.environment=countdown); see
    megatron_rl/data/agent_tasks.py."""
    max_turns: int = 6
    """type=agent: model turns per episode at most."""
    max_episode_tokens: int = 1024
    """type=agent: prompt + all turns and observations of an episode, in tokens, at most."""
    episode_wall_time_s: float = 120.0
    """type=agent: wall time of an episode at most (checked between turns)."""
    max_observation_chars: int = 2000
    """type=agent: tool output shown to the model at most (the middle is cut)."""
    pool_refresh_every: int = 0
    """RL steps between environment-pool refreshes: tasks that became trivial (pool_trivial_pass_rate
    over pool_min_samples samples) or scored one response differently twice are retired and their
    slots refilled from the queue (megatron_rl/data/env_pool.py); 0: off."""
    pool_queue: int = 0
    """Generated tasks held in the pool's queue (generated task types; another seed than training)."""
    pool_queue_path: Optional[str] = None
    """Or: a file of tasks for the queue, in the format of task.path."""
    pool_trivial_pass_rate: float = 0.95
    """Pass rate at which a task counts as trivial."""
    pool_min_samples: int = 32
    """Samples of a task needed before it can be called trivial."""
    reward_scale: float = 1.0
    """Multiplier on the verifier's reward (a task whose rewards come on another scale, e.g. points
    0..10); evaluation divides it back out, so held-out accuracy stays in [0, 1]."""

    TYPES: ClassVar[tuple[str, ...]] = ("countdown", "math", "dataset", "agent")
    ANSWER_EXTRACTIONS: ClassVar[tuple[str, ...]] = ("strict", "last_number")
    ANSWER_FORMATS: ClassVar[tuple[str, ...]] = ("boxed", "gsm8k")
    GENERATORS: ClassVar[tuple[str, ...]] = ("repo", "function", "countdown")
    REWARDS: ClassVar[tuple[str, ...]] = ("auto", "math", "exact", "countdown", "tests")

    eval_every: int = 10
    """RL steps between evaluations on the held-out split (0: only at the end)."""
    eval_samples: int = 4
    """Samples per held-out prompt at evaluation (pass@k uses k = this)."""
    eval_temperature: Optional[float] = None
    """Sampling temperature of evaluation (training-time and `python -m megatron_rl.eval`); 0: greedy; null:
    rollout's."""
    eval_top_p: Optional[float] = None
    """Evaluation's top_p; null: rollout.top_p."""
    eval_top_k: Optional[int] = None
    """Evaluation's top_k (1: greedy, with eval_samples=1); null: rollout.top_k."""
    eval_max_new_tokens: Optional[int] = None
    """Evaluation's response length limit; null: rollout.max_new_tokens."""
    sft_warmup_steps: int = 0
    """Supervised steps on the task's reference answers before RL (a warm start; 0: none). Agent
    tasks: on their reference solutions played through the environment and verified."""
    sft_warmup_lr: float = 1e-3
    """Learning rate of the warm start."""

    def __post_init__(self) -> None:
        _check_choice("task.type", self.type, self.TYPES)
        _check_min("task.eval_every", self.eval_every, 0)
        _check_min("task.eval_samples", self.eval_samples, 1)
        if self.eval_temperature is not None:
            _check_min("task.eval_temperature", self.eval_temperature, 0)  # 0: greedy
        if self.eval_top_p is not None:
            _check_unit_interval("task.eval_top_p", self.eval_top_p, low_open=True, high_open=False)
        if self.eval_top_k is not None and self.eval_top_k != -1 and self.eval_top_k < 1:
            raise _invalid("task.eval_top_k", self.eval_top_k, "must be -1 (disabled) or >= 1")
        if self.eval_max_new_tokens is not None:
            _check_min("task.eval_max_new_tokens", self.eval_max_new_tokens, 1)
        _check_min("task.sft_warmup_steps", self.sft_warmup_steps, 0)
        _check_min("task.sft_warmup_lr", self.sft_warmup_lr, 0, strict=True)
        from megatron_rl.rewards.custom import is_reward_path

        custom_reward = is_reward_path(self.reward)  # package.module:function, imported by the run checks
        if not custom_reward:
            _check_choice("task.reward", self.reward, self.REWARDS)
        if self.type == "dataset" and not self.path:
            raise ValueError("task.path=null is invalid for task.type=dataset: set task.path=<file.jsonl|"
                             "file.parquet|saved dataset directory>")
        _check_choice("task.generator", self.generator, self.GENERATORS)
        if self.type == "agent" and self.path is None and (self.generator == "countdown") != (
                self.environment == "countdown"):
            raise _invalid("task.generator", self.generator, "generated countdown tasks run in the countdown "
                           "environment and it plays no other generated tasks: set task.generator and "
                           "task.environment both to countdown, or neither")
        _check_min("task.max_turns", self.max_turns, 1)
        _check_min("task.max_episode_tokens", self.max_episode_tokens, 16)
        _check_min("task.episode_wall_time_s", self.episode_wall_time_s, 0, strict=True)
        _check_min("task.max_observation_chars", self.max_observation_chars, 16)
        _check_min("task.pool_refresh_every", self.pool_refresh_every, 0)
        _check_min("task.pool_queue", self.pool_queue, 0)
        _check_unit_interval("task.pool_trivial_pass_rate", self.pool_trivial_pass_rate, low_open=True,
                             high_open=False)
        _check_min("task.pool_min_samples", self.pool_min_samples, 1)
        allowed = {"countdown": ("auto", "countdown"), "math": ("auto", "math", "exact"),
                   "agent": ("auto",)}.get(
            self.type, ("auto", "math", "exact", "tests"))
        if custom_reward and self.type == "agent":
            raise _invalid("task.reward", self.reward, "agent tasks are scored by their environment "
                           "(task.environment); a reward function serves countdown, math and dataset tasks")
        if self.reward not in allowed and not custom_reward:
            raise _invalid("task.reward", self.reward, f"task.type={self.type} allows {', '.join(allowed)}")
        _check_min("task.reward_tolerance", self.reward_tolerance, 0)
        _check_choice("task.answer_extraction", self.answer_extraction, self.ANSWER_EXTRACTIONS)
        _check_choice("task.answer_format", self.answer_format, self.ANSWER_FORMATS)
        _check_min("task.math_steps", self.math_steps, 1)
        _check_min("task.reward_timeout_s", self.reward_timeout_s, 0, strict=True)
        _check_min("task.reward_scale", self.reward_scale, 0, strict=True)
        _check_min("task.num_train", self.num_train, 1)
        if self.max_prompt_tokens is not None:
            _check_min("task.max_prompt_tokens", self.max_prompt_tokens, 1)
        _check_min("task.num_eval", self.num_eval, 0)
        _check_min("task.seed", self.seed, 0)


@dataclass
class DomainConfig:
    """One domain of a multi-domain joint run (`TrainConfig.domains`): a task set and its share of
    the prompts. The domain's name is its key in `domains`; `weight` is checked by TrainConfig,
    which knows that name."""

    task: TaskConfig = field(default_factory=TaskConfig)
    """The domain's prompts and verifier (its task.reward_scale too). Run-level task settings
    (eval_every, eval_samples, sft_warmup_steps, sft_warmup_lr) are read from the top-level `task`."""
    weight: float = 1.0
    """Mixture weight (> 0): the domain's expected share of each step's prompt groups is
    weight / (sum of the weights of the domains not paused)."""


@dataclass
class SandboxConfig:
    """Isolation runtime for executing model-written code during reward computation."""

    runtime: str = "bwrap"
    """bwrap (bubblewrap namespaces), apptainer (container) or process (NO isolation)."""
    address: Optional[str] = None
    """host:port of a remote sandbox service; null runs sandboxes locally."""
    num_workers: int = 2
    """Concurrent sandboxed executions."""
    allow_unisolated: bool = False
    """Explicit opt-in required for runtime=process, which runs untrusted code unsandboxed."""

    RUNTIMES: ClassVar[tuple[str, ...]] = ("bwrap", "apptainer", "process")

    def __post_init__(self) -> None:
        _check_choice("sandbox.runtime", self.runtime, self.RUNTIMES)
        if self.runtime == "process" and not self.allow_unisolated:
            raise ValueError(
                "sandbox.runtime=process is invalid without sandbox.allow_unisolated=true: it runs "
                "model-written code with no isolation; use sandbox=bwrap or sandbox=apptainer, "
                "or pass sandbox.allow_unisolated=true to accept the risk"
            )
        _check_min("sandbox.num_workers", self.num_workers, 1)


@dataclass
class ClusterConfig:
    """How processes are launched and which device they use."""

    launcher: str = "local"
    """local (this command spawns the ranks), torchrun or slurm."""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu or cuda."""
    nproc: int = 1
    """Processes the local launcher starts."""
    master_port: Optional[int] = None
    """Rendezvous port; null picks a free one."""

    LAUNCHERS: ClassVar[tuple[str, ...]] = ("local", "torchrun", "slurm")
    DEVICES: ClassVar[tuple[str, ...]] = ("auto", "cpu", "cuda")

    def __post_init__(self) -> None:
        _check_choice("cluster.launcher", self.launcher, self.LAUNCHERS)
        _check_choice("cluster.device", self.device, self.DEVICES)
        _check_min("cluster.nproc", self.nproc, 1)
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise _invalid(
                "cluster.master_port", self.master_port, "must lie in [1, 65535] or be null (pick a free port)"
            )


@dataclass
class LoggingConfig:
    """Log verbosity and metric sinks."""

    level: str = "INFO"
    """Python log level on rank 0: DEBUG, INFO, WARNING or ERROR."""
    tensorboard: bool = True
    """Write metrics to TensorBoard under run_dir."""
    wandb: bool = False
    """Also send metrics to Weights & Biases (needs `pip install -e '.[wandb]'`; WANDB_MODE=offline
    on clusters without internet access)."""
    wandb_project: str = "megatron-rl"
    """W&B project."""
    wandb_entity: Optional[str] = None
    """W&B entity (team or user); null: the account's default."""
    wandb_name: Optional[str] = None
    """W&B run name; null: the run directory's name."""
    log_every: int = 10
    """Steps between the one-line console summaries (the first and the last step always have one);
    metrics.jsonl and TensorBoard get every step."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    audit_every: int = 0
    """RL steps between reward audits: the step's top trajectories with shortcut flags to
    run_dir/audit/ (megatron_rl/rewards/audit.py); 0: off."""
    audit_samples: int = 8
    """Trajectories written per audit."""
    trace_every: int = 0
    """RL steps between Chrome traces of a step's timeline (phases, generation batches, environment
    waits) in run_dir/traces/ (open in https://ui.perfetto.dev); 0: off."""
    dump_rollouts: bool = False
    """Write every RL step's samples (tokens, engine log-probs, rewards, statuses, decoded text) to
    run_dir/rollouts/step_<k>.jsonl, for reading and for rollout.replay_dir."""

    LEVELS: ClassVar[tuple[str, ...]] = ("DEBUG", "INFO", "WARNING", "ERROR")

    def __post_init__(self) -> None:
        _check_choice("logging.level", self.level, self.LEVELS)
        _check_min("logging.log_every", self.log_every, 1)
        _check_min("logging.audit_every", self.audit_every, 0)
        _check_min("logging.audit_samples", self.audit_samples, 1)
        _check_min("logging.trace_every", self.trace_every, 0)


@dataclass
class CheckpointConfig:
    """Training checkpoints under run_dir/checkpoints and HF exports under run_dir/hf."""

    save_every: int = 0
    """Optimizer steps between training checkpoints; 0 saves only at the end (see save_at_end)."""
    save_at_end: bool = True
    """Write a checkpoint after the last step."""
    keep_last: int = 2
    """How many of the most recent checkpoints to keep."""
    keep_every: Optional[int] = None
    """Also keep every checkpoint whose step is a multiple of this (null: none)."""
    keep_best: int = 0
    """Also keep the checkpoints with the best best_metric, this many (0: none); checkpoints/best names the
    best one (`--checkpoint best` of megatron_rl.export / megatron_rl.eval)."""
    best_metric: str = "eval/accuracy"
    """keep_best: a metric of the step a checkpoint is saved after (metrics.jsonl)."""
    best_mode: str = "max"
    """keep_best: max (higher is better) or min."""
    resume: bool = True
    """Resume from run_dir/checkpoints when it holds a complete checkpoint."""
    hf_export_every: int = 0
    """Optimizer steps between HF safetensors exports; 0 never exports periodically."""
    hf_export_at_end: bool = False
    """Export an HF checkpoint after the last step."""
    hf_max_shard_size: str = "5GB"
    """Largest safetensors shard of an HF export (e.g. 5GB, 500MB)."""

    def __post_init__(self) -> None:
        _check_min("checkpoint.save_every", self.save_every, 0)
        _check_min("checkpoint.keep_last", self.keep_last, 1)
        if self.keep_every is not None:
            _check_min("checkpoint.keep_every", self.keep_every, 1)
        _check_min("checkpoint.hf_export_every", self.hf_export_every, 0)
        _check_min("checkpoint.keep_best", self.keep_best, 0)
        _check_choice("checkpoint.best_mode", self.best_mode, ("max", "min"))
        if self.keep_best and self.save_every < 1:
            raise _invalid("checkpoint.keep_best", self.keep_best, "chooses among periodic checkpoints: set "
                           "checkpoint.save_every >= 1")


@dataclass
class TrainConfig:
    """Top-level configuration of one training run (SFT or RL)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model architecture or checkpoint."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Megatron parallel layout."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation engine and sampling (mode=rl)."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator and policy loss (mode=rl)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Prompts and rewards."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Code-execution sandbox for rewards."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Launcher and device."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Logging and metric sinks."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Training checkpoints, resume and HF exports."""
    run_dir: str = "runs/${now:%Y%m%d-%H%M%S}"
    """Output directory (checkpoints, metrics); created by the trainer after validation, never by Hydra."""
    seed: int = 1234
    """Global seed for data order, sampling and dropout."""
    num_steps: int = 100
    """Optimizer steps to train."""
    global_batch_size: int = 64
    """Sequences per optimizer step, summed over data-parallel ranks."""
    micro_batch_tokens: int = 2048
    """Token budget of one packed micro-batch on one rank."""
    deterministic: bool = True
    """Use deterministic kernels and fixed reduction order (bitwise reproducible runs)."""
    mode: str = "rl"
    """rl (rollouts + policy-gradient update; an optional supervised warm start, task.sft_warmup_steps)
    or sft (supervised fine-tuning on the task's references alone)."""
    domains: dict[str, DomainConfig] = field(default_factory=dict)
    """Multi-domain joint RL: {name: {task: ..., weight: ...}} with >= 2 entries; prompts of every
    domain are mixed by weight, and `task` only gives the run-level settings. Empty: a single-task
    run on `task`. See docs/rl.md, "Multi-domain joint training"."""

    MODES: ClassVar[tuple[str, ...]] = ("sft", "rl")

    def __post_init__(self) -> None:
        _check_choice("mode", self.mode, self.MODES)
        if not self.run_dir:
            raise _invalid("run_dir", self.run_dir, "must be a non-empty directory path")
        _check_min("seed", self.seed, 0)
        _check_min("num_steps", self.num_steps, 1)
        _check_min("global_batch_size", self.global_batch_size, 1)
        _check_min("micro_batch_tokens", self.micro_batch_tokens, 1)
        self._check_domains()
        if self.rollout.weight_sync == "adapters" and not self.model.lora_rank:
            raise _invalid("rollout.weight_sync", self.rollout.weight_sync, "the model trains no LoRA adapters "
                           "(model.lora_rank=0): set model.lora_rank > 0 or rollout.weight_sync=full")
        if self.rollout.weight_sync == "adapters" and self.model.expert_lora_targets:
            raise _invalid("rollout.weight_sync", self.rollout.weight_sync, "engines get adapters on experts "
                           f"merged only (model.lora_targets has {', '.join(self.model.expert_lora_targets)}): "
                           "adapter syncs carry the attention's and dense MLPs' adapters, not yet the experts' "
                           "(transformers fuses a layer's routed experts into one tensor, which per-module PEFT "
                           "adapters do not address); use rollout.weight_sync=full")
        if self.rollout.weight_sync == "adapters" and self.model.moe_router_bias_update_rate:
            raise _invalid("rollout.weight_sync", self.rollout.weight_sync, "adapter syncs send the routers' "
                           "selection bias with the base weights only, but model.moe_router_bias_update_rate="
                           f"{format_value(self.model.moe_router_bias_update_rate)} moves it every step: use "
                           "rollout.weight_sync=full or model.moe_router_bias_update_rate=0")
        if self.algorithm.critic and self.algorithm.critic_warmup_steps >= self.num_steps:
            raise _invalid("algorithm.critic_warmup_steps", self.algorithm.critic_warmup_steps,
                           f"must be < num_steps={self.num_steps}, or the policy never learns")
        ckpt = self.checkpoint
        if ckpt.keep_best and self.mode == "sft" and ckpt.best_metric.startswith("eval"):
            raise _invalid("checkpoint.best_metric", ckpt.best_metric, "SFT logs its held-out loss at the last step "
                           "only: choose by a per-step metric, e.g. checkpoint.best_metric=loss best_mode=min")
        if ckpt.keep_best and self.mode == "rl" and ckpt.best_metric.startswith("eval/") and (
                self.task.eval_every < 1 or ckpt.save_every % self.task.eval_every):
            raise _invalid("checkpoint.save_every", ckpt.save_every, f"with checkpoint.best_metric={ckpt.best_metric} "
                           f"must be a multiple of task.eval_every={self.task.eval_every} (>= 1): a checkpoint "
                           "carries the metrics of the step it is saved after")

    def _check_domains(self) -> None:
        algo = self.algorithm
        if not self.domains:
            for key, value, off in (("domain_calibration", algo.domain_calibration, "none"),
                                    ("domain_pause_window", algo.domain_pause_window, 0)):
                if value != off:
                    raise _invalid(f"algorithm.{key}", value, "needs a multi-domain run: set domains "
                                   f"(e.g. +experiment=joint_countdown_math) or algorithm.{key}={format_value(off)}")
            return
        if len(self.domains) < 2:
            raise _invalid("domains", ",".join(self.domains), "a joint run needs >= 2 domains; for one task "
                           "set task=<task> and domains={}")
        if self.mode != "rl":
            raise _invalid("mode", self.mode, "domains are mixed by the RL loop only; set mode=rl or domains={}")
        for name, domain in self.domains.items():
            if not name.replace("_", "").replace("-", "").isalnum():
                raise _invalid(f"domains.{name}", name, "a domain name (used in metric names) may hold only "
                               "letters, digits, _ and -")
            if not domain.weight > 0:
                raise _invalid(f"domains.{name}.weight", domain.weight, "must be > 0 (drop the domain instead)")
            if algo.domain_pause_window and domain.task.num_eval < 1:
                raise _invalid(f"domains.{name}.task.num_eval", domain.task.num_eval,
                               "pausing (algorithm.domain_pause_window > 0) judges each domain by its held-out "
                               "accuracy: set it >= 1, or algorithm.domain_pause_window=0")
        if algo.domain_pause_window and self.task.eval_every < 1:
            raise _invalid("task.eval_every", self.task.eval_every, "pausing needs evaluations during the run: "
                           "set task.eval_every >= 1 (<= algorithm.domain_pause_window), or "
                           "algorithm.domain_pause_window=0")


SCHEMAS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "optimizer": OptimizerConfig,
    "rollout": RolloutConfig,
    "algorithm": AlgorithmConfig,
    "task": TaskConfig,
    "sandbox": SandboxConfig,
    "cluster": ClusterConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
}
"""Config group -> schema; each is stored as ``<group>/base_<group>``."""


def _model_schema_node() -> ModelConfig:
    # OmegaConf's merge never lets ``???`` replace an existing value, so a checkpoint model's
    # ``path: ???`` would silently stay ``None`` (random init) if any layer below it had the
    # Python default. The stored schemas therefore leave model.path missing; every model
    # option must say ``path: null`` (build from fields) or ``path: ???`` (user must give it).
    return ModelConfig(path=MISSING)


def register_schemas() -> None:
    """Store ``base_config`` and one ``base_<group>`` per group in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=TrainConfig(model=_model_schema_node()))
    for group, schema in SCHEMAS.items():
        node = _model_schema_node() if group == "model" else schema
        cs.store(group=group, name=f"base_{group}", node=node)


register_schemas()
