"""LoRA (model.lora_rank, megatron_rl/models/lora.py): adapters on linear_qkv, linear_proj, linear_fc1 and
linear_fc2 train while the base weights stay frozen, and the engine gets the merged weights.

Single process: fresh adapters (B = 0) leave the model's log-probs bit-identical to the same weights without
adapters; after two Adam steps at a large learning rate every base weight is bit-identical to the loaded
one and every adapter has moved; the merged state dict (`full_state_dict`, what weight sync and HF export
read) loaded into a model without adapters gives the adapted model's log-probs, and it differs from the base
weights exactly in the four targeted linears of every layer (W + alpha / r B A, computed here by hand from
the adapters). Loading a full state dict into an adapted model makes it compute that state dict (B = 0).

Parallel layouts (TP=2, TP=2 with sequence parallelism, PP=2 with tied embeddings, CP=2, DP=2 with the
distributed optimizer) and one process with full activation recomputation (whose checkpointed blocks get a
gradient only because the frozen embedding's output is marked as needing one): the log-probs before and after
two steps, the losses, the gradient norms and the merged weights equal the single process's. A column adapter that skipped its gradient all-reduce or a row
adapter that skipped its output reduction would give other merged weights at TP=2. Tolerances as in
test_parity.py (fp32, reductions re-ordered): log-probs 2e-5; merged weights after two Adam steps at lr
1e-2 move by up to 2 lr * alpha / r per adapter entry product, rounding-level gradient differences by far
less: 1e-5.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import run_spawned
from tests.distributed.test_parity import _samples

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

MODEL = dict(family="qwen2", num_layers=4, tie_word_embeddings=True, lora_rank=4, lora_alpha=8.0)
LAYOUTS = {
    "tp2": dict(tp=2, pp=1, sequence_parallel=False, distopt=False),
    "tp2_sp": dict(tp=2, pp=1, sequence_parallel=True, distopt=False),
    "pp2": dict(tp=1, pp=2, sequence_parallel=False, distopt=False),
    "cp2": dict(tp=1, pp=1, cp=2, sequence_parallel=False, distopt=False),
    "dp2_distopt": dict(tp=1, pp=1, sequence_parallel=False, distopt=True),
}
REFERENCE = dict(tp=1, pp=1, sequence_parallel=False, distopt=False)
RECOMPUTE = dict(REFERENCE, recompute="full")  # one process; the backward runs each layer's adapters again
LR = 1e-2
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def _trainer(model_cfg, layout, groups):
    from megatron_rl.config.schema import OptimizerConfig
    from megatron_rl.trainer.core import Trainer, TrainerOptions

    return Trainer(model_cfg, OptimizerConfig(lr=LR, clip_grad=1.0), groups,
                   TrainerOptions(micro_batch_tokens=64, use_distributed_optimizer=layout["distopt"]))


def _worker(rank: int, world: int, layouts: dict, out_path: str) -> None:
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.hf import random_state_dict
    from megatron_rl.models.lora import LoRAAdapter
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    full = random_state_dict(ModelConfig(**MODEL), seed=3)
    samples = _samples()
    results = {}
    for name, layout in layouts.items():
        model_cfg = ModelConfig(**MODEL, recompute=layout.get("recompute", "none"))
        groups = state.initialize(layout["tp"], layout["pp"], layout.get("cp", 1),
                                  sequence_parallel=layout["sequence_parallel"])
        trainer = _trainer(model_cfg, layout, groups)
        trainer.load_full_state_dict(full)
        out = {"before": trainer.forward_logprobs(samples)[0]}
        out["steps"] = [trainer.train_step(samples) for _ in range(2)]
        out["after"] = trainer.forward_logprobs(samples)[0]
        out["merged"] = trainer.full_state_dict()
        if name == "ref":
            out["trainable"] = sorted(n for n, p in trainer.module.named_parameters() if p.requires_grad)
            out["base"] = {n: p.detach().clone() for n, p in trainer.module.named_parameters()
                           if not p.requires_grad}
            out["adapters"] = {n: (m.a.detach().clone(), m.b.detach().clone(), m.scale)
                               for n, m in trainer.module.named_modules() if isinstance(m, LoRAAdapter)}
            plain = _trainer(ModelConfig(**{**MODEL, "lora_rank": 0}), layout, groups)
            plain.load_full_state_dict(full)
            out["plain_base"] = plain.forward_logprobs(samples)[0]
            plain.load_full_state_dict(out["merged"])
            out["plain_merged"] = plain.forward_logprobs(samples)[0]
            trainer.load_full_state_dict(out["merged"])  # B = 0, base = merged: the same model again
            out["reloaded"] = trainer.forward_logprobs(samples)[0]
        results[name] = out
        state.destroy()
    if rank == 0:
        torch.save(results, out_path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    run_spawned(_worker, 1, {"ref": REFERENCE, "recompute": RECOMPUTE}, str(out / "ref.pt"))
    run_spawned(_worker, 2, LAYOUTS, str(out / "layouts.pt"))
    one = torch.load(out / "ref.pt", weights_only=False)
    return one["ref"], {**torch.load(out / "layouts.pt", weights_only=False), "recompute": one["recompute"]}


def _close(a, b, atol):
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True)) <= atol


def test_fresh_adapters_change_nothing(runs):
    ref, _ = runs
    for plain, adapted in zip(ref["plain_base"], ref["before"], strict=True):
        assert torch.equal(plain, adapted)


def test_only_the_adapters_train(runs):
    ref, _ = runs
    layers = MODEL["num_layers"]
    expected = sorted(f"decoder.layers.{i}.{part}.{t}_lora.{ab}" for i in range(layers)
                      for part, t in [("self_attention", "linear_qkv"), ("self_attention", "linear_proj"),
                                      ("mlp", "linear_fc1"), ("mlp", "linear_fc2")] for ab in "ab")
    assert ref["trainable"] == expected
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.hf import random_state_dict

    full = random_state_dict(ModelConfig(**MODEL), seed=3)
    for name, value in ref["base"].items():  # frozen: bit-identical to what was loaded
        canonical = name.replace("output_layer.weight", "embedding.word_embeddings.weight")
        assert torch.equal(value, full[canonical]), name
    for name, (a, b, _) in ref["adapters"].items():
        assert b.abs().max() > 0, name  # B started at zero
    assert all(step["loss"] == step["loss"] for step in ref["steps"])
    assert not _close(ref["before"], ref["after"], 1e-3)  # the model did change


def test_merged_weights_are_base_plus_scaled_adapter_product(runs):
    ref, _ = runs
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.hf import random_state_dict

    full = random_state_dict(ModelConfig(**MODEL), seed=3)
    merged = ref["merged"]
    assert set(merged) == set(full)
    adapted = set()
    for name, (a, b, scale) in ref["adapters"].items():
        weight = name[: -len("_lora")] + ".weight"
        expected = full[weight].float() + scale * (b.float() @ a.float())
        assert torch.allclose(merged[weight], expected, atol=1e-6), weight
        adapted.add(weight)
    assert len(adapted) == 4 * MODEL["num_layers"]
    for name in set(full) - adapted:
        assert torch.equal(merged[name], full[name]), name


def test_a_model_without_adapters_computes_the_merged_weights_like_the_adapted_one(runs):
    ref, _ = runs
    assert _close(ref["plain_merged"], ref["after"], 2e-5)
    assert _close(ref["reloaded"], ref["after"], 2e-5)


@pytest.mark.parametrize("layout", [*LAYOUTS, "recompute"])
def test_layouts_match_the_single_process(runs, layout):
    ref, runs_2 = runs
    got = runs_2[layout]
    assert _close(got["before"], ref["before"], 2e-5)
    assert _close(got["after"], ref["after"], 2e-5)
    for mine, theirs in zip(got["steps"], ref["steps"], strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-6, abs=1e-6)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
    for name, value in ref["merged"].items():
        assert torch.allclose(got["merged"][name], value, atol=1e-5), name


def _checkpoint_worker(rank: int, world: int, root: str, out: str, write: bool) -> None:
    """Writer (TP=2 with sequence parallelism): two steps, a checkpoint, a third step. Reader (one process):
    the checkpoint, then the third step."""
    from megatron_rl.checkpoint.training import find_latest, load_checkpoint, save_checkpoint
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.hf import random_state_dict
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    model_cfg = ModelConfig(**MODEL)
    layout = dict(LAYOUTS["tp2_sp"] if write else REFERENCE)
    groups = state.initialize(layout["tp"], layout["pp"], 1, sequence_parallel=layout["sequence_parallel"])
    trainer = _trainer(model_cfg, layout, groups)
    samples = _samples()
    result = {}
    if write:
        trainer.load_full_state_dict(random_state_dict(model_cfg, seed=3))
        trainer.train_step(samples)
        reference = trainer.snapshot_weights()  # a KL reference after a warm start: adapters not at zero
        result["reference_size"] = len(reference)
        result["reference_logprobs"] = trainer.forward_logprobs(samples)[0]
        trainer.train_step(samples)
        save_checkpoint(trainer, Path(root), 2, {"reference": reference}, {"model": dataclasses.asdict(model_cfg)})
    else:
        reference = load_checkpoint(trainer, find_latest(Path(root)))["reference"]
        current = trainer.swap_weights(reference)
        result["reference_logprobs"] = trainer.forward_logprobs(samples)[0]
        trainer.swap_weights(current)
    result["at_save"] = trainer.full_state_dict()
    result["next"] = trainer.train_step(samples)
    result["after"] = trainer.full_state_dict()
    if rank == 0:
        torch.save(result, out)


def test_a_lora_checkpoint_resumes_at_another_tensor_parallel_size(tmp_path):
    """The adapters and their optimizer state are in the checkpoint, sharded as Megatron shards their layers
    (linear_fc1's B as SwiGLU's fc1): written at TP=2 with sequence parallelism, read by one process, the
    merged weights and the next step are the writer's. (Adapters left out of the checkpoint would load as
    B = 0, the base weights.) The KL reference saved with it (an earlier state of the adapters) swaps in to
    compute the writer's reference log-probs."""
    run_spawned(_checkpoint_worker, 2, str(tmp_path / "ckpt"), str(tmp_path / "writer.pt"), True)
    run_spawned(_checkpoint_worker, 1, str(tmp_path / "ckpt"), str(tmp_path / "reader.pt"), False)
    writer, reader = (torch.load(tmp_path / f"{name}.pt", weights_only=False) for name in ("writer", "reader"))
    # the KL reference is the adapters only (the rest is frozen): here 2 of each of the 4 layers' 4 adapters
    assert writer["reference_size"] == 2 * 4 * MODEL["num_layers"]
    assert _close(reader["reference_logprobs"], writer["reference_logprobs"], 2e-5)
    for name, value in writer["at_save"].items():
        assert torch.allclose(reader["at_save"][name], value, atol=1e-6), name
    assert reader["next"]["loss"] == pytest.approx(writer["next"]["loss"], rel=1e-6)
    assert reader["next"]["grad_norm"] == pytest.approx(writer["next"]["grad_norm"], rel=1e-5)
    for name, value in writer["after"].items():
        assert torch.allclose(reader["after"][name], value, atol=1e-5), name
