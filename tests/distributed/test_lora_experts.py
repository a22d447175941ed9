"""LoRA on the routed experts (model.lora_targets experts.linear_fc1 / experts.linear_fc2): an adapter per
expert and projection, beside the attention's and a dense layer's, on a Qwen3-MoE with four experts (top 2)
and layer 2 dense, and on a Qwen2-MoE that also adapts its gated shared expert (shared_experts.linear_fc1 /
.linear_fc2: split over the TP ranks like a dense MLP).

Single process: fresh adapters (B = 0) leave the log-probs bit-identical to the same weights without
adapters; after two Adam steps only the adapters moved, every expert's among them; the merged state dict
differs from the base weights exactly in the adapted linears (each expert's W + alpha / r B A, computed here
by hand from its adapter), and a model without adapters that loads it computes the adapted model's log-probs.

Parallel layouts, against the single process: EP=2 (each rank holds two experts and their adapters, trained
from the tokens the dispatcher brings it; A is drawn from the global expert index, so the layouts start
alike), EP=2 with the distributed optimizer (the adapters are expert parameters: reduced and sharded over
the expert-data-parallel ranks), TP=2 with sequence parallelism (experts split over the TP ranks, etp=2: a
column adapter's A and a row adapter's B whole on both ranks, their gradients summed over the pair), the same
with experts unsplit (etp=1: each TP rank runs whole experts on its own tokens), and PP=2; on four ranks
(the Qwen3-MoE) EP=2 x TP=2 with sequence parallelism at etp 2 and 1, and EP=2 x DP=2 with the distributed
optimizer (each expert's adapters sharded over the two ranks holding that expert). The log-probs before and
after two steps, the losses, every rank's gradient norms and the merged weights equal the single process's,
and the ranks' copies of every parameter they should share stay equal (a group-whole factor whose gradient
was not summed over the group would step with half of it). Each rank clips by its own gradient norm, so the
norms of all ranks are compared: counting a factor on the wrong ranks (the tensor-parallel tags) changes
them (0.81313 against 0.81458 on one rank, tried) while leaving rank 0's right.

A checkpoint written at TP=2 (etp=2) with sequence parallelism resumes in one process: the expert adapters
and their optimizer state are sharded as Megatron shards the experts (B of linear_fc1 like SwiGLU's fc1,
over the global expert axis).

Tolerances as in test_lora.py / test_moe_parity.py (fp32, reductions re-ordered): log-probs 2e-5 (5e-5 after the
updates, whose merged weights may differ as below), loss 1e-6,
gradient norm 1e-5 relative. Merged weights 1e-4: Adam turns a rounding-level gradient difference d into a
step difference of up to lr d / eps where a gradient is near eps = 1e-8 (test_moe_parity.py: ~2e-6 at lr 1e-3
for this model at TP=2 + SP); here, at lr 1e-2, up to 2.7e-5 when measured (TP=2 + SP; PP=2 3.4e-6). Leaving
out the sum of a group-whole factor's gradient at TP=2 moved the merged experts by 2.3-3.1e-2 and left the
ranks' copies 4e-2 apart (tried).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import run_spawned
from tests.distributed.test_moe_parity import _replica_drift, _samples

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "experts.linear_fc1", "experts.linear_fc2"]
SHARED = ["shared_experts.linear_fc1", "shared_experts.linear_fc2"]
LORA = dict(lora_rank=4, lora_alpha=8.0)
MODELS = {
    "qwen3_moe": dict(family="qwen3_moe", num_layers=4, tie_word_embeddings=True, num_experts=4,
                      moe_ffn_hidden_size=64, moe_router_topk=2, moe_dense_layers=[2], lora_targets=TARGETS, **LORA),
    # a shared expert (split over TP like a dense MLP) behind a sigmoid gate, untied head
    "qwen2_moe": dict(family="qwen2_moe", num_layers=4, tie_word_embeddings=False, num_experts=4,
                      moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=96, moe_router_topk=2,
                      moe_norm_topk_prob=False, moe_dense_layers=[2], lora_targets=TARGETS + SHARED, **LORA),
}
LAYOUTS = {
    "ep2": dict(tp=1, pp=1, ep=2, sequence_parallel=False, distopt=False),
    "ep2_distopt": dict(tp=1, pp=1, ep=2, sequence_parallel=False, distopt=True),
    "tp2_sp": dict(tp=2, pp=1, ep=1, sequence_parallel=True, distopt=False),
    "tp2_sp_etp1": dict(tp=2, pp=1, ep=1, sequence_parallel=True, distopt=False, etp=1),
    "pp2": dict(tp=1, pp=2, ep=1, sequence_parallel=False, distopt=False),
}
# four ranks (the Qwen3-MoE only): experts split over EP and TP at once, and expert data parallelism (EP=2 x DP=2:
# the distributed optimizer shards each expert's adapters over the two ranks that hold that expert)
LAYOUTS_4 = {
    "ep2_tp2_sp": dict(tp=2, pp=1, ep=2, sequence_parallel=True, distopt=False),
    "ep2_tp2_sp_etp1": dict(tp=2, pp=1, ep=2, sequence_parallel=True, distopt=False, etp=1),
    "ep2_dp2_distopt": dict(tp=1, pp=1, ep=2, sequence_parallel=False, distopt=True),
}
REFERENCE = dict(tp=1, pp=1, ep=1, sequence_parallel=False, distopt=False)
LR = 1e-2
SPARSE = [0, 1, 3]


def _model_cfg(model: str, **changes):
    from megatron_rl.config.schema import ModelConfig

    return ModelConfig(**{**MODELS[model], **changes})


def _trainer(model_cfg, layout, groups):
    from megatron_rl.config.schema import OptimizerConfig
    from megatron_rl.trainer.core import Trainer, TrainerOptions

    return Trainer(model_cfg, OptimizerConfig(lr=LR, clip_grad=1.0), groups,
                   TrainerOptions(micro_batch_tokens=48, use_distributed_optimizer=layout["distopt"]))


def _groups(layout):
    from megatron_rl.parallel import state

    return state.initialize(layout["tp"], layout["pp"], 1, ep=layout["ep"], etp=layout.get("etp"),
                            sequence_parallel=layout["sequence_parallel"])


def _worker(rank: int, world: int, model: str, layouts: dict, out_path: str) -> None:
    from megatron_rl.models.hf import random_state_dict
    from megatron_rl.models.lora import LoRAAdapter
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    full = random_state_dict(_model_cfg(model), seed=3)
    samples = _samples()
    results = {}
    for name, layout in layouts.items():
        groups = _groups(layout)
        trainer = _trainer(_model_cfg(model), layout, groups)
        trainer.load_full_state_dict(full)
        out = {"before": trainer.forward_logprobs(samples)[0]}
        out["steps"] = [trainer.train_step(samples) for _ in range(2)]
        out["after"] = trainer.forward_logprobs(samples)[0]
        out["merged"] = trainer.full_state_dict()
        out["drift"] = _replica_drift(trainer.module, groups)
        # every rank's gradient norms (each rank clips by its own: one that counted a factor differently would
        # step differently)
        out["rank_grad_norms"] = [None] * world
        torch.distributed.all_gather_object(out["rank_grad_norms"], [m["grad_norm"] for m in out["steps"]])
        if name == "ref":
            out["trainable"] = sorted(n for n, p in trainer.module.named_parameters() if p.requires_grad)
            out["base"] = {n: p.detach().clone() for n, p in trainer.module.named_parameters()
                           if not p.requires_grad}
            out["adapters"] = {n: (m.a.detach().clone(), m.b.detach().clone(), m.scale)
                               for n, m in trainer.module.named_modules() if isinstance(m, LoRAAdapter)}
            plain = _trainer(_model_cfg(model, lora_rank=0), layout, groups)
            plain.load_full_state_dict(full)
            out["plain_base"] = plain.forward_logprobs(samples)[0]
            plain.load_full_state_dict(out["merged"])
            out["plain_merged"] = plain.forward_logprobs(samples)[0]
        results[name] = out
        state.destroy()
    if rank == 0:
        torch.save(results, out_path)


@pytest.fixture(scope="module", params=sorted(MODELS))
def runs(request, tmp_path_factory):
    """(model name, single-process run, runs per layout)."""
    out = tmp_path_factory.mktemp(f"lora_experts_{request.param}")
    run_spawned(_worker, 1, request.param, {"ref": REFERENCE}, str(out / "ref.pt"))
    run_spawned(_worker, 2, request.param, LAYOUTS, str(out / "layouts.pt"))
    layouts = torch.load(out / "layouts.pt", weights_only=False)
    if request.param == "qwen3_moe":
        run_spawned(_worker, 4, request.param, LAYOUTS_4, str(out / "layouts_4.pt"), timeout_s=600)
        layouts.update(torch.load(out / "layouts_4.pt", weights_only=False))
    return request.param, torch.load(out / "ref.pt", weights_only=False)["ref"], layouts


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def test_every_expert_gets_adapters_and_only_adapters_train(runs):
    model, ref, _ = runs
    mlp = ("linear_fc1", "linear_fc2")
    attention = [("self_attention", t) for t in ("linear_qkv", "linear_proj")]
    expected = {f"decoder.layers.{i}.{part}.{t}_lora.{ab}" for i in range(4) for part, t in attention for ab in "ab"}
    expected |= {f"decoder.layers.2.mlp.{t}_lora.{ab}" for t in mlp for ab in "ab"}
    expected |= {f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{t}_lora.{ab}" for i in SPARSE
                 for e in range(4) for t in mlp for ab in "ab"}
    if SHARED[0] in MODELS[model]["lora_targets"]:
        expected |= {f"decoder.layers.{i}.mlp.shared_experts.{t}_lora.{ab}" for i in SPARSE for t in mlp
                     for ab in "ab"}
    assert set(ref["trainable"]) == expected
    from megatron_rl.models.hf import random_state_dict

    full = random_state_dict(_model_cfg(model), seed=3)
    for name, value in ref["base"].items():  # frozen: bit-identical to what was loaded
        tied = MODELS[model]["tie_word_embeddings"]
        canonical = name.replace("output_layer.weight", "embedding.word_embeddings.weight") if tied else name
        assert torch.equal(value, full[canonical]), name
    for name, (a, b, _) in ref["adapters"].items():
        assert b.abs().max() > 0, name  # B started at zero: every expert got tokens and a gradient
    experts_a = [ref["adapters"][f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1_lora"][0]
                 for e in range(4)]
    assert all(not torch.equal(experts_a[0], other) for other in experts_a[1:])  # A drawn per expert


def test_fresh_adapters_change_nothing_and_the_merged_weights_are_the_model(runs):
    _, ref, _ = runs
    for plain, adapted in zip(ref["plain_base"], ref["before"], strict=True):
        assert torch.equal(plain, adapted)
    assert _max_diff(ref["before"], ref["after"]) > 1e-3  # the adapters did change the model
    assert _max_diff(ref["plain_merged"], ref["after"]) <= 2e-5


def test_merged_weights_are_base_plus_scaled_adapter_product(runs):
    model, ref, _ = runs
    from megatron_rl.models.hf import random_state_dict

    full = random_state_dict(_model_cfg(model), seed=3)
    merged = ref["merged"]
    assert set(merged) == set(full)
    adapted = set()
    for name, (a, b, scale) in ref["adapters"].items():
        weight = name[: -len("_lora")] + ".weight"
        expected = full[weight].float() + scale * (b.float() @ a.float())
        assert torch.allclose(merged[weight], expected, atol=1e-6), weight
        adapted.add(weight)
    assert len([w for w in adapted if ".experts." in w]) == len(SPARSE) * 4 * 2
    assert len([w for w in adapted if ".shared_experts." in w]) == (
        len(SPARSE) * 2 if SHARED[0] in MODELS[model]["lora_targets"] else 0)
    for name in set(full) - adapted:
        assert torch.equal(merged[name], full[name]), name


@pytest.mark.parametrize("layout", [*LAYOUTS, *LAYOUTS_4])
def test_layouts_match_the_single_process(runs, layout):
    model, ref, runs_n = runs
    if layout in LAYOUTS_4 and model != "qwen3_moe":
        pytest.skip("four-rank layouts run for the Qwen3-MoE only")
    got = runs_n[layout]
    assert _max_diff(got["before"], ref["before"]) <= 2e-5
    # after the updates: the merged weights may differ by ~3e-5 (Adam's lr d / eps, module docstring), which
    # moved a log-prob by 2.3e-5 on a Xeon box at TP=2 + SP, etp 1 (under 2e-5 on others); a wrong shard, by 1e-2
    assert _max_diff(got["after"], ref["after"]) <= 5e-5
    for mine, theirs in zip(got["steps"], ref["steps"], strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-6, abs=1e-6)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
    for rank_norms in got["rank_grad_norms"]:
        assert rank_norms == pytest.approx([m["grad_norm"] for m in ref["steps"]], rel=1e-5)
    for name, value in ref["merged"].items():
        assert torch.allclose(got["merged"][name], value, atol=1e-4), name
    assert got["drift"] == 0.0


def _checkpoint_worker(rank: int, world: int, model: str, root: str, out: str, write: bool) -> None:
    """Writer (TP=2, etp=2, sequence parallelism): two steps, a checkpoint, a third step. Reader (one
    process): the checkpoint, then the third step."""
    from megatron_rl.checkpoint.training import find_latest, load_checkpoint, save_checkpoint
    from megatron_rl.models.hf import random_state_dict
    from megatron_rl.parallel import dist as mdist

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    model_cfg = _model_cfg(model)
    layout = LAYOUTS["tp2_sp"] if write else REFERENCE
    trainer = _trainer(model_cfg, layout, _groups(layout))
    samples = _samples()
    if write:
        trainer.load_full_state_dict(random_state_dict(model_cfg, seed=3))
        for _ in range(2):
            trainer.train_step(samples)
        save_checkpoint(trainer, Path(root), 2, {}, {"model": dataclasses.asdict(model_cfg)})
    else:
        load_checkpoint(trainer, find_latest(Path(root)))
    result = {"at_save": trainer.full_state_dict(), "next": trainer.train_step(samples),
              "after": trainer.full_state_dict()}
    if rank == 0:
        torch.save(result, out)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_an_expert_lora_checkpoint_resumes_at_another_tensor_parallel_size(tmp_path, model):
    run_spawned(_checkpoint_worker, 2, model, str(tmp_path / "ckpt"), str(tmp_path / "writer.pt"), True)
    run_spawned(_checkpoint_worker, 1, model, str(tmp_path / "ckpt"), str(tmp_path / "reader.pt"), False)
    writer, reader = (torch.load(tmp_path / f"{name}.pt", weights_only=False) for name in ("writer", "reader"))
    from megatron_rl.models.hf import random_state_dict

    base = random_state_dict(_model_cfg(model), seed=3)
    adapted = ["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]
    if SHARED[0] in MODELS[model]["lora_targets"]:
        adapted.append("decoder.layers.1.mlp.shared_experts.linear_fc1.weight")
    for name in adapted:  # their adapters trained, and a reader without them would not have these
        assert not torch.allclose(writer["at_save"][name], base[name], atol=1e-4), name
    for name, value in writer["at_save"].items():
        assert torch.allclose(reader["at_save"][name], value, atol=1e-6), name
    assert reader["next"]["loss"] == pytest.approx(writer["next"]["loss"], rel=1e-6)
    assert reader["next"]["grad_norm"] == pytest.approx(writer["next"]["grad_norm"], rel=1e-5)
    for name, value in writer["after"].items():
        assert torch.allclose(reader["after"][name], value, atol=1e-5), name
