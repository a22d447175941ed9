"""The data-parallel fast path (parallel.use_distributed_optimizer, overlap_grad_reduce, overlap_param_gather:
the GPU defaults) changes when the data-parallel collectives run, not what they compute.

One spawned pair of processes (DP=2, gloo) runs every mode of `MODES` in turn from the same weights over the same
batches, with buckets small enough that the model spans several (the all-gathers of overlap_param_gather are
chained from bucket to bucket, the reduce of overlap_grad_reduce starts per bucket). Each mode takes four
optimizer steps, and after each step one of the readers that see the weights without a forward, where
overlap_param_gather leaves the other rank's parameter shards to the next forward unless the trainer gathers them:
the colocated weight sync into the hf engine, a training checkpoint with an HF export (CheckpointManager), a
snapshot of the weights (the KL reference policy), and last the log-prob forward, which the forward pre-hooks
gather for. A batch of one sample leaves one rank a row of padding, whose gradient must reach every weight for
overlap_grad_reduce to start the reduction. Four ranks at PP=2 x DP=2 run the plain mode and the one with all
three on again (each stage has buckets and hooks of its own; Megatron buckets only the first stage), and so do
two ranks of a Qwen3-MoE at EP=2 (the experts have buffers and bucket groups of their own, reduced over the
expert-data-parallel group; the ranks exchange tokens, so the one-sample step gives a rank rows of padding).

Compared: each reader against the trainer's gathered weights right after (exactly: the same numbers must arrive),
and every mode against the plain one (no distributed optimizer, no overlap). Tolerances (fp32): the distributed
optimizer reduces the same gradients in another order (reduce-scatter shards, the gradient norm summed per shard,
both following the buckets), so losses agree to rounding (rel 1e-6; observed 6e-8), log-probs by 2e-5 (observed
1e-6) and weights after four Adam steps at lr 1e-3 by 1e-5 (observed 2.2e-6: Adam scales rounding by lr / eps
where a gradient is near eps), while a step computed from stale weights or another gradient moves weights by
~lr = 1e-3. Modes that differ only in overlap_param_gather, and overlap_grad_reduce without the distributed
optimizer (two ranks sum in one order whatever the buckets), agree bit for bit. A checkpoint written with
overlap_param_gather resumes in a run without it; one written with either optimizer is refused by a run with the
other, naming the fix.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import run_spawned

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

# name: (use_distributed_optimizer, overlap_grad_reduce, overlap_param_gather)
MODES = {
    "plain": (False, False, False),
    "overlap_grad_reduce": (False, True, False),
    "distopt": (True, False, False),
    "distopt_overlap_grad_reduce": (True, True, False),
    "distopt_overlap_param_gather": (True, False, True),
    "distopt_overlap_both": (True, True, True),
}
MODEL = dict(family="qwen2", num_layers=2, tie_word_embeddings=False)  # untied: the output weight is its own
MOE = dict(family="qwen3_moe", num_layers=2, num_experts=4, moe_ffn_hidden_size=64, tie_word_embeddings=False)
# layout: (tp, pp, ep, world size, model, modes)
LAYOUTS = {"dp2": (1, 1, 1, 2, MODEL, list(MODES)),
           "pp2_dp2": (1, 2, 1, 4, MODEL, ["plain", "distopt_overlap_both"]),
           "moe_ep2": (1, 1, 2, 2, MOE, ["plain", "distopt_overlap_both"])}
BUCKET = 40_000  # parameters per bucket (with overlap_grad_reduce): the model's 0.4M make ten
READERS = ("sync", "checkpoint", "snapshot", "forward")  # one after each optimizer step, in this order


def _batch(step: int):
    from megatron_rl.trainer.packing import Sample

    gen = torch.Generator().manual_seed(100 + step)
    lengths = (23,) if step == 1 else (9, 17, 30, 12, 25, 6)  # step 1: one sample, the other rank pads
    samples = []
    for n in lengths:
        tokens = torch.randint(0, 128, (n,), generator=gen)
        mask = torch.ones(n - 1)
        mask[: n // 3] = 0.0
        samples.append(Sample(tokens, mask))
    return samples


def _trainer(model_cfg, groups, distopt: bool, overlap_grad: bool, overlap_param: bool):
    from megatron_rl.config.schema import OptimizerConfig
    from megatron_rl.trainer.core import Trainer, TrainerOptions

    return Trainer(model_cfg, OptimizerConfig(lr=1e-3), groups,
                   TrainerOptions(micro_batch_tokens=48, use_distributed_optimizer=distopt,
                                  overlap_grad_reduce=overlap_grad, overlap_param_gather=overlap_param,
                                  ddp_bucket_size=BUCKET, total_steps=10))


def _as_hf(trainer) -> dict[str, torch.Tensor]:
    """The trainer's weights, all-gathered, in the HF layout the engine and an export hold (every rank calls)."""
    from megatron_rl.families import get_converter

    return get_converter(trainer.model_cfg.family).megatron_to_hf(trainer.full_state_dict(), trainer.model_cfg)


