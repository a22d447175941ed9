"""The `sglang` rollout backend: SGLang 0.5.x behind the `RolloutEngine` protocol.

Two ways to reach an engine, same protocol:

- offline (`model_path` set): this process starts `sglang.Engine(...)` (the colocated GPU
  path: one engine per block of `tp_size` GPUs starting at `base_gpu_id`, memory saver on);
- attach (`base_url` set): an SGLang HTTP server that is already running (started by
  `python -m sglang.launch_server`, see `server_command`); this process is only a client and
  never stops it.

Semantics this adapter pins down (docs/rollout.md; tests/integration/test_sglang_engine.py checks
them against a real engine on CPU):

- Log-probs: SGLang reports log(softmax(logits / temperature)) of the sampled token, before
  top-p/top-k truncation: the protocol's definition. Exception: a batch in which *every*
  request is greedy (top_k=1, or temperature < 1e-6) takes SGLang's greedy path, which reports
  log_softmax(logits) at temperature 1. With top_k=1 use temperature=1 for exact semantics.
- Seeds: `SamplingParams.seed` becomes one `sampling_seed` per sample (derived from seed,
  prompt and sample index). SGLang honours it only when the engine runs with
  `enable_deterministic_inference=True`, which needs a CUDA attention backend (flashinfer,
  fa3, triton); elsewhere the sampler uses the scheduler RNG, seeded once by `random_seed`.
- Weight updates: SGLang >= 0.5.23 accepts `update_weights_from_tensor` only between
  `begin_weight_update()` and `end_weight_update()`; the adapter opens the session at the
  first bucket and closes it after the bucket with `flush=True` (which also flushes the
  prefix cache and stamps the version). Buckets travel as one `FlattenedTensorBucket` per
  call, serialized once per SGLang TP rank: CUDA tensors as CUDA-IPC handles (no copy), CPU
  tensors through shared memory. Either way the engine must be on the same machine.
- Tied embeddings: weight sync leaves a tied lm_head out (the embedding is the head). SGLang's
  Llama, Qwen2, Qwen3 and DeepSeek classes tie it again; its other MoE classes (Qwen3-MoE,
  Qwen2-MoE, Mixtral, GLM-4.5, gpt-oss) ignore `tie_word_embeddings` and keep an lm_head of their
  own, which nothing would fill: for those (`needs_head_copy`) every bucket holding the embedding
  carries it as `lm_head.weight` too.
- LoRA adapters (`update_adapters`, `rollout.weight_sync=adapters`): SGLang's LoRA serving, started with
  `enable_lora` (the rollout factory sets it and the adapter's rank and modules). Each update loads the
  adapters from tensors under a new name (`policy-<engine id>-<load>-v<version>`, as a PEFT adapter: the same
  flattened bucket per TP rank), unloads the previous one and stamps the version (an attached server's last
  adapter is unloaded at shutdown); every request then names the newest
  (`lora_path`), so SGLang computes W x + (alpha / r) B A x on the base weights it holds.
- Memory: `release_memory`/`resume_memory` map to SGLang's `release_memory_occupation` /
  `resume_memory_occupation` with the same tags. Real release needs torch_memory_saver (CUDA);
  on CPU the calls are accepted and change nothing, so the order is still exercised. A release
  first waits for the scheduler to be idle (a flush with a timeout): SGLang answers the last
  request of a batch before its scheduler retires the batch, and a release that arrives in
  between fails an assertion that ends the scheduler process (seen once in CI).
- Pause: new `generate` calls are refused, this adapter's in-flight calls finish, then the
  engine itself is paused (`pause_generation(mode="retract")`): requests from other clients
  wait and their KV cache can be flushed by a weight update.

Only this module and sglang_transport.py (how it reaches SGLang: in-process or over HTTP) import sglang,
lazily: `import megatron_rl.rollout.sglang_engine` works
without it, and attach mode needs sglang only for weight updates (tensor serialization).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import uuid
from typing import Any, ClassVar, Iterable, Optional, Sequence

import torch

from megatron_rl.rollout.base import ALL_TAGS, TAG_WEIGHTS, Generation, SamplingParams
from megatron_rl.rollout.base import EngineStateError
from megatron_rl.rollout.sglang_transport import HTTPTransport, OfflineTransport, Transport, import_sglang

logger = logging.getLogger(__name__)

_FINISH_REASONS = ("stop", "length", "abort")  # SGLang's finish_reason types = the protocol's
_SEED_STRIDE = 1_000_003  # prime: distinct (seed, prompt, sample) -> distinct sampling_seed
IDLE_WAIT_S = 60.0  # release_memory: the longest wait for the scheduler to retire its last batch
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def needs_head_copy(model_cfg: Any, pp_size: int = 1) -> bool:
    """Whether SGLang's class for this model keeps an lm_head of its own although the model ties it to the
    embedding (module docstring): weight updates must then send the embedding as the head too. Under SGLang's
    own pipeline parallelism (`pp_size` > 1, a server argument) no class ties it."""
    # FamilySpec.sglang_ties_embeddings: SGLang's (0.5.23) class ties lm_head to the embedding itself (at pp_size 1)
    return bool(model_cfg.tie_word_embeddings) and (not model_cfg.spec.sglang_ties_embeddings or pp_size > 1)


def with_head_copy(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """A bucket, plus the embedding as `lm_head.weight` when it holds the embedding (`needs_head_copy`)."""
    out = list(named_tensors)
    out += [(HEAD, t) for name, t in named_tensors if name == EMBEDDING]
    return out


@dataclasses.dataclass
class SGLangEngineConfig:
    """How to start (offline) or reach (attach) one SGLang engine. Field names are SGLang's
    own `ServerArgs` names; anything else SGLang accepts goes in `server_args`."""

    model_path: Optional[str] = None
    """HF checkpoint directory: start an engine in this process (offline mode)."""
    base_url: Optional[str] = None
    """URL of a running SGLang HTTP server, e.g. http://127.0.0.1:30000 (attach mode)."""
    device: str = "cuda"
    """cuda or cpu. cpu selects SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1), torch_native
    attention, pytorch sampling and no CUDA graphs unless `server_args` says otherwise."""
    tp_size: int = 1
    """GPUs (SGLang TP ranks) of this engine."""
    base_gpu_id: int = 0
    """First GPU of the engine's block of tp_size GPUs (all GPUs are visible to every rank)."""
    dtype: str = "auto"
    """Weight and activation dtype (SGLang's names: auto, float32, bfloat16, float16)."""
    mem_fraction_static: Optional[float] = None
    """Share of GPU memory for weights and KV cache; None lets SGLang choose."""
    enable_memory_saver: Optional[bool] = None
    """torch_memory_saver, needed for real release_memory; None means on for cuda, off for cpu."""
    random_seed: int = 0
    """Seed of the scheduler's RNG (all sampling without deterministic inference)."""
    weight_version: int = 0
    """Version reported for the weights the engine starts with."""
    skip_tokenizer_init: bool = True
    """Token ids in and out: the engine never loads or runs a tokenizer. False: it loads one (from
    model_path, or server_args' tokenizer_path), which stop strings need (SGLang matches them on the
    detokenized text); ids still go in and out. Attach mode: whether the server has one."""
    log_level: str = "error"
    """SGLang's own log level."""
    server_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Any other SGLang ServerArgs field (chunked_prefill_size, max_total_tokens,
    enable_deterministic_inference, ...); overrides the values above."""
    request_timeout_s: float = 3600.0
    """Attach mode: HTTP timeout of one call (a generate call waits for all its samples)."""
    routing_layout: Optional[tuple[int, tuple[int, ...], int]] = None
    """A mixture of experts whose routing generations may return (SamplingParams.return_routing): (the model's
    layers, the indices of those with experts, top k). SGLang's `routed_experts` holds every layer's; the
    engine must run with enable_return_routed_experts (the rollout factory sets both)."""
    head_copy: bool = False
    """Weight updates send the embedding as `lm_head.weight` too (`needs_head_copy`: a tied model whose
    SGLang class keeps a head of its own)."""
    eos_token_ids: tuple[int, ...] = ()
    """The end-of-sequence ids the engine stops at (the run's tokenizer's eos), besides a request's
    stop_token_ids: a sample whose last allowed token is one of them finished, though SGLang says "length"."""

    DEVICES: ClassVar[tuple[str, ...]] = ("cuda", "cpu")

    def __post_init__(self) -> None:
        if (self.model_path is None) == (self.base_url is None):
            raise ValueError(f"SGLangEngineConfig needs exactly one of model_path (start an engine) and "
                             f"base_url (attach to a server); got model_path={self.model_path!r}, "
                             f"base_url={self.base_url!r}")
        if self.device not in self.DEVICES:
            raise ValueError(f"device={self.device!r}; allowed: {', '.join(self.DEVICES)}")
        if self.tp_size < 1 or self.base_gpu_id < 0:
            raise ValueError(f"tp_size={self.tp_size} must be >= 1 and base_gpu_id={self.base_gpu_id} >= 0")

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `sglang.Engine` (= ServerArgs) for this config (offline mode)."""
        assert self.model_path is not None
        kwargs: dict[str, Any] = dict(
            model_path=self.model_path, tp_size=self.tp_size, dtype=self.dtype,
            random_seed=self.random_seed, weight_version=str(self.weight_version),
            skip_tokenizer_init=self.skip_tokenizer_init, log_level=self.log_level,
        )
        if self.device == "cpu":
            # The CPU engine's kernels: no flashinfer/triton/CUDA graphs, nothing to warm up.
            kwargs.update(device="cpu", attention_backend="torch_native", sampling_backend="pytorch",
                          disable_cuda_graph=True, skip_server_warmup=True)
        else:
            kwargs.update(base_gpu_id=self.base_gpu_id)
        memory_saver = self.device == "cuda" if self.enable_memory_saver is None else self.enable_memory_saver
        kwargs["enable_memory_saver"] = memory_saver
        if self.mem_fraction_static is not None:
            kwargs["mem_fraction_static"] = self.mem_fraction_static
        kwargs.update(self.server_args)
        if self.device == "cpu" and kwargs.get("enable_lora"):
            kwargs.setdefault("lora_backend", "torch_native")  # SGLang's other LoRA backends are GPU kernels
        return kwargs


