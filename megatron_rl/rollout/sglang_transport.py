"""How `SGLangEngine` (sglang_engine.py) talks to SGLang: in-process (`OfflineTransport`, the offline
engine this process starts, with its scheduler processes) or over HTTP to a server it attaches to
(`HTTPTransport`); both expose SGLang's control calls by their HTTP names (`Transport`). Only this module
and sglang_engine.py import sglang, lazily (`import_sglang`). A transport's `config` is the engine's
`SGLangEngineConfig`."""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import threading
import urllib.error
import urllib.request
from typing import Any, Optional, Protocol

from megatron_rl.preemption import children_block_stop_signals

logger = logging.getLogger(__name__)

_INSTALL_HINT = ("needs sglang: see docs/rollout.md (GPU: pip install -e '.[sglang]'; "
                 "CPU tests: tests/integration/sglang/setup.sh)")


def import_sglang():
    try:
        import sglang
    except ImportError as exc:
        raise ImportError(f"the sglang rollout backend {_INSTALL_HINT}") from exc
    return sglang


class Transport(Protocol):
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


class OfflineTransport(Transport):
    """`sglang.Engine` in this process. Its TokenizerManager runs on an asyncio loop; the loop
    runs in a background thread so that abort/pause can reach it while a generate call waits."""

    mode = "offline"

    def __init__(self, config: Any) -> None:
        if config.device == "cpu":
            # SGLang reads it at import time; without it the CPU path imports vllm for rotary.
            os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        sglang = import_sglang()
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


class HTTPTransport(Transport):
    """A running SGLang HTTP server (stdlib HTTP client: generation needs no sglang here)."""

    mode = "attach"

    def __init__(self, config: Any) -> None:
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
