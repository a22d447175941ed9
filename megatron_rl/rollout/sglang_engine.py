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

Only this module imports sglang, lazily: `import megatron_rl.rollout.sglang_engine` works
without it, and attach mode needs sglang only for weight updates (tensor serialization).
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import json
import logging
import os
import threading
import urllib.error
import uuid
import urllib.request
from typing import Any, ClassVar, Iterable, Optional, Protocol, Sequence

import torch

from megatron_rl.preemption import children_block_stop_signals
from megatron_rl.rollout.base import ALL_TAGS, TAG_WEIGHTS, Generation, SamplingParams
from megatron_rl.rollout.base import EngineStateError

logger = logging.getLogger(__name__)

_INSTALL_HINT = ("needs sglang: see docs/rollout.md (GPU: pip install -e '.[sglang]'; "
                 "CPU tests: tests/integration/sglang/setup.sh)")
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


def _import_sglang():
    try:
        import sglang
    except ImportError as exc:
        raise ImportError(f"the sglang rollout backend {_INSTALL_HINT}") from exc
    return sglang


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
    _import_sglang()
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
        self._transport: _Transport = (_OfflineTransport(config) if config.model_path is not None
                                       else _HTTPTransport(config))
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
        generations = [self._to_generation(out, idx) for out, idx in zip(outputs, prompt_index)]
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

    def _to_generation(self, out: dict[str, Any], prompt_index: int) -> Generation:
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
        as_text = isinstance(self._transport, _HTTPTransport)
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


class _Transport(Protocol):
    """What SGLangEngine needs from an engine: SGLang's control calls by their HTTP names."""

    mode: str
    tp_size: int

    def generate(self, input_ids: list[list[int]], sampling_params: list[dict],
                 return_routed_experts: bool = False, lora: Optional[str] = None) -> list[dict]:
        """SGLang's output dicts (output_ids, meta_info), one per request, in request order; every request
        with the LoRA adapter named `lora` if one is."""

    def update_weights_from_tensor(self, payloads: list, flush_cache: bool,
                                   weight_version: Optional[str]) -> None: ...

    def load_lora_adapter(self, name: str, payloads: list, config: dict) -> None:
        """A PEFT adapter from flattened-bucket payloads (one per TP rank) under `name`."""

    def unload_lora_adapter(self, name: str) -> None: ...

    def set_weight_version(self, version: str) -> None: ...

    def call(self, name: str, body: dict) -> None:
        """A control call without a result (begin_weight_update, pause_generation, ...)."""

    def flush_cache(self, wait_s: float) -> None:
        """Flush the prefix cache once the scheduler is idle, waiting up to `wait_s` for that."""

    def abort_all(self) -> None: ...

    def weight_version(self) -> Any: ...

    def server_info(self) -> dict: ...

    def healthy(self) -> bool:
        """The engine's processes are up and answering (cheap: never generates)."""

    def shutdown(self) -> None: ...