def server_command(config: SGLangEngineConfig, model_path: str, host: str = "127.0.0.1",
                   port: int = 30000, python: str = "python") -> list[str]:
    """The `python -m sglang.launch_server` command line of the server that attach mode expects:
    the same arguments as the offline engine of `config`, as CLI flags (a list one token per item, a dict as
    JSON)."""
    kwargs = dataclasses.replace(config, model_path=model_path, base_url=None).engine_kwargs()
    argv = [python, "-m", "sglang.launch_server", "--host", host, "--port", str(port)]
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):  # SGLang's list flags take one token per item (nargs)
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return argv


def serialize_bucket(named_tensors: Sequence[tuple[str, torch.Tensor]], num_copies: int = 1,
                     as_text: bool = False, keep_alive: Optional[list] = None) -> list[Any]:
    """`load_format="flattened_bucket"` payloads: the tensors (all on one device) flattened into
    one buffer plus metadata, pickled `num_copies` times (one per SGLang TP rank: each rank
    opens its own copy, so CUDA-IPC reference counts drop after every load). CUDA tensors travel
    as IPC handles, CPU tensors as shared memory; torch keeps the buffer alive until the
    receiver has opened it (CUDA IPC); a CPU buffer must outlive the receiver's load: pass a list
as `keep_alive` and hold it until then. `as_text` base64-encodes for HTTP. Imports sglang
(seconds, once)."""
    import_sglang()
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    if any(t.is_cuda for _, t in named_tensors):
        # CUDA IPC handles name the GPU by UUID, not by this process's index (which differs from the engine's
        # under another CUDA_VISIBLE_DEVICES or per-task GPU binding), as SGLang's own senders do (its
        # receivers accept both); idempotent. Not for CPU tensors, whose pickling the patch does not handle.
        monkey_patch_torch_reductions()

    bucket = FlattenedTensorBucket(named_tensors=[(n, t.detach()) for n, t in named_tensors])
    payload = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    if keep_alive is not None:
        keep_alive.append(payload["flattened_tensor"])
    return [MultiprocessingSerializer.serialize(payload, output_str=as_text) for _ in range(num_copies)]