def _run_mode(trainer, run_dir: Path) -> dict:
    """Four steps, each followed by one reader (`READERS`); what each read and the gathered weights after it."""
    from megatron_rl.checkpoint.manager import CheckpointManager
    from megatron_rl.colocate.controller import ColocationController
    from megatron_rl.config.job import CheckpointConfig
    from megatron_rl.rollout.hf_engine import HFEngine

    engine = HFEngine(trainer.model_cfg)
    engine.release_memory()
    controller = ColocationController(trainer, engine)
    manager = CheckpointManager(CheckpointConfig(save_every=2, hf_export_every=2, keep_last=1), run_dir, trainer,
                                {"model": dataclasses.asdict(trainer.model_cfg)}, total_steps=10)
    out: dict = {"metrics": []}
    for step, reader in enumerate(READERS):
        out["metrics"].append(trainer.train_step(_batch(step)))
        if reader == "sync":  # what the engine holds while it generates
            out["synced"] = controller.rollout(engine.hf_state_dict)
            out["synced_expected"] = _as_hf(trainer)
        elif reader == "checkpoint":
            manager.after_step(step + 1, extra=dict)
            out["saved_expected"] = trainer.full_state_dict()
            out["exported_expected"] = _as_hf(trainer)
        elif reader == "snapshot":  # this rank's parameters (its pipeline stage's, whole at TP=1)
            names = [name for name, _ in trainer.module.named_parameters()]
            out["snapshot"] = dict(zip(names, trainer.snapshot_weights()))
            trainer.full_state_dict()  # gathers
            out["snapshot_expected"] = {name: p.detach().clone() for name, p in trainer.module.named_parameters()}
        else:
            out["logprobs"], _ = trainer.forward_logprobs(_batch(9))
    out["final"] = trainer.full_state_dict()
    return out


def _read_back(run_dir: Path, model_cfg, groups, distopt: bool) -> dict:
    """The mode's checkpoint loaded by a fresh trainer without overlap (weights), the HF export as written, and
    the refusal of a trainer with the other optimizer."""
    from safetensors.torch import load_file

    from megatron_rl.checkpoint.training import find_latest, load_checkpoint

    checkpoint = find_latest(run_dir / "checkpoints")
    reader = _trainer(model_cfg, groups, distopt, False, False)
    load_checkpoint(reader, checkpoint)
    result = {"loaded": reader.full_state_dict(), "exported": load_file(run_dir / "hf" / "step_00000002" /
                                                                       "model.safetensors")}
    try:
        load_checkpoint(_trainer(model_cfg, groups, not distopt, False, False), checkpoint)
    except ValueError as exc:
        result["refused"] = str(exc)
    return result