class _OfflineTransport(_Transport):
    """`sglang.Engine` in this process. Its TokenizerManager runs on an asyncio loop; the loop
    runs in a background thread so that abort/pause can reach it while a generate call waits."""

    mode = "offline"

    def __init__(self, config: SGLangEngineConfig) -> None:
        if config.device == "cpu":
            # SGLang reads it at import time; without it the CPU path imports vllm for rotary.
            os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        sglang = _import_sglang()
        from sglang.srt.managers import io_struct

        self._io = io_struct
        kwargs = config.engine_kwargs()
        logger.info("starting SGLang engine: %s", kwargs)
        # SGLang's start-up calls logging.basicConfig(force=True): it would drop this process's
        # handlers (rank filter, run-directory log file). Keep ours; SGLang's loggers keep its level.
        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        before = _child_pids()
        try:
            # Slurm's stop signals (USR1 from srun, the job's end SIGTERM) reach every process of the step:
            # SGLang's schedulers would die of them while the ranks checkpoint (its shutdown SIGKILLs them)
            with children_block_stop_signals():
                self._engine = sglang.Engine(**kwargs)
        finally:
            for handler in list(root.handlers):
                if handler not in handlers:
                    root.removeHandler(handler)
            for handler in handlers:
                if handler not in root.handlers:
                    root.addHandler(handler)
            root.setLevel(level)
            logging.getLogger("sglang").setLevel(str(kwargs.get("log_level", "error")).upper())
        # the processes SGLang started (scheduler, detokenizer, ...), not the resource tracker it may have started
        self._sglang_pids = sorted(_child_pids() - before - {_resource_tracker_pid()})
        # at exit, this shutdown rather than SGLang's (which would kill every child of this process)
        atexit.unregister(self._engine.shutdown)
        atexit.register(self.shutdown)
        self._closed = False
        self.tp_size = int(kwargs["tp_size"])
        self._tm = self._engine.tokenizer_manager
        self._loop = self._engine.loop
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-engine-loop", daemon=True)
        self._thread.start()

    def _run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(self, input_ids: list[list[int]], sampling_params: list[dict],
                 return_routed_experts: bool = False, lora: Optional[str] = None) -> list[dict]:
        extra = _generate_extras(len(input_ids), return_routed_experts, lora)
        out = self._run(self._engine.async_generate(input_ids=input_ids, sampling_params=sampling_params,
                                                    return_logprob=True, **extra))
        return out if isinstance(out, list) else [out]

    def load_lora_adapter(self, name: str, payloads: list, config: dict) -> None:
        req = self._io.LoadLoRAAdapterFromTensorsReqInput(
            lora_name=name, config_dict=config, serialized_named_tensors=payloads, load_format="flattened_bucket")
        _check_result("load_lora_adapter_from_tensors",
                      self._run(self._tm.load_lora_adapter_from_tensors(req, None)))

    def unload_lora_adapter(self, name: str) -> None:
        req = self._io.UnloadLoRAAdapterReqInput(lora_name=name)
        _check_result("unload_lora_adapter", self._run(self._tm.unload_lora_adapter(req, None)))

    def update_weights_from_tensor(self, payloads: list, flush_cache: bool,
                                   weight_version: Optional[str]) -> None:
        req = self._io.UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payloads, load_format="flattened_bucket", flush_cache=flush_cache,
            weight_version=weight_version)
        _check_result("update_weights_from_tensor", self._run(self._tm.update_weights_from_tensor(req, None)))

    def set_weight_version(self, version: str) -> None:
        req = self._io.UpdateWeightVersionReqInput(new_version=version, abort_all_requests=False)
        self._run(self._tm.update_weight_version(req))

    def call(self, name: str, body: dict) -> None:
        io, tm = self._io, self._tm
        requests = {
            "begin_weight_update": lambda: tm.begin_weight_update(io.BeginWeightUpdateReqInput(**body), None),
            "end_weight_update": lambda: tm.end_weight_update(io.EndWeightUpdateReqInput(**body), None),
            "flush_cache": lambda: tm.flush_cache(),
            "release_memory_occupation": lambda: tm.release_memory_occupation(
                io.ReleaseMemoryOccupationReqInput(**body), None),
            "resume_memory_occupation": lambda: tm.resume_memory_occupation(
                io.ResumeMemoryOccupationReqInput(**body), None),
            "pause_generation": lambda: tm.pause_generation(io.PauseGenerationReqInput(**body)),
            "continue_generation": lambda: tm.continue_generation(io.ContinueGenerationReqInput(**body)),
        }
        _check_result(name, self._run(requests[name]()))

    def flush_cache(self, wait_s: float) -> None:
        _check_result("flush_cache", self._run(self._tm.flush_cache(timeout_s=wait_s)))

    def abort_all(self) -> None:
        # abort_request sends on the scheduler socket, which belongs to the loop's thread.
        self._loop.call_soon_threadsafe(lambda: self._tm.abort_request(abort_all=True))

    def weight_version(self) -> Any:
        return self._tm.config_value("weight_version")

    def server_info(self) -> dict:
        return {"enable_deterministic_inference":
                bool(self._engine.server_args.enable_deterministic_inference)}

    def healthy(self) -> bool:
        import psutil  # an sglang dependency

        pids = self._engine.get_all_child_pids()
        return bool(pids) and all(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                  for p in pids)

    def shutdown(self) -> None:
        """SGLang's shutdown, killing SGLang's processes only. `Engine.shutdown` SIGKILLs every child of the
        calling process (`kill_process_tree(os.getpid(), include_parent=False)`): multiprocessing's resource
        tracker went with it, and every run using SGLang ended with "resource_tracker: process died
        unexpectedly" and a KeyError traceback; a sandbox server or generator this process started would go
        too. For the call the kill is narrowed to the processes that appeared while the engine started."""
        if self._closed:
            return
        self._closed = True
        from sglang.srt.entrypoints import engine as engine_module

        kill_tree = engine_module.kill_process_tree

        def kill_sglang_processes(parent_pid: Optional[int] = None, include_parent: bool = True, *args: Any,
                                  **kwargs: Any) -> None:
            if parent_pid not in (None, os.getpid()) or include_parent:  # not the blanket kill of our children
                return kill_tree(parent_pid, include_parent, *args, **kwargs)
            for pid in self._sglang_pids:  # each with its own children
                kill_tree(pid, True, **{k: v for k, v in kwargs.items() if k == "wait_timeout"})

        engine_module.kill_process_tree = kill_sglang_processes
        try:
            self._engine.shutdown()
        finally:
            engine_module.kill_process_tree = kill_tree
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)