def block_payload(named_tensors: list[tuple[str, torch.Tensor]], as_text: bool = False,
                  head_copy: bool = False) -> tuple[Any, list]:
    """One training rank's copy of a bucket for its block leader's engine (`rollout.spmd`):
    (the payload for the SGLang TP rank on this rank's device, the buffer to keep alive until
    the engine has loaded it). CPU tensors are shared through named files: the engine's
    scheduler is not a child of this rank, and the default file-descriptor hand-over only
    works with our own children. `head_copy`: as `SGLangEngineConfig.head_copy`."""
    if head_copy:
        named_tensors = with_head_copy(named_tensors)
    if any(not t.is_cuda for _, t in named_tensors):
        torch.multiprocessing.set_sharing_strategy("file_system")
    keep: list = []
    return serialize_bucket(named_tensors, 1, as_text, keep_alive=keep)[0], keep


def routing_from_meta(meta: dict[str, Any], rows: int, layout: tuple[int, tuple[int, ...], int]) -> torch.Tensor:
    """A request's `Generation.routing` [rows, MoE layers, k] int16 from SGLang's meta_info["routed_experts"]:
    base64 of int32 [prompt + output - 1, every layer, k] (sglang/srt/state_capturer/routed_experts.py, the
    detokenizer's _b64_encode_per_request); an aborted request's may run past the tokens it kept."""
    import base64

    import numpy as np

    encoded = meta.get("routed_experts")
    if encoded is None:
        raise RuntimeError(f"SGLang returned no routed_experts for request {meta.get('id')}: start the engine with "
                           "enable_return_routed_experts")
    num_layers, sparse, topk = layout
    found = np.frombuffer(base64.b64decode(encoded), dtype=np.int32).reshape(-1, num_layers, topk)
    if found.shape[0] < rows:
        raise RuntimeError(f"SGLang's routed_experts cover {found.shape[0]} tokens of request {meta.get('id')}, "
                           f"its prompt and output need {rows}")
    return torch.from_numpy(found[:rows, list(sparse)].astype(np.int16))