def _worker(rank: int, world: int, tp: int, pp: int, ep: int, model: dict, modes: list[str], root: str,
            out: str) -> None:
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.hf import random_state_dict
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    model_cfg = ModelConfig(**model)
    full = random_state_dict(model_cfg, seed=3)
    results = {}
    for name in modes:
        groups = state.initialize(tp, pp, ep=ep)
        trainer = _trainer(model_cfg, groups, *MODES[name])
        trainer.load_full_state_dict(full)
        run_dir = Path(root) / name
        results[name] = _run_mode(trainer, run_dir)
        results[name].update(_read_back(run_dir, model_cfg, groups, MODES[name][0]))
        state.destroy()
    if rank == 0:
        torch.save(results, out)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overlap")
    got = {}
    for layout, (tp, pp, ep, world, model, modes) in LAYOUTS.items():
        run_spawned(_worker, world, tp, pp, ep, model, modes, str(tmp / layout), str(tmp / f"{layout}.pt"), timeout_s=600)
        got[layout] = torch.load(tmp / f"{layout}.pt", weights_only=False)
    return got


CASES = [(layout, mode) for layout, (*_, modes) in LAYOUTS.items() for mode in modes]


def _max_diff(got: dict, expected: dict) -> float:
    assert sorted(got) == sorted(expected)
    return max((got[k] - expected[k]).abs().max().item() for k in expected)


@pytest.mark.parametrize("layout,mode", CASES)
@pytest.mark.parametrize("reader", ["synced", "loaded", "exported", "snapshot"])
def test_what_a_reader_gets_right_after_a_step_is_the_updated_weights(results, layout, mode, reader):
    """Weight sync, checkpoint (and the run resuming from it), HF export, reference snapshot: bit-exact."""
    r = results[layout][mode]
    if reader == "loaded":  # the checkpoint as a resumed trainer loads it
        got, expected = r["loaded"], r["saved_expected"]
    else:
        got, expected = r[reader], r[f"{reader}_expected"]
    assert _max_diff(got, expected) == 0.0


@pytest.mark.parametrize("layout,mode", [case for case in CASES if case[1] != "plain"])
def test_every_mode_trains_as_the_plain_one(results, layout, mode):
    plain, r = results[layout]["plain"], results[layout][mode]
    for step, (got, want) in enumerate(zip(r["metrics"], plain["metrics"])):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6), step
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), step
    for lp, want in zip(r["logprobs"], plain["logprobs"]):  # the forward right after a step (hooks gather)
        assert (lp - want).abs().max() <= 2e-5
    for reader in ("synced", "exported", "snapshot", "final"):
        assert _max_diff(r[reader], plain[reader]) <= 1e-5, reader


# (mode, the mode it must equal bit for bit)
SAME = [("overlap_grad_reduce", "plain"), ("distopt_overlap_param_gather", "distopt"),
        ("distopt_overlap_both", "distopt_overlap_grad_reduce")]


@pytest.mark.parametrize("mode,same_as", SAME)
def test_overlap_changes_nothing_where_the_reduction_order_stays(results, mode, same_as):
    r, other = results["dp2"][mode], results["dp2"][same_as]
    assert [m["loss"] for m in r["metrics"]] == [m["loss"] for m in other["metrics"]]
    assert [m["grad_norm"] for m in r["metrics"]] == [m["grad_norm"] for m in other["metrics"]]
    assert all(torch.equal(a, b) for a, b in zip(r["logprobs"], other["logprobs"]))
    for reader in ("synced", "exported", "snapshot", "final"):
        assert _max_diff(r[reader], other[reader]) == 0.0, reader


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_steps_move_the_weights(results, layout):
    """Guards the comparisons against steps that change nothing: each step moves weights by ~lr."""
    plain = results[layout]["plain"]
    assert _max_diff(plain["final"], plain["saved_expected"]) > 1e-4
    assert _max_diff(plain["synced"], plain["exported_expected"]) > 1e-4


@pytest.mark.parametrize("layout,mode", CASES)
def test_a_checkpoint_is_refused_by_the_other_optimizer(results, layout, mode):
    distopt = MODES[mode][0]
    refused = results[layout][mode]["refused"]
    assert f"parallel.use_distributed_optimizer={str(distopt).lower()}, this run has {str(not distopt).lower()}" \
        in refused
    assert f"set parallel.use_distributed_optimizer={str(distopt).lower()} to resume" in refused
    assert "on when the trainer runs on GPUs and off on CPU" in refused
