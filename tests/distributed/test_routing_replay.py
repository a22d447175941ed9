"""MoE routing replay (algorithm.routing_replay, megatron_rl/trainer/routing_replay.py): a forward records
each token's experts, and a later forward or update over the same samples routes them so, whatever the
router's weights have become.

Single process (Qwen3-MoE: softmax over the chosen experts' logits): with unchanged weights a replay is
bit-identical to the recorded forward and no choice drifts; after an update with a large learning rate the
routers choose differently (the precondition), a replayed forward's routers output exactly the recorded
experts with the probabilities computed from their logits by hand, and the drift the replayed update
reports is the share of real tokens' expert sets that those routers' own top k (on the replayed inputs)
would have changed. Replaying the routing the samples carry (routing=ENGINE: here transformers' routing
of the same weights, as an engine returns it) gives what replaying the trainer's recording gives. A
recording does not replay on other samples.

Parallel layouts (TP=2 with sequence parallelism: each TP rank routes its sequence shard; EP=2: data-
parallel ranks pack different rows, padded to equal shapes; PP=2: each stage routes its own layers; CP=2:
each rank routes two chunks of every row), and one process with full activation recomputation (the
backward routes each layer again):
the replayed log-probs, the replayed update and the drift equal the single process's, which a rank
replaying another micro-batch's or another shard's routing cannot match (routing moved between the
recording and the replay). Tolerances as in test_moe_parity.py, except for the weights after an Adam
step at lr 1e-2 (ten times test_moe_parity's): rounding-level gradient differences move them by up to
lr * d / eps (1e-4 seen at TP=2 + SP), a wrong gradient by up to 2 * lr; 3e-4 allowed. The second
(replayed) update is compared by its loss and gradient norm: Adam's second step divides by the square root
of tiny second moments and moves single weights by 2e-3 between layouts. Losses agree to 1e-6 relative
(2e-6 absolute seen at EP=2).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import run_spawned
from tests.distributed.test_moe_parity import MICRO_BATCH_TOKENS, MODELS, _samples

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

MODEL = MODELS["qwen3_moe"]
LAYOUTS = {
    "tp2_sp": dict(tp=2, pp=1, ep=1, sequence_parallel=True),
    "ep2": dict(tp=1, pp=1, ep=2, sequence_parallel=False),
    "pp2": dict(tp=1, pp=2, ep=1, sequence_parallel=False),
    "cp2": dict(tp=1, pp=1, cp=2, ep=1, sequence_parallel=False),
}
REFERENCE = dict(tp=1, pp=1, ep=1, sequence_parallel=False)
# one process with full activation recomputation: the backward re-runs each layer's routing, which must
# replay the micro-batch being recomputed
RECOMPUTE = dict(REFERENCE, recompute="full")
LR = 0.01  # large enough that one step changes some routing


def _router_outputs(module):
    """Hooks capturing every TopKRouter call's (input, probs, routing_map), in call order."""
    from megatron.core.transformer.moe.router import TopKRouter

    seen, handles = [], []
    for sub in module.modules():
        if isinstance(sub, TopKRouter):
            handles.append(sub.register_forward_hook(
                lambda mod, args, out: seen.append((mod, args[0].detach(), out[0].detach(), out[1].detach()))))
    return seen, handles


def _with_engine_routing(samples, model_cfg):
    """The samples with extras["routing"] as `Rollout.sample` carries an engine's: transformers' model of the
    same weights (test_moe_parity checks it computes the trainer's log-probs) routes every token but the last."""
    from megatron_rl.models.hf import build_hf_model
    from megatron_rl.trainer.packing import Sample

    hf = build_hf_model(model_cfg, seed=3)
    out = []
    for sample in samples:
        seen = []
        handles = [layer.mlp.gate.register_forward_hook(lambda m, a, o: seen.append(o[2])) for layer in hf.model.layers]
        with torch.no_grad():
            hf(sample.tokens[None, :-1])
        for handle in handles:
            handle.remove()
        routing = torch.stack(seen, dim=1).to(torch.int16)  # [L-1, layers, k], as Generation.routing
        out.append(Sample(sample.tokens, sample.loss_mask, {**sample.extras, "routing": routing.flatten(1)}))
    return out