class SGLangEngine:
    """`RolloutEngine` over one SGLang engine (offline) or server (attach)."""

    concurrent_generate: ClassVar[bool] = True
    """`generate` may be called from several threads at once (the scheduler batches them)."""

    def __init__(self, config: SGLangEngineConfig) -> None:
        self.config = config
        self._transport: Transport = (OfflineTransport(config) if config.model_path is not None
                                       else HTTPTransport(config))
        self.weight_version = _parse_version(self._transport.weight_version(), default=config.weight_version)
        self._deterministic = bool(self._transport.server_info().get("enable_deterministic_inference"))
        self._released: set[str] = set()
        self._paused = False
        self._in_weight_update = False
        self._lora: Optional[str] = None  # the loaded LoRA adapter's name (update_adapters)
        # adapter names of this engine object alone: an attached server outlives runs, and a resumed run
        # repeats versions, which SGLang would refuse as a name already loaded
        self._lora_prefix, self._lora_loads = f"policy-{uuid.uuid4().hex[:8]}", 0
        self._in_flight = 0
        self._idle = threading.Condition()
        self._warned: set[str] = set()

    # -- generation -----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        with self._idle:
            if self._paused:
                raise EngineStateError("generate while paused: resume() first")
            if self._released:
                raise EngineStateError(f"generate while memory is released ({sorted(self._released)}): "
                                       "resume_memory first")
            self._in_flight += 1
        try:
            return self._generate(prompts, params)
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    def _generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        if not prompts:
            return []
        self._warn_about(params)
        input_ids, sampling_params, prompt_index = [], [], []
        for i, prompt in enumerate(prompts):
            for j in range(params.n):  # one request per sample: per-sample seeds, prompt-major order
                input_ids.append([int(t) for t in prompt])
                sampling_params.append(self._sampling_params(params, i, j))
                prompt_index.append(i)
        if params.return_routing and self.config.routing_layout is None:
            raise ValueError("return_routing: this SGLang engine has no routing_layout (a mixture of experts "
                             "started with enable_return_routed_experts)")
        outputs = self._transport.generate(input_ids, sampling_params, return_routed_experts=params.return_routing,
                                           lora=self._lora)
        if len(outputs) != len(input_ids):
            raise RuntimeError(f"SGLang returned {len(outputs)} outputs for {len(input_ids)} requests")
        stops = frozenset(params.stop_token_ids) | frozenset(self.config.eos_token_ids)
        generations = [self._to_generation(out, idx, stops) for out, idx in zip(outputs, prompt_index)]
        if params.return_routing:
            for gen, out, ids in zip(generations, outputs, input_ids):
                gen.routing = routing_from_meta(out["meta_info"], len(ids) + len(gen.output_ids) - 1,
                                                self.config.routing_layout)
        return generations

    def _sampling_params(self, params: SamplingParams, prompt: int, sample: int) -> dict[str, Any]:
        if params.stop and self.config.skip_tokenizer_init:
            raise ValueError(f"stop strings {params.stop}: this SGLang engine runs without a tokenizer "
                             "(skip_tokenizer_init) and cannot match them; start it with one (the rollout factory "
                             "does when rollout.stop is set) or use stop token ids")
        sp: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                              "max_new_tokens": params.max_new_tokens, "n": 1}
        if params.stop:  # matched on the detokenized text; the response ends at the token completing one
            sp["stop"] = list(params.stop)
        if params.stop_token_ids:
            sp["stop_token_ids"] = list(params.stop_token_ids)
        if params.seed is not None:
            sp["sampling_seed"] = ((params.seed * _SEED_STRIDE + prompt) * _SEED_STRIDE + sample) % (2 ** 63)
        return sp

    def _to_generation(self, out: dict[str, Any], prompt_index: int, stops: frozenset[int]) -> Generation:
        meta = out["meta_info"]
        reason = (meta.get("finish_reason") or {"type": "abort"})["type"]
        if reason not in _FINISH_REASONS:
            raise RuntimeError(f"SGLang finish_reason {meta.get('finish_reason')!r} is not one of "
                               f"{list(_FINISH_REASONS)}")
        output_ids = [int(t) for t in out["output_ids"]]
        entries = meta.get("output_token_logprobs") or []  # [logprob, token_id, text-or-None]
        # An aborted request may stop between emitting a token and its log-prob: keep the prefix
        # that has both.
        if reason == "abort":
            output_ids = output_ids[:len(entries)]
            entries = entries[:len(output_ids)]
        if [int(e[1]) for e in entries] != output_ids:
            raise RuntimeError(f"SGLang log-probs do not line up with the output tokens "
                               f"(request {meta.get('id')}): {len(entries)} log-probs, {len(output_ids)} tokens")
        if reason == "length" and output_ids and output_ids[-1] in stops:
            # SGLang checks max_new_tokens before the stop tokens (Req.check_finished in managers/schedule_batch.py):
            # a sample whose eos is its last allowed token ended, as the hf engine reports it; called "length", it
            # would be continued past its eos by partial rollouts and dropped as truncated by the overlong filter
            reason = "stop"
        version = _parse_version(meta.get("weight_version"), default=self.weight_version)
        return Generation(prompt_index, output_ids, [float(e[0]) for e in entries], reason, version)

    def _warn_about(self, params: SamplingParams) -> None:
        if params.seed is not None and not self._deterministic and "seed" not in self._warned:
            self._warned.add("seed")
            logger.warning("SamplingParams.seed is ignored by SGLang unless the engine runs with "
                           "enable_deterministic_inference=True (CUDA attention backends only); sampling "
                           "uses the engine's random_seed=%s stream instead", self.config.random_seed)
        if params.top_k == 1 and params.temperature != 1.0 and "greedy" not in self._warned:
            self._warned.add("greedy")
            logger.warning("top_k=1 with temperature=%s: SGLang's greedy path reports log-probs at "
                           "temperature 1, not at the sampling temperature", params.temperature)

    # -- weights --------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       flush: bool = True) -> None:
        """One bucket of HF-named tensors (all on one device). `flush=True` marks the last
        bucket of an update: the prefix cache is flushed and `version` takes effect."""
        tensors = list(named_tensors)
        if not tensors and not flush:
            return
        if self.config.head_copy:
            tensors = with_head_copy(tensors)
        payloads = self._payloads(tensors) if tensors else []
        self.update_weights_serialized(payloads, version, flush)

    def _payloads(self, tensors: list[tuple[str, torch.Tensor]], keep_alive: Optional[list] = None) -> list[Any]:
        """`serialize_bucket` for this engine's transport: one copy per SGLang TP rank, as text over HTTP."""
        as_text = isinstance(self._transport, HTTPTransport)
        if as_text and any(not t.is_cuda for _, t in tensors):
            # CPU tensors travel through shared memory. The default file-descriptor strategy
            # hands descriptors over a connection authenticated with this process's
            # multiprocessing authkey, which only our own children know; a server that is not
            # our child fails with "digest sent was rejected". Named files work for anyone.
            torch.multiprocessing.set_sharing_strategy("file_system")
        return serialize_bucket(tensors, self._transport.tp_size, as_text, keep_alive=keep_alive)

    def update_weights_serialized(self, payloads: Sequence[Any], version: int, flush: bool = True) -> None:
        """Like `update_weights` with the bucket already serialized (`serialize_bucket`): one payload
        per SGLang TP rank, each opened by that rank. The colocated GPU path gathers them from the
        training ranks, each payload holding CUDA-IPC handles to a copy on that rank's GPU."""
        if TAG_WEIGHTS in self._released:
            raise EngineStateError("update_weights while the weights are released: "
                                   "resume_memory(['weights']) first")
        if payloads and len(payloads) != self._transport.tp_size:
            raise ValueError(f"{len(payloads)} payloads for an engine with tp_size={self._transport.tp_size}: "
                             "give one per SGLang TP rank")
        if not self._in_weight_update:
            self._transport.call("begin_weight_update", {"selector": "all"})
            self._in_weight_update = True
        try:
            if payloads:
                self._transport.update_weights_from_tensor(
                    list(payloads), flush_cache=flush, weight_version=str(version) if flush else None)
            elif flush:
                self._transport.call("flush_cache", {})
                self._transport.set_weight_version(str(version))
        except BaseException:
            try:
                self._end_weight_update()
            except Exception:  # keep the original error
                logger.exception("end_weight_update after a failed weight update failed too")
            raise
        if flush:
            self._end_weight_update()
            self.weight_version = version

    def update_adapters(self, adapters: dict[str, torch.Tensor], scaling: float, version: int) -> None:
        """LoRA adapters {HF module name: (A [r, in], B [out, r])} on the engine's base weights, loaded as a
        PEFT adapter under a name of their own (module docstring); `version` takes effect."""
        from megatron_rl.models.lora import peft_config, peft_tensors

        if TAG_WEIGHTS in self._released:
            raise EngineStateError("update_adapters while the weights are released: resume_memory(['weights']) "
                                   "and a full weight update first")
        rank = next(iter(adapters.values()))[0].shape[0]
        keep: list = []
        payloads = self._payloads(list(peft_tensors(adapters).items()), keep_alive=keep)
        self._lora_loads += 1  # a retried load gets a name of its own too
        name, previous = f"{self._lora_prefix}-{self._lora_loads}-v{version}", self._lora
        self._transport.load_lora_adapter(name, payloads, peft_config(rank, scaling * rank, list(adapters),
                                                                      "megatron-rl"))
        del keep  # loaded: the engine has read the shared buffer
        self._lora = name
        if previous is not None:
            self._transport.unload_lora_adapter(previous)
        self._transport.call("flush_cache", {})  # no prefix computed under the previous adapter is reused
        self._transport.set_weight_version(str(version))
        self.weight_version = version

    def _end_weight_update(self) -> None:
        self._in_weight_update = False
        self._transport.call("end_weight_update", {})

    # -- memory and scheduling ------------------------------------------------------------------
    def release_memory(self, tags: Sequence[str] = ALL_TAGS) -> None:
        """Release the tagged regions not released already: on GPU, torch_memory_saver ends SGLang's scheduler
        process when asked to pause a region twice (e.g. the colocation controller's hand-back after a rollout
        that failed before the KV cache was resumed)."""
        todo = [t for t in _check_tags(tags) if t not in self._released]
        if todo:
            if not self._paused:
                # Wait until the scheduler has retired its last batch (module docstring); the release flushes
                # the prefix cache anyway. Paused, the engine retracted its batches already, and this flush
                # would wait for the requests that other clients left waiting.
                self._transport.flush_cache(wait_s=IDLE_WAIT_S)
            self._transport.call("release_memory_occupation", {"tags": todo})
        self._released |= set(todo)

    def resume_memory(self, tags: Sequence[str] = ALL_TAGS) -> None:
        """Resume the tagged regions that are released (resuming a resident one fails in SGLang too)."""
        todo = [t for t in _check_tags(tags) if t in self._released]
        if todo:
            self._transport.call("resume_memory_occupation", {"tags": todo})
        self._released -= set(todo)

    def pause(self) -> None:
        with self._idle:
            self._paused = True
            while self._in_flight:
                self._idle.wait()
        self._transport.call("pause_generation", {"mode": "retract"})

    def resume(self) -> None:
        self._transport.call("continue_generation", {})
        with self._idle:
            self._paused = False

    def abort(self) -> None:
        self._transport.abort_all()

    def health(self) -> dict:
        return {"backend": "sglang", "mode": self._transport.mode, "healthy": self._transport.healthy(),
                "weight_version": self.weight_version, "paused": self._paused,
                "released": sorted(self._released), "in_flight": self._in_flight,
                "tp_size": self._transport.tp_size}

    def shutdown(self) -> None:
        if self._lora is not None and self._transport.mode == "attach":  # the server lives on: take ours back
            try:
                self._transport.unload_lora_adapter(self._lora)
            except (RuntimeError, OSError):
                logger.warning("could not unload LoRA adapter %s from the attached SGLang server", self._lora,
                               exc_info=True)
            self._lora = None
        self._transport.shutdown()


def _check_tags(tags: Sequence[str]) -> list[str]:
    tags = list(tags)
    unknown = sorted(set(tags) - set(ALL_TAGS))
    if unknown:
        raise ValueError(f"memory tags {unknown} are unknown; allowed: {', '.join(ALL_TAGS)}")
    return tags


def _parse_version(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default  # SGLang's "default" before any versioned update
