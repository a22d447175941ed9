"""The rollout group (`rollout.*`): engine, sampling, colocation and disaggregated settings.

Each dataclass checks its own fields in ``__post_init__`` (see megatron_rl/config/schema.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from megatron_rl.checks import check_choice as _check_choice
from megatron_rl.checks import check_min as _check_min
from megatron_rl.checks import format_value
from megatron_rl.checks import invalid as _invalid
from megatron_rl.config.common import _check_unit_interval


@dataclass
class RolloutConfig:
    """Generation engine and sampling parameters for RL rollouts."""

    backend: str = "auto"
    """Engine: sglang (server, time-shared with training), hf (transformers generate, in-process; slow, for CPU
    and tests) or auto: sglang when the job runs on GPUs (cluster.device=cuda, or auto on a machine with an
    NVIDIA GPU), hf otherwise. Resolved when the config is typed; the run's config.yaml holds the choice."""
    tp: int = 1
    """Tensor-parallel size of one rollout engine."""
    temperature: float = 1.0
    """Sampling temperature (log-probs are computed at this temperature); 0: greedy decoding (argmax, as in SGLang
    and vLLM), its log-probs at temperature 1."""
    top_p: float = 1.0
    """Nucleus-sampling mass in (0, 1]; 1 disables it."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    max_new_tokens: int = 4096
    """Longest response generated per sample (a prompt plus this must fit micro_batch_tokens and
    model.max_position_embeddings)."""
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
    weight_sync_bucket_mb: float = 256.0
    """Size of a weight-sync bucket in MiB (the last tensor that starts a bucket may take it past this): an engine in
    another process (sglang) or a generator (disaggregated mode) receives the weights a bucket at a time, and a
    delta sync (weight_sync_delta) skips whole buckets, so smaller buckets skip more of a model that changes in
    places, at more round trips per sync."""
    weight_sync_delta: bool = False
    """mode=disaggregated: publish only the weight buckets whose bytes changed since the generators' last version
    (each bucket's BLAKE2b digest against the one every generator acknowledged; an unchanged bucket is announced,
    not broadcast). Pays when most weights stay put between steps: LoRA with weight_sync=full (the merged weights
    of un-adapted modules), frozen layers. Full fine-tuning changes every bucket each step, so it only adds the
    hashing; hence off by default. Checksums are verified either way (docs/rollout.md, "Delta weight sync")."""
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

    BACKENDS: ClassVar[tuple[str, ...]] = ("auto", "sglang", "hf")
    AGENT_SCHEDULERS: ClassVar[tuple[str, ...]] = ("lockstep", "async")
    LOG_LEVELS: ClassVar[tuple[str, ...]] = ("debug", "info", "warning", "error")
    MODES: ClassVar[tuple[str, ...]] = ("colocated", "disaggregated")
    WEIGHT_SYNCS: ClassVar[tuple[str, ...]] = ("full", "adapters")

    def __post_init__(self) -> None:
        _check_choice("rollout.backend", self.backend, self.BACKENDS)
        _check_choice("rollout.mode", self.mode, self.MODES)
        _check_choice("rollout.weight_sync", self.weight_sync, self.WEIGHT_SYNCS)
        _check_min("rollout.weight_sync_bucket_mb", self.weight_sync_bucket_mb, 0, strict=True)
        if not isinstance(self.weight_sync_delta, bool):
            raise _invalid("rollout.weight_sync_delta", self.weight_sync_delta, "must be true or false")
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
                                    ("partial_rollout_tokens", self.partial_rollout_tokens, 0),
                                    ("weight_sync_delta", self.weight_sync_delta, False)):
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