def _worker(rank: int, world: int, layouts: dict, out_path: str) -> None:
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.models.hf import random_state_dict
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer import routing_replay
    from megatron_rl.trainer.core import Trainer, TrainerOptions

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    full = random_state_dict(ModelConfig(**MODEL), seed=3)
    results = {}
    for name, layout in layouts.items():
        model_cfg = ModelConfig(**MODEL, recompute=layout.get("recompute", "none"))
        groups = state.initialize(layout["tp"], layout["pp"], layout.get("cp", 1), ep=layout["ep"],
                                  sequence_parallel=layout["sequence_parallel"])
        trainer = Trainer(model_cfg, OptimizerConfig(lr=LR, clip_grad=1.0), groups,
                          TrainerOptions(micro_batch_tokens=MICRO_BATCH_TOKENS, routing_replay=True))
        trainer.load_full_state_dict(full)
        samples = _samples()
        out = {}
        out["plain"], _ = trainer.forward_logprobs(samples)
        out["recorded"], _ = trainer.forward_logprobs(samples, record_routing=True)
        record = trainer.last_routing
        out["replayed_before"], _ = trainer.forward_logprobs(samples, routing=record)
        engine_samples = _with_engine_routing(samples, model_cfg)
        out["engine_before"], _ = trainer.forward_logprobs(engine_samples, routing=routing_replay.ENGINE)
        out["first"] = trainer.train_step(samples, routing=record)
        out["weights"] = trainer.full_state_dict()
        out["replayed"], _ = trainer.forward_logprobs(samples, routing=record)
        out["engine_replayed"], _ = trainer.forward_logprobs(engine_samples, routing=routing_replay.ENGINE)
        out["fresh"], _ = trainer.forward_logprobs(samples, record_routing=True)
        fresh = trainer.last_routing
        if name == "ref":
            out["record"], out["fresh_record"] = record, fresh
            out["micro_batches"] = len(record.keys)
            out["padding"] = [mb.padding[0] for mb in trainer._micro_batches(samples)[1]]
            seen, handles = _router_outputs(trainer.module)
            trainer.forward_logprobs(samples, routing=record)
            for handle in handles:
                handle.remove()
            out["router_calls"] = [(mod.weight.detach().clone(), x, probs, routing_map)
                                   for mod, x, probs, routing_map in seen]
            try:
                trainer.train_step(samples[:-1], routing=record)
                out["other_samples"] = None
            except ValueError as err:
                out["other_samples"] = str(err)
        out["second"] = trainer.train_step(samples, routing=record)
        results[name] = out
        state.destroy()
    if rank == 0:
        torch.save(results, out_path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("routing_replay")
    run_spawned(_worker, 1, {"ref": REFERENCE, "recompute": RECOMPUTE}, str(out / "ref.pt"))
    run_spawned(_worker, 2, LAYOUTS, str(out / "layouts.pt"))
    one = torch.load(out / "ref.pt", weights_only=False)
    return one["ref"], {**torch.load(out / "layouts.pt", weights_only=False), "recompute": one["recompute"]}


def _changed_share(record, fresh, padding) -> float:
    """Share of (real token, layer) pairs whose expert set differs between two recordings."""
    changed = total = 0
    for old_mb, new_mb, pad in zip(record.routes, fresh.routes, padding, strict=True):
        for old, new in zip(old_mb, new_mb, strict=True):
            differs = (old.sort(1).values != new.sort(1).values).any(1)[~pad]
            changed += int(differs.sum())
            total += differs.numel()
    return changed / total


def test_replay_with_unchanged_weights_is_exact(runs):
    ref, _ = runs
    assert ref["micro_batches"] > 1  # several micro-batches: each must get its own recording back
    assert len(ref["record"].routes[0]) == MODEL["num_layers"]
    assert ref["record"].routes[0][0].shape[1] == MODEL["moe_router_topk"]
    for plain, recorded, replayed in zip(ref["plain"], ref["recorded"], ref["replayed_before"], strict=True):
        assert torch.equal(plain, recorded) and torch.equal(plain, replayed)
    assert ref["first"]["routing_drift"] == 0.0


def test_an_update_moves_the_routing_and_replay_keeps_the_recorded_experts(runs):
    ref, _ = runs
    assert _changed_share(ref["record"], ref["fresh_record"], ref["padding"]) > 0.05  # precondition: routing moved
    gap = max(float((r - f).abs().max()) for r, f in zip(ref["replayed"], ref["fresh"]))
    assert gap > 1e-4  # the replayed forward did not route freely
    # every router call of a replayed forward: the recorded experts, weighted by a softmax over their logits
    calls = ref["router_calls"]
    layers = MODEL["num_layers"]
    routes = [layer for mb in ref["record"].routes for layer in mb]  # micro-batch by micro-batch, layer by layer
    assert len(calls) == len(routes)
    changed = total = 0
    for k, ((weight, x, probs, routing_map), indices) in enumerate(zip(calls, routes, strict=True)):
        logits = x.reshape(-1, x.shape[-1]).float() @ weight.float().t()
        indices = indices.long()
        expected = torch.zeros_like(logits).scatter(1, indices, torch.softmax(logits.gather(1, indices), dim=-1))
        assert torch.equal(routing_map, expected > 0)
        assert torch.allclose(probs.float(), expected, atol=1e-6)
        # drift: the routers' own top k on these (replayed) inputs against the recorded experts, real tokens only
        own = logits.topk(MODEL["moe_router_topk"], dim=1).indices
        differs = (own.sort(1).values != indices.sort(1).values).any(1)[~ref["padding"][k // layers]]
        changed, total = changed + int(differs.sum()), total + differs.numel()
    # the second update ran on the weights of that forward: it reports the same drift
    assert ref["second"]["routing_drift"] == pytest.approx(changed / total, abs=1e-12)
    assert 0 < changed / total < 1


def test_the_engines_routing_replays_like_the_trainers_own(runs):
    """routing=ENGINE (rollout routing replay): the samples carry transformers' routing of the initial
    weights, which chooses what the trainer's routers chose (before the update its replay is the plain
    forward); after the update replaying it gives the log-probs of replaying the trainer's recording
    (a sample's last token, which the engine never routes, reaches no target)."""
    ref, _ = runs
    for plain, engine in zip(ref["plain"], ref["engine_before"], strict=True):
        assert torch.allclose(engine, plain, atol=2e-5)
    for replayed, engine in zip(ref["replayed"], ref["engine_replayed"], strict=True):
        assert torch.allclose(engine, replayed, atol=2e-5)


def test_a_recording_does_not_replay_on_other_samples(runs):
    ref, _ = runs
    assert ref["other_samples"] is not None and "same samples" in ref["other_samples"]


@pytest.mark.parametrize("layout", [*sorted(LAYOUTS), "recompute"])
def test_replay_in_parallel_layouts_matches_one_process(runs, layout):
    ref, layouts = runs
    got = layouts[layout]
    for key in ("replayed_before", "replayed", "fresh", "engine_before", "engine_replayed"):
        for a, b in zip(got[key], ref[key], strict=True):
            assert torch.allclose(a, b, atol=2e-5), (key, (a - b).abs().max())
    assert got["first"]["routing_drift"] == 0.0
    assert got["second"]["routing_drift"] == pytest.approx(ref["second"]["routing_drift"], abs=1e-12)
    for step in ("first", "second"):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-6)
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-5)
    for key, value in ref["weights"].items():
        assert torch.allclose(got["weights"][key], value, atol=3e-4), (key, (got["weights"][key] - value).abs().max())
