"""MoE routing replay (algorithm.routing_replay). `old`: the experts each token was routed to at the old
policy's forward are recorded there and reused by every update's forward, so that the importance ratio
pi_theta / pi_old compares the same experts' outputs even after the router's weights have moved (GSPO's
"routing replay"). Without it, a token whose top-k set changes between inner updates gets a ratio that
mixes a routing change with a policy change, and clipping then acts on noise. `rollout` (R3): the
engine's routing, carried by each sample (extras["routing"], `Rollout.sample`), is replayed by the
old-log-prob forward and every update, so that the trainer scores the tokens with the experts that
generated them (`carried_routes` maps it onto a micro-batch's positions).

Megatron-core's TopKRouter asks its `router_replay` attribute for the top k when one is set
(moe/moe_utils.py: topk_routing_with_score_function calls
`router_replay.get_replay_topk(scores, topk, num_groups, group_topk, compute)`); `LayerRouting` is
such an object, attached to the policy's routers only (a critic or a reference forward routes freely).
Megatron's own RouterReplay keeps every instance in a process-wide list and one replay target per
layer; this one is per model, records one tensor per micro-batch and measures the drift that replay
hides. Everything is rank-local: each rank records and replays the routing of the tokens it holds
(its sequence shard under sequence or context parallelism, its pipeline stage's layers, its data-
parallel share), which the trainer's deterministic packing of the same samples gives it again.

Full activation recomputation re-runs a layer's routing during the backward pass; with one pipeline
stage the micro-batch being recomputed is still the current one, with several (1F1B) it is not, so
that combination is refused (`megatron_rl.config.checks.run.check_routing_replay`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

Tensor = torch.Tensor


class LayerRouting:
    """One MoE layer's routing: free (mode None), recorded ("record": the layer's own top k, kept per
    forward call) or replayed ("replay": `target`'s experts, with the scores the router computes now)."""

    def __init__(self, layer: int) -> None:
        self.layer = layer  # global 0-based layer number
        self.mode: Optional[str] = None
        self.recorded: list[Tensor] = []
        self.target: Optional[Tensor] = None
        self.real: Optional[Tensor] = None  # [tokens] bool: the target's tokens that are not padding
        self.covered: Optional[Tensor] = None  # [tokens] bool: the tokens `target` routes (None: all)
        self.changed: Any = 0  # replayed real tokens whose own top-k set differs from the target's
        self.tokens: Any = 0

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups: Optional[int] = None,
                        group_topk: Optional[int] = None,
                        default_compute_topk: Optional[Callable] = None) -> tuple[Tensor, Tensor]:
        if self.mode is None:
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.mode == "record":
            probs, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            self.recorded.append(indices.detach().to(torch.int16))  # a quarter of int64's memory until replayed
            return probs, indices
        if self.target is None or self.target.shape != (scores.shape[0], topk):
            found = None if self.target is None else tuple(self.target.shape)
            raise RuntimeError(f"routing replay: the recorded routing has shape {found}, this micro-batch's "
                               f"router needs {(scores.shape[0], topk)}")
        with torch.no_grad():
            _, own = default_compute_topk(scores.detach(), topk, num_groups=num_groups, group_topk=group_topk)
            differs = (own.sort(dim=1).values != self.target.sort(dim=1).values).any(dim=1)
            real = torch.ones_like(differs) if self.real is None else self.real
            target = self.target
            if self.covered is not None:  # tokens the given routing does not cover route freely
                target = torch.where(self.covered[:, None], target, own)
                real = real & self.covered
            self.changed = self.changed + (differs & real).sum()  # device tensors: no host sync per layer
            self.tokens = self.tokens + real.sum()
        return scores.gather(1, target), target


@dataclasses.dataclass
class RoutingRecord:
    """The routing of one forward over a batch: per micro-batch, each local MoE layer's expert indices
    [tokens of the micro-batch on this rank, topk], and the micro-batches' identities (sample indices and
    shape) that a replay must find again. Indices are kept as int16 (Megatron's routers index at most a
    few hundred experts)."""

    keys: list[tuple]
    routes: list[list[Tensor]]


def micro_batch_key(mb) -> tuple:
    return tuple(mb.sample_indices), tuple(mb.input_ids.shape)


