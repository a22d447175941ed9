"""One rollout engine per block of local ranks (inference TP size k), reached from every rank
of the block through the `RolloutEngine` protocol.

The design's colocated picture (docs/rollout.md, "One engine per block of ranks"): local ranks
are grouped in blocks of k; the block's first rank (the leader) owns the engine, e.g. an
`sglang.Engine(tp_size=k, base_gpu_id=<its GPU>)`; the other ranks own none. `BlockEngine`
runs on every rank of the block and turns each protocol call into a *round* over the block's
(gloo) process group: every rank sends its request to the leader (`gather_object`), the leader
calls its engine once, and each rank gets its own answer back (`scatter_object_list`). The
colocation controller, weight sync and `collect()` see an ordinary engine on every rank.

- `generate` rounds are served as they come: ranks may call `generate` a different number of
  times (their data-parallel shares differ), so a rank that has moved on to another call (the
  controller's `release_memory`) takes part in the rounds of the others with nothing to ask
  until the whole block asks for the same call; identical requests in one round (ranks of one
  model-parallel group generate the same prompts with the same seed) are generated once and
  answered with the same completions.
- `update_weights`: every rank of the block holds the same full HF bucket (weight sync
  all-gathers TP shards and broadcasts PP stages). Without a serializer (the `hf` backend) only
  the leader's bucket is loaded, once; followers send nothing but the version. With one (the
  `sglang` backend) every rank serializes its own copy (CUDA-IPC handles to its own GPU; CPU
  tensors through shared memory) and the leader hands the k payloads to
  `update_weights_serialized`, payload i to SGLang TP rank i, the one on block rank i's GPU.
  Every rank keeps its copy alive until the leader's engine has loaded it (the round's answer).
- `update_adapters` (LoRA adapters alone): every rank holds the same gathered adapters; the leader loads
  its own, once (SGLang serializes them for its TP ranks itself: they are small).
- memory release/resume, pause/resume and shutdown are rounds that the leader executes once
  when the whole block asks for them; an error on the leader is raised on every rank.
- `abort` acts on the leader's engine without a round (it is called from another thread while
  a `generate` waits); on a follower it does nothing: its requests live in the leader's engine.
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.parallel.state import RolloutBlock
from megatron_rl.rollout.base import ALL_TAGS, Generation, SamplingParams

logger = logging.getLogger(__name__)

# (named tensors) -> (payload, keep-alive object): one rank's serialized copy of a bucket
Serializer = Callable[[list[tuple[str, torch.Tensor]]], tuple[Any, Any]]

_RETRY = "retry"  # a follower that asked for another call waits for this round's generate requests


class BlockEngine:
    """`RolloutEngine` on every rank of a block; the leader passes its engine, followers None."""

    def __init__(self, block: RolloutBlock, engine: Optional[Any], serialize: Optional[Serializer] = None) -> None:
        if block.is_leader != (engine is not None):
            raise ValueError(f"block rank {block.index}: the leader (index 0) owns the engine, the others pass None")
        self.block = block
        self.engine = engine
        self.serialize = serialize
        self.num_rounds = 0
        # Every rank of the block agrees on the starting version (a collective, like the others).
        self.weight_version = self._round("version", None)

    # -- protocol -----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        return self._round("generate", ([[int(t) for t in p] for p in prompts], params))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       flush: bool = True) -> None:
        tensors = list(named_tensors)
        keep_alive = None
        if self.serialize is not None and tensors:
            payload, keep_alive = self.serialize(tensors)
        else:
            payload = None
        # Only the leader's own bucket stays local (`local`): tensors never travel over the group.
        self._round("update_weights", (payload, version, flush), local=tensors)
        del keep_alive  # the leader's engine has opened every payload by now
        if flush:
            self.weight_version = version

    def update_adapters(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float,
                        version: int) -> None:
        # Every rank holds the same adapters (weight sync gathers them): only the leader's are loaded.
        self._round("update_adapters", (scaling, version), local=adapters)
        self.weight_version = version

    def release_memory(self, tags: Sequence[str] = ALL_TAGS) -> None:
        self._round("release_memory", list(tags))

    def resume_memory(self, tags: Sequence[str] = ALL_TAGS) -> None:
        self._round("resume_memory", list(tags))

    def pause(self) -> None:
        self._round("pause", None)

    def resume(self) -> None:
        self._round("resume", None)

    def abort(self) -> None:
        if self.engine is not None:
            self.engine.abort()

    def health(self) -> dict:
        block = {"block_ranks": list(self.block.ranks), "block_index": self.block.index, "rounds": self.num_rounds}
        if self.engine is None:
            return {"backend": "block-follower", "weight_version": self.weight_version, **block}
        return {**self.engine.health(), **block}

    def shutdown(self) -> None:
        self._round("shutdown", None)

    # -- rounds -------------------------------------------------------------------------------
    def _round(self, op: str, wire: Any, local: Any = None) -> Any:
        """Send (op, wire) to the leader and return this rank's answer; `local` stays on the leader."""
        group, leader = self.block.group, self.block.leader
        while True:
            self.num_rounds += 1
            if group is None:  # a block of one: no collectives
                reply = self._serve([(op, wire)], local)[0]
            else:
                requests: Optional[list] = [None] * self.block.size if self.block.is_leader else None
                dist.gather_object((op, wire), requests, dst=leader, group=group)
                replies = self._serve(requests, local) if self.block.is_leader else None
                answer: list = [None]
                dist.scatter_object_list(answer, replies, src=leader, group=group)
                reply = answer[0]
            status, value = reply
            if status == _RETRY:
                continue
            if status == "error":
                raise value
            return value

    def _serve(self, requests: list[tuple[str, Any]], local: Any) -> list[tuple[str, Any]]:
        """On the leader: one (status, value) reply per block rank."""
        ops = [op for op, _ in requests]
        if "generate" in ops:
            return self._serve_generate(requests)
        if len(set(ops)) > 1:
            error = RuntimeError(f"the ranks of rollout block {list(self.block.ranks)} are out of step: "
                                 f"they called {ops} (every rank must make the same engine calls, in order)")
            return [("error", error)] * len(requests)
        try:
            value = self._apply(ops[0], [wire for _, wire in requests], local)
        except Exception as exc:  # raised on every rank of the block
            return [("error", exc)] * len(requests)
        return [("ok", value)] * len(requests)

    def _apply(self, op: str, wires: list[Any], local: Any) -> Any:
        engine = self.engine
        if op == "version":
            return engine.weight_version
        if op == "update_weights":
            _, version, flush = wires[0]
            if any(w[1:] != (version, flush) for w in wires):
                raise RuntimeError(f"rollout block {list(self.block.ranks)}: ranks sent different weight "
                                   f"updates (version, flush) = {[w[1:] for w in wires]}")
            if self.serialize is None:
                engine.update_weights(local, version, flush=flush)
            else:
                payloads = [w[0] for w in wires]
                if any(p is None for p in payloads) and any(p is not None for p in payloads):
                    raise RuntimeError("some ranks of the block sent an empty bucket and some did not")
                engine.update_weights_serialized([p for p in payloads if p is not None], version, flush=flush)
            return engine.weight_version
        if op == "update_adapters":
            if any(w != wires[0] for w in wires):
                raise RuntimeError(f"rollout block {list(self.block.ranks)}: ranks sent different adapter updates "
                                   f"(scaling, version) = {wires}")
            engine.update_adapters(local, *wires[0])
            return engine.weight_version
        if op in ("release_memory", "resume_memory"):
            if any(w != wires[0] for w in wires):
                raise RuntimeError(f"rollout block {list(self.block.ranks)}: {op} with different tags {wires}")
            return getattr(engine, op)(wires[0])
        if op in ("pause", "resume", "shutdown"):
            return getattr(engine, op)()
        raise AssertionError(f"unknown block call {op}")

    def _serve_generate(self, requests: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        unique: dict[tuple, int] = {}
        keys: list[Optional[tuple]] = []
        for op, wire in requests:
            if op != "generate":
                keys.append(None)
                continue
            prompts, params = wire
            key = (tuple(tuple(p) for p in prompts), params)
            unique.setdefault(key, len(unique))
            keys.append(key)
        jobs = list(unique)

        def run(key: tuple) -> tuple[str, Any]:
            try:
                return "ok", self.engine.generate([list(p) for p in key[0]], key[1])
            except Exception as exc:
                return "error", exc

        if len(jobs) > 1 and getattr(self.engine, "concurrent_generate", False):
            # One engine batches concurrent requests (SGLang's scheduler): send them together.
            with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
                results = list(pool.map(run, jobs))
        else:
            results = [run(key) for key in jobs]
        return [(_RETRY, None) if key is None else results[unique[key]] for key in keys]
