"""Disaggregated mode, trainer side: generators generate while the trainer trains.

`rollout.mode=disaggregated` swaps the colocation controller for `DisaggregatedController`;
the RL step is otherwise the colocated one (`rl.step`: the same advantages, filters, old
log-prob recomputation, truncated-IS loss and update); only where the step's rollouts come
from changes (this source's `rollouts` instead of the colocated one's). Per step s:

    publish weights v=s to the generators (weight_sync.stream.sync_weights into a BroadcastSink)
    -> ask for the prompts of step s + max_staleness (the trainer owns the sampler)
    -> take num_groups groups from the experience buffer (older than v - max_staleness: dropped,
       counted, their prompts asked for again)
    -> the RL step trains on them while the generators work on the next steps' prompts

Staleness bound: prompts of step s' are sent only once the trainer has published version
s' - k (k = algorithm.max_staleness), so every token of them is sampled with a version >= s' - k
and, trained at step s', is at most k versions old. Groups may still be taken later than
their step (several generators finish out of order), and `ExperienceBuffer.take` drops
those beyond k. The buffer holds (k + 1) steps of groups, so generators block (back-pressure)
rather than run further ahead. With k = 0 generation and training alternate (on-policy).

Version v = the trainer's weights after v RL steps (0: the warm-started model). A group's
version is that of its oldest token; with partial rollouts (rollout.partial_rollout_tokens)
a sequence generated across a publish carries both versions, and its rollout log-probs are
the engine's per token, which the truncated-IS weight (algorithm.tis_cap) corrects against
the trainer's recomputed old log-probs (algorithm.old_logprobs=recompute is required).

Process picture. Trainer rank 0 hosts the hub (megatron_rl/disagg/channel.py: request and
experience queues, stop event, heartbeats, served over TCP) and the weight group's TCPStore.
With rollout.generator_nodes=0 it spawns rollout.num_generators processes itself
(multiprocessing 'spawn'; megatron_rl/disagg/generator.py) during start-up, so they load while
the warm start runs; on a GPU node generator i uses the rollout.tp GPUs after the trainer's local
ranks and the generators before it (parallel.dist.generator_device; refused when the node has too
few), so a node of 8 GPUs runs e.g. 6 trainer ranks (`--ntasks-per-node=6`) and 2 generators. With
rollout.generator_nodes=N > 0 the generators are separate processes on other nodes (the Slurm job runs them as
a step of their own on the last N nodes, one per GPU) that find the hub through `<run_dir>/disagg/hub.json` and
join the store at rank 0's address; the trainer waits for them and stops with an error naming the generator
when one falls silent for rollout.generator_timeout_s (dead), or makes no progress for
rollout.generator_progress_timeout_s (hung). The other trainer ranks take part in weight sync
(TP gather, PP stages, as in colocated mode) and get the step's groups from rank 0 by
broadcast. The weight group is gloo on CPU, NCCL on GPU; the values its store holds are
authenticated with the hub's key (megatron_rl/disagg/weights.py), and on one node the store
listens on the loopback only.

Evaluation runs on the trainer's own engine through the colocated controller (the engine is
built as in colocated mode), with the trainer's current weights. A task without held-out prompts
has nothing to evaluate: the trainer ranks then start no engine at all (megatron_rl.rl.state.build_run).
Offline evaluation of a disaggregated run's checkpoints (megatron_rl.eval) uses the evaluating
job's own engine and starts no generators.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing
import socket
import time
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

from megatron_rl.disagg.buffer import ExperienceBuffer, ExperienceGroup, scheduler_metrics
from megatron_rl.disagg.events import EventLog
from megatron_rl.observability.reduce import rule_of
from megatron_rl.preemption import children_block_stop_signals
from megatron_rl.rollout.base import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")
LOOPBACK = "127.0.0.1"


class DisaggregatedController:
    """The RolloutSource of rollout.mode=disaggregated (megatron_rl/rollout/source.py): publishes weights,
    sends prompts and takes experience."""

    def __init__(self, rt: Any, colocated: Any, task: Any, train_prompts: list, sampler: Any,
                 sandbox_addresses: list[str]) -> None:
        from megatron_rl.parallel.dist import free_port, weight_update_store

        cfg = rt.cfg
        self.cfg, self.colocated, self.trainer = cfg, colocated, colocated.trainer
        self.task, self.prompts, self.sampler = task, train_prompts, sampler
        self.stop_token_ids = tuple(task.stop_token_ids)
        self.is_main, self.device = rt.is_main, rt.groups.device
        self.max_staleness = cfg.algorithm.max_staleness
        self.num_groups = cfg.global_batch_size // cfg.rollout.n_samples_per_prompt
        self.version = 0  # the last published version (in the run's checkpoints: `state_dict`)
        self.timings: dict[str, float] = {}
        self.last_sync: Any = None
        self._timeline: Any = None
        self._step = -1
        self._sink: Any = None
        # rollout.weight_sync=adapters: the trainer's `weights_loaded` count when the generators got the base
        # weights they hold (None: none yet)
        self._base_of: Optional[int] = None
        self._next_issue_step = 0
        self._next_request = 0
        self._in_flight: dict[int, list[int]] = {}  # request id -> source indices not trained on yet
        self._reissue: list[list[int]] = []  # in-flight prompts of a checkpoint, asked for again first
        self._wall_offset = time.time() - time.perf_counter()
        self._closed = False
        if not self.is_main:
            return
        from megatron_rl.disagg.channel import Hub
        from megatron_rl.disagg.generator import GeneratorSpec, run_local_generator

        num, external = cfg.rollout.num_generators, cfg.rollout.generator_nodes > 0
        # one node: everything on the loopback; other nodes: the address the trainer ranks rendezvous at
        host = _reachable_host(rt.env.master_addr) if external else LOOPBACK
        self.store = weight_update_store(host, free_port(), 1 + num, is_master=True,
                                         timeout_s=cfg.rollout.weight_update_timeout_s)
        local_ranks = 0 if external else rt.env.local_world_size
        specs = [GeneratorSpec(i, cfg, str(rt.run_dir), host, self.store.port, num, local_ranks,
                               list(sandbox_addresses)) for i in range(num)]
        self.hub = Hub(specs, (self.max_staleness + 1) * self.num_groups, host, cfg.rollout.generator_timeout_s,
                       cfg.rollout.generator_progress_timeout_s)
        self.events = EventLog(Path(rt.run_dir) / "timeline" / "trainer.jsonl")
        self.buffer = ExperienceBuffer(self.hub.experience, self.max_staleness)
        self.procs = []
        if external:
            path = self.hub.publish(rt.run_dir)
            logger.info("disaggregated rollout: waiting for %d generator(s) started separately "
                        "(`python -m megatron_rl.disagg.generator --run-dir %s`); hub %s:%d, written to %s",
                        num, rt.run_dir, *self.hub.address, path)
        else:
            ctx = multiprocessing.get_context("spawn")
            for i in range(num):
                # not daemonic: an sglang engine starts processes of its own; close() (also at exit) stops them
                proc = ctx.Process(target=run_local_generator, args=(i, *self.hub.address, self.hub.key),
                                   name=f"generator{i}")
                with children_block_stop_signals():  # the trainer checkpoints on them (Slurm signals every process)
                    proc.start()
                self.procs.append(proc)
        atexit.register(self.close)
        logger.info("disaggregated rollout: %d generator process(es)%s, max_staleness %d, partial rollouts %s",
                    num, f" on {cfg.rollout.generator_nodes} other node(s)" if external else "",
                    self.max_staleness, cfg.rollout.partial_rollout_tokens or "off")

    # -- the step ---------------------------------------------------------------------------------
    def rollouts(self, step: int, timeline: Any) -> tuple[list, dict[str, float]]:
        """Publish weights v=step, send prompts up to step + max_staleness, return the step's
        rollouts (prompt_index = group id) and timing/buffer/weight-sync metrics, on every trainer rank;
        with agent episodes also their `agent/...` metrics and, from the generators' schedulers,
        `sched/...` (`buffer.scheduler_metrics` says how they are summed over groups and generators).
        The previous step's training span (on its timeline) goes to the trainer's event log now."""
        self.timeline = timeline
        self.timings, self._step = {}, step
        start = time.perf_counter()
        if self._sink is None and self.is_main:
            self._connect(step)
        self.last_sync = self._publish(step)
        self.timings["time/publish"] = time.perf_counter() - start
        stats: dict[str, float] = {}
        kept: list[ExperienceGroup] = []
        if self.is_main:
            self._issue_until(step + self.max_staleness)
            take_start = time.time()
            kept, stats = self.buffer.take(self.num_groups, step, self._drop, self._check_alive,
                                           **self._dynamic_sampling())
            for group in kept:
                self._consumed(group)
                self.events.write("group", group.generated[0], group.generated[1], step=step, version=group.version,
                                  versions=group.versions, staleness=step - group.version,
                                  request=group.request_id, generator=group.generator,
                                  source=group.rollouts[0].source_index)
            self.events.write("take", take_start, time.time(), step=step, groups=len(kept))
            stats["async/generator_version"] = float(max((max(g.versions) for g in kept), default=-1))
            stats.update(scheduler_metrics(kept))  # the generators' sched/... (agent episodes), summed over groups
            stats.update(self._sink.metrics())  # weight_sync/bytes_sent, bytes_full, ...: this publish's
        rollouts = [dataclasses.replace(r, prompt_index=g) for g, group in enumerate(kept) for r in group.rollouts]
        if self.is_main:
            stats.update(episode_stats(self.task, rollouts))
        if dist.is_initialized() and dist.get_world_size() > 1:
            payload = [(rollouts, stats)]
            dist.broadcast_object_list(payload, src=0)
            rollouts, stats = payload[0]
            if not self.is_main:  # counts the step sums over ranks (observability/reduce.py): rank 0 holds them
                stats = {key: value for key, value in stats.items() if rule_of(key) is None}
        return rollouts, {**self.metrics(), **stats, **self.timings}

    def _connect(self, first_version: int) -> None:
        from megatron_rl.disagg.generator import GO_KEY
        from megatron_rl.disagg.weights import BroadcastSink, signed_set
        from megatron_rl.parallel.dist import WeightUpdateGroup

        start = time.time()
        while not self.hub.all_ready():  # a generator failing or falling silent while it loads raises here
            self._check_alive()
            time.sleep(0.2)
        signed_set(self.store, self.hub.key, GO_KEY, str(first_version).encode())
        num = len(self.hub.specs)
        group = WeightUpdateGroup(self.store, 0, 1 + num, self.device, self.cfg.rollout.weight_update_timeout_s)
        self._sink = BroadcastSink(group, self.store, self.hub.key, delta=self.cfg.rollout.weight_sync_delta,
                                   alive=self._check_alive, answer_timeout_s=self.cfg.rollout.weight_update_timeout_s)
        self.events.write("connect", start, time.time(), generators=num)

    def _publish(self, version: int) -> Any:
        """Weights v=`version` to every generator. rollout.weight_sync=adapters: the base weights and the adapters
        the first time (the generators are this run's processes, started with it) and after weights were loaded
        into the trainer again, else the adapters alone; every trainer rank decides alike (the sync's collectives)."""
        from megatron_rl.colocate.controller import sync_policy

        mode = self.colocated.weight_sync
        loaded = getattr(self.trainer, "weights_loaded", 0)
        adapters_only = mode == "adapters" and self._base_of == loaded
        if self._sink is not None:
            self._sink.adapters_follow = mode == "adapters" and not adapters_only
        self.trainer.gather_params()  # parallel.overlap_param_gather: the last step left the all-gather to do
        start = time.time()
        try:
            stats = sync_policy(self.trainer.module, self.trainer.groups, self.trainer.model_cfg, self._sink,
                                version, self.colocated.bucket_bytes, mode, adapters_only)
        except RuntimeError as exc:  # the weight group lost a member: say which generator it was
            if not self.is_main:
                raise
            raise RuntimeError(f"publishing weights v{version} to the generators failed ({self.hub.describe()}; "
                               f"logs under {self.events.path.parents[1] / 'logs'}): {exc}") from exc
        self.version = version
        if mode == "adapters":
            self._base_of = loaded
        if self.is_main:
            self.events.write("publish", start, time.time(), version=version, bytes=stats.num_bytes)
        return stats

    # -- prompts in flight --------------------------------------------------------------------------
    def _issue_until(self, last_step: int) -> None:
        while self._reissue:
            self._request(self._reissue.pop(0))
        while self._next_issue_step <= last_step:
            indices = self.sampler.next_batch(self.num_groups)
            num = len(self.hub.specs)
            for part in range(num):  # one request per generator (any generator may take any)
                share = indices[part * len(indices) // num:(part + 1) * len(indices) // num]
                if share:
                    self._request(share)
            self._next_issue_step += 1

    def _request(self, indices: list[int]) -> None:
        from megatron_rl.disagg.generator import Request

        r, request_id = self.cfg.rollout, self._next_request
        self._next_request += 1
        params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                max_new_tokens=r.max_new_tokens, n=r.n_samples_per_prompt,
                                seed=self.cfg.seed * 100_003 + 7919 * request_id,
                                stop_token_ids=self.stop_token_ids, stop=tuple(r.stop),
                                return_routing=self.cfg.algorithm.routing_replay == "rollout")
        prompts = [(list(self.prompts[i].tokens), dict(self.prompts[i].meta)) for i in indices]
        self._in_flight[request_id] = list(indices)
        self.hub.requests.put(Request(request_id, list(indices), prompts, params))

    def _consumed(self, group: ExperienceGroup) -> None:
        remaining = self._in_flight.get(group.request_id, [])
        index = group.rollouts[0].source_index
        if index in remaining:
            remaining.remove(index)
        if not remaining:
            self._in_flight.pop(group.request_id, None)

    def _dynamic_sampling(self) -> dict[str, Any]:
        """`ExperienceBuffer.take`'s filter for algorithm.dynamic_sampling: a group is kept when the
        verifier rewards of its scored samples (lost episodes left out; `shaping.group_verdicts`) vary; each refused one is
        replaced by a new prompt from the sampler, up to (dynamic_sampling_max_rounds - 1) * groups
        per step (what the colocated rounds may draw beyond the first); past that the next groups
        fill the batch as they come."""
        algo = self.cfg.algorithm
        if not algo.dynamic_sampling:
            return {}
        from megatron_rl.algorithms.filters import has_reward_variance
        from megatron_rl.rewards.shaping import group_verdicts

        def replace(group: ExperienceGroup) -> None:
            self._consumed(group)
            self._request(self.sampler.next_batch(1))

        return {"accept": lambda group: has_reward_variance(group_verdicts(group.rollouts)),
                "on_reject": replace, "max_rejects": (algo.dynamic_sampling_max_rounds - 1) * self.num_groups}

    def _drop(self, group: ExperienceGroup) -> None:
        self._consumed(group)
        self._request([group.rollouts[0].source_index])  # the same prompt again, with fresher weights

    def _check_alive(self) -> None:
        for i, proc in enumerate(self.procs):
            if not proc.is_alive():
                raise RuntimeError(f"generator {i} exited with code {proc.exitcode}: see "
                                   f"{self.events.path.parents[1] / 'logs' / f'generator{i}.log'}")
        self.hub.check()

    # -- what the RL loop also asks of a controller -------------------------------------------------
    def rollout(self, generate: Callable[[], T]) -> T:
        """Evaluation: generate on the trainer's own engine with the current weights (colocated)."""
        return self.colocated.rollout(generate)

    def metrics(self) -> dict[str, float]:
        out = dict(self.timings)
        if self.last_sync is not None:
            out.update(self.last_sync.metrics())
        return out

    @property
    def timeline(self) -> Any:
        return self._timeline

    @timeline.setter
    def timeline(self, value: Any) -> None:
        """A new timeline each step (`rollouts`): the previous step's training spans go to the log."""
        self._flush_timeline()
        self._timeline = value

    def _flush_timeline(self) -> None:
        if self._timeline is None or not self.is_main or self._closed:
            return
        for event in self._timeline.events:
            if event["name"] == "train":
                self.events.write("train", event["start"] + self._wall_offset, event["end"] + self._wall_offset,
                                  step=self._step)
        self._timeline.events = [e for e in self._timeline.events if e["name"] != "train"]

    def state_dict(self) -> dict[str, Any]:
        """The published version, and the prompts sent but not trained on yet (asked for again after a resume)."""
        return {"weight_version": self.version,
                "disaggregated": {"next_issue_step": self._next_issue_step, "next_request": self._next_request,
                                  "in_flight": [list(v) for v in self._in_flight.values() if v]}}

    def load_state_dict(self, run_state: dict[str, Any]) -> None:
        """From a checkpoint's run state (a colocated run's holds no "disaggregated": nothing in flight)."""
        self.version = run_state.get("weight_version", 0)
        state = run_state.get("disaggregated")
        if state:
            self._next_issue_step, self._next_request = state["next_issue_step"], state["next_request"]
            self._reissue = [list(v) for v in state["in_flight"]]

    def close(self) -> None:
        """Stop the generators (idempotent; also registered to run at exit)."""
        if self._closed or not self.is_main:
            return
        self._flush_timeline()
        self._closed = True
        self.hub.stop.set()
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():  # it defers SIGTERM to the trainer (preemption.helper_defers_stop_signals)
                logger.warning("generator %s did not stop in 30s; killing it", proc.name)
                proc.kill()
                proc.join(timeout=10)
        left = self.hub.wait_stopped(0 if self.procs else 30)
        if left:
            logger.warning("generator(s) %s did not confirm stopping within 30s", left)
        self.hub.close()
        self.events.close()


def episode_stats(task: Any, rollouts: list) -> dict[str, float]:
    """The agent metrics of the step's episodes, as colocated mode logs them: `agent/...` for an
    agent task, `domain/<name>/agent/...` for each agent domain of a joint run."""
    from megatron_rl.rollout.multiturn import Episode, episode_metrics

    episodes = [r for r in rollouts if isinstance(r, Episode)]
    if not episodes:
        return {}
    if task.is_agent:
        return episode_metrics(episodes)
    out: dict[str, float] = {}
    for domain in task.agent_domains:
        mine = [e for e in episodes if e.domain == domain]
        if mine:
            out.update({f"domain/{domain}/{k}": v for k, v in episode_metrics(mine).items()})
    return out


def _reachable_host(master_addr: str) -> str:
    """An address of this node that other nodes reach: the rendezvous address of the trainer
    ranks (rank 0 runs here), or this host's name when that is a loopback address."""
    if master_addr.startswith("127.") or master_addr in ("localhost", "::1"):
        return socket.gethostname()
    return master_addr
