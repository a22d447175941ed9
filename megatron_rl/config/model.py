"""The model group (`model.*`): `ModelConfig`, the decoder's architecture or the HF checkpoint to load.
Family-dependent switches and checks come from the family's spec (megatron_rl/families/).

Each dataclass checks its own fields in ``__post_init__`` (see megatron_rl/config/schema.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from megatron_rl.checks import check_choice as _check_choice
from megatron_rl.checks import check_min as _check_min
from megatron_rl.checks import divisors_str as _divisors_str
from megatron_rl.checks import format_value
from megatron_rl.checks import invalid as _invalid
from megatron_rl.config.common import BUILTIN_TOKENIZERS, _names
from megatron_rl.families import FAMILIES, FamilySpec, family_spec


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

    @property
    def context_length(self) -> int:
        """The longest sequence (prompt and response) the model is meant to run: max_position_embeddings, or with
        YaRN the scaled pre-training context (original_max_position_embeddings x factor) where that is longer, as
        vLLM and SGLang derive it: Qwen's YaRN recipe adds rope_scaling to config.json and leaves
        max_position_embeddings at the pre-training 32768."""
        if self.rope_scaling_factor and self.yarn:
            scaled = int(self.rope_scaling_original_max_position_embeddings * self.rope_scaling_factor)
            return max(self.max_position_embeddings, scaled)
        return self.max_position_embeddings

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
                               "no YaRN scaling here; it is supported for "
                               f"{_names(lambda f: 'yarn' in f.rope_scalings)}")
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