def _child_pids() -> set[int]:
    import psutil  # an sglang dependency

    return {child.pid for child in psutil.Process().children()}


def _resource_tracker_pid() -> Optional[int]:
    """The pid of multiprocessing's resource tracker of this process, if it runs (private state: None when
    Python keeps it elsewhere)."""
    from multiprocessing import resource_tracker

    return getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None)


class _HTTPTransport(_Transport):
    """A running SGLang HTTP server (stdlib HTTP client: generation needs no sglang here)."""

    mode = "attach"

    def __init__(self, config: SGLangEngineConfig) -> None:
        assert config.base_url is not None
        self._url = config.base_url.rstrip("/")
        self._timeout = config.request_timeout_s
        self._info = self._request("GET", "/server_info")
        self.tp_size = int(self._info.get("tp_size", 1))

    def _request(self, method: str, path: str, body: Optional[dict] = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self._url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self._timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"SGLang {method} {path} failed ({exc.code}): "
                               f"{exc.read().decode(errors='replace')[:2000]}") from exc
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")

    def generate(self, input_ids: list[list[int]], sampling_params: list[dict],
                 return_routed_experts: bool = False, lora: Optional[str] = None) -> list[dict]:
        extra = _generate_extras(len(input_ids), return_routed_experts, lora)
        out = self._request("POST", "/generate", {"input_ids": input_ids, "sampling_params": sampling_params,
                                                  "return_logprob": True, **extra})
        return out if isinstance(out, list) else [out]

    def load_lora_adapter(self, name: str, payloads: list, config: dict) -> None:
        body = {"lora_name": name, "config_dict": config, "serialized_named_tensors": payloads,
                "load_format": "flattened_bucket"}
        _check_result("load_lora_adapter_from_tensors",
                      self._request("POST", "/load_lora_adapter_from_tensors", body))

    def unload_lora_adapter(self, name: str) -> None:
        _check_result("unload_lora_adapter", self._request("POST", "/unload_lora_adapter", {"lora_name": name}))

    def update_weights_from_tensor(self, payloads: list, flush_cache: bool,
                                   weight_version: Optional[str]) -> None:
        body = {"serialized_named_tensors": payloads, "load_format": "flattened_bucket",
                "flush_cache": flush_cache, "weight_version": weight_version}
        _check_result("update_weights_from_tensor", self._request("POST", "/update_weights_from_tensor", body))

    def set_weight_version(self, version: str) -> None:
        self._request("POST", "/update_weight_version", {"new_version": version, "abort_all_requests": False})

    def call(self, name: str, body: dict) -> None:
        _check_result(name, self._request("POST", "/" + name, body))

    def flush_cache(self, wait_s: float) -> None:
        self._request("POST", f"/flush_cache?timeout={wait_s:g}")  # a failure answers 400: raised

    def abort_all(self) -> None:
        self._request("POST", "/abort_request", {"abort_all": True})

    def weight_version(self) -> Any:
        return self._request("GET", "/model_info").get("weight_version")

    def server_info(self) -> dict:
        return self._info

    def healthy(self) -> bool:
        # Not /health: it generates a token and waits >= 1 s, and stalls while paused or
        # released. The server exits when its scheduler dies, so answering is the signal.
        try:
            self._request("GET", "/model_info")
            return True
        except (RuntimeError, OSError):
            return False

    def shutdown(self) -> None:
        """The server is not ours: leave it running."""


def _generate_extras(num_requests: int, return_routed_experts: bool, lora: Optional[str]) -> dict[str, Any]:
    extra: dict[str, Any] = {"return_routed_experts": True} if return_routed_experts else {}
    if lora is not None:
        extra["lora_path"] = [lora] * num_requests
    return extra


def _check_result(name: str, result: Any) -> None:
    """SGLang control calls answer (success, message), an object with .success, a dict or None."""
    if isinstance(result, tuple) and result and isinstance(result[0], bool):
        success, message = result[0], result[1] if len(result) > 1 else ""
    elif isinstance(result, dict) and "success" in result:  # LoRA calls say error_message
        success, message = result["success"], result.get("message") or result.get("error_message") or ""
    elif hasattr(result, "success"):
        success, message = result.success, getattr(result, "message", None) or getattr(result, "error_message", "")
    else:
        return
    if not success:
        raise RuntimeError(f"SGLang {name} failed: {message}")