def attach(module: torch.nn.Module) -> list[LayerRouting]:
    """A LayerRouting on every TopKRouter of `module` (this rank's stage), in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    layers = []
    for sub in module.modules():
        if isinstance(sub, TopKRouter):
            sub.router_replay = LayerRouting(sub.layer_number - 1)
            layers.append(sub.router_replay)
    return layers


class Recording:
    """Context of a forward that records every layer's routing, micro-batch by micro-batch."""

    def __init__(self, layers: list[LayerRouting]) -> None:
        self.layers = layers

    def __enter__(self) -> "Recording":
        for layer in self.layers:
            layer.mode, layer.recorded = "record", []
        return self

    def __exit__(self, *exc) -> None:
        for layer in self.layers:
            layer.mode = None

    def record(self, micro: list) -> RoutingRecord:
        """The recording of the forward over `micro` (a forward-only pass routes each micro-batch once)."""
        for layer in self.layers:
            if len(layer.recorded) != len(micro):
                raise RuntimeError(f"routing replay: a layer routed {len(layer.recorded)} times over "
                                   f"{len(micro)} micro-batches")
        routes = [[layer.recorded[i] for layer in self.layers] for i in range(len(micro))]
        for layer in self.layers:
            layer.recorded = []
        return RoutingRecord([micro_batch_key(mb) for mb in micro], routes)


ENGINE = "engine"
"""`routing=ENGINE`: replay the routing each sample carries (extras["routing"], the engine's; `Rollout.sample`)."""


class Replay:
    """Context of a pass that replays a routing: `select(i, mb, real)` before micro-batch i's forward;
    `drift()` the counts (changed, tokens) of (token, layer) choices the current routers would make
    differently. `routes(i, mb)` gives micro-batch i's per-layer indices and which of its tokens they
    cover (None: all)."""

    def __init__(self, layers: list[LayerRouting],
                 routes: Callable[[int, Any], tuple[list[Tensor], Optional[Tensor]]]) -> None:
        self.layers, self.routes = layers, routes

    @classmethod
    def of_record(cls, layers: list[LayerRouting], record: RoutingRecord, micro: list) -> "Replay":
        keys = [micro_batch_key(mb) for mb in micro]
        if keys != record.keys:
            raise ValueError("routing replay: these samples pack into other micro-batches than the recorded "
                             "forward's (replay needs the same samples in the same order)")
        return cls(layers, lambda index, mb: (record.routes[index], None))

    def __enter__(self) -> "Replay":
        for layer in self.layers:
            layer.mode, layer.changed, layer.tokens = "replay", 0, 0
        return self

    def __exit__(self, *exc) -> None:
        for layer in self.layers:
            layer.mode, layer.target, layer.real, layer.covered = None, None, None, None

    def select(self, index: int, mb: Any, real: Tensor) -> None:
        """Route micro-batch `index` as given (tokens the routes do not cover: as the routers choose);
        `real` [its tokens on this rank]: which are no padding (counted by `drift`)."""
        routes, covered = self.routes(index, mb)
        for layer, target in zip(self.layers, routes, strict=True):
            layer.target, layer.real, layer.covered = target.long(), real, covered

    def drift(self) -> tuple[int, int]:
        return (sum(int(layer.changed) for layer in self.layers), sum(int(layer.tokens) for layer in self.layers))


def carried_routes(mb: Any, columns: list[int], num_moe_layers: int, topk: int,
                   part: Callable[[Tensor], Tensor] = lambda t: t) -> tuple[list[Tensor], Tensor]:
    """A micro-batch's routing from its samples' extras["routing"] ([targets, MoE layers * k], the engine's):
    per local MoE layer (`columns`: its index among the model's MoE layers) the experts of every position
    the router sees, [positions, k], and which positions the samples cover. A position that predicts no
    target (a sample's last token, padding) or whose routing is -1 (an episode's tokens after its last
    engine call) was never routed by the engine: the routers choose there (`LayerRouting`). `part`: the
    router's part of a row's per-position tensor (`Trainer._router_part`: under sequence parallelism this TP
    rank's contiguous part)."""
    if "routing" not in mb.extras:
        raise ValueError("routing replay from the rollouts: the samples carry no engine routing (extras['routing']): "
                         "rollouts generated with algorithm.routing_replay=rollout carry it, a rollout.replay_dir "
                         "dump of a run without it does not")
    rows, device = mb.input_ids.shape[1], mb.input_ids.device
    every = mb.extras["routing"].reshape(-1, num_moe_layers, topk)
    covered = torch.zeros(rows, dtype=torch.bool, device=device)
    covered[mb.valid] = (every >= 0).flatten(1).all(dim=1)
    if not columns:  # a pipeline stage without MoE layers
        return [], part(covered)
    full = torch.zeros(rows, len(columns), topk, dtype=torch.long, device=device)
    full[mb.valid] = every[:, columns].long().clamp_min(0)
    full = part(full)
    return [full[:, i] for i in range(len(columns))], part(covered)
