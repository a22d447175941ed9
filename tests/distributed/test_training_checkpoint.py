"""Training checkpoints: a TP=2 checkpoint resumes at TP=1 and at PP=2 with the same weights
and the same next step; a crash in the middle of a save leaves the previous checkpoint as
the one resume picks; retention and mismatch errors."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import run_spawned

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def _setup(tp, pp, distopt=False):
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions

    if not torch.distributed.is_initialized():
        mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    groups = state.initialize(tp, pp)
    trainer = Trainer(ModelConfig(num_layers=4), OptimizerConfig(lr=1e-3, lr_warmup_steps=2, lr_decay_style="cosine"),
                      groups, TrainerOptions(micro_batch_tokens=40, total_steps=10,
                                             use_distributed_optimizer=distopt))
    trainer.initialize_weights()
    return trainer


def _batch(step):
    from megatron_rl.trainer.packing import Sample

    gen = torch.Generator().manual_seed(100 + step)
    return [Sample(torch.randint(0, 99, (n,), generator=gen), torch.ones(n - 1)) for n in (12, 7, 19, 9)]


def _config_for(trainer):
    import dataclasses

    return {"model": dataclasses.asdict(trainer.model_cfg)}


def _writer(rank, world, root, out, tp=2, distopt=False):
    from megatron_rl.checkpoint.training import save_checkpoint

    trainer = _setup(tp=tp, pp=1, distopt=distopt)
    for step in range(2):
        trainer.train_step(_batch(step))
    save_checkpoint(trainer, Path(root), 2, {"sampler": {"position": 8}}, _config_for(trainer))
    at_save = trainer.full_state_dict()
    metrics = trainer.train_step(_batch(2))
    after = trainer.full_state_dict()
    if rank == 0:
        torch.save({"at_save": at_save, "metrics": metrics, "after": after}, out)


def _reader(rank, world, root, tp, pp, out, distopt=False):
    from megatron_rl.checkpoint.training import find_latest, load_checkpoint

    trainer = _setup(tp=tp, pp=pp, distopt=distopt)
    extra = load_checkpoint(trainer, find_latest(Path(root)))
    loaded = trainer.full_state_dict()
    metrics = trainer.train_step(_batch(2))
    after = trainer.full_state_dict()
    if rank == 0:
        torch.save({"extra": extra, "loaded": loaded, "metrics": metrics, "after": after, "step": trainer.step}, out)


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    root = tmp / "checkpoints"
    run_spawned(_writer, 2, str(root), str(tmp / "writer.pt"))
    run_spawned(_reader, 1, str(root), 1, 1, str(tmp / "tp1.pt"))
    run_spawned(_reader, 2, str(root), 1, 2, str(tmp / "pp2.pt"))
    load = lambda name: torch.load(tmp / name, weights_only=False)  # noqa: E731
    return root, load("writer.pt"), {"tp1": load("tp1.pt"), "pp2": load("pp2.pt")}


def test_checkpoint_directory_is_complete(resharded):
    root, _, _ = resharded
    assert (root / "latest").read_text().strip() == "step_00000002"
    meta = json.loads((root / "step_00000002" / "meta.json").read_text())
    assert meta["step"] == 2 and meta["layout"]["tp"] == 2
    assert sorted(p.name for p in (root / "step_00000002" / "rng").iterdir()) == ["rank0.pt", "rank1.pt"]
    # the manifest covers both ranks' files (each rank hashed its own, rank 0 the common ones), digests by hashlib
    ckpt = root / "step_00000002"
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    on_disk = {p.relative_to(ckpt).as_posix(): p for p in ckpt.rglob("*") if p.is_file()}
    assert set(files) == set(on_disk) - {"meta.json", "manifest.json"}
    assert {"__0_0.distcp", "__1_0.distcp", "rng/rank0.pt", "rng/rank1.pt", "common.pt", ".metadata"} <= set(files)
    for name, entry in files.items():
        data = on_disk[name].read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


@pytest.mark.parametrize("layout", ["tp1", "pp2"])
def test_loaded_weights_are_bit_identical(resharded, layout):
    _, writer, readers = resharded
    got = readers[layout]
    assert got["step"] == 3 and got["extra"] == {"sampler": {"position": 8}}
    for key, value in writer["at_save"].items():
        assert torch.equal(got["loaded"][key], value), key


@pytest.mark.parametrize("layout", ["tp1", "pp2"])
def test_next_step_matches_the_run_that_wrote_it(resharded, layout):
    """Same optimizer moments and LR schedule position: the next step agrees to fp32 rounding."""
    _, writer, readers = resharded
    got = readers[layout]
    assert got["metrics"]["loss"] == pytest.approx(writer["metrics"]["loss"], rel=1e-6)
    assert got["metrics"]["lr"] == writer["metrics"]["lr"]
    assert got["metrics"]["grad_norm"] == pytest.approx(writer["metrics"]["grad_norm"], rel=1e-5)
    for key, value in writer["after"].items():
        assert (got["after"][key] - value).abs().max() <= 1e-6, key


def test_distributed_optimizer_checkpoint_resumes_at_dp2_and_dp1(tmp_path):
    """Distributed-optimizer state (sharded over DP) saved at DP=2 resumes at DP=2 and at DP=1;
    resuming it with the plain optimizer is refused with the fix."""
    root = tmp_path / "checkpoints"
    run_spawned(_writer, 2, str(root), str(tmp_path / "writer.pt"), 1, True)
    run_spawned(_reader, 2, str(root), 1, 1, str(tmp_path / "dp2.pt"), True)
    run_spawned(_reader, 1, str(root), 1, 1, str(tmp_path / "dp1.pt"), True)
    with pytest.raises(Exception):
        run_spawned(_reader, 1, str(root), 1, 1, str(tmp_path / "plain.pt"), False)
    writer = torch.load(tmp_path / "writer.pt", weights_only=False)
    for name in ("dp2.pt", "dp1.pt"):
        got = torch.load(tmp_path / name, weights_only=False)
        for key, value in writer["at_save"].items():
            assert torch.equal(got["loaded"][key], value), (name, key)
        assert got["metrics"]["loss"] == pytest.approx(writer["metrics"]["loss"], rel=1e-6)
        assert got["metrics"]["grad_norm"] == pytest.approx(writer["metrics"]["grad_norm"], rel=1e-5)
        for key, value in writer["after"].items():
            assert (got["after"][key] - value).abs().max() <= 1e-6, (name, key)


def _crash_during_save(rank, world, root):
    from megatron_rl.checkpoint.training import save_checkpoint

    trainer = _setup(tp=1, pp=1)
    trainer.train_step(_batch(0))
    save_checkpoint(trainer, Path(root), 1, {}, _config_for(trainer))
    trainer.train_step(_batch(1))
    real_save = torch.save

    def dying_save(obj, f, *args, **kwargs):
        if "step_00000002.tmp" in str(f):
            os._exit(17)  # the process dies in the middle of writing checkpoint 2
        return real_save(obj, f, *args, **kwargs)

    torch.save = dying_save
    save_checkpoint(trainer, Path(root), 2, {}, _config_for(trainer))


def _resume_after_crash(rank, world, root, out):
    from megatron_rl.checkpoint.training import find_latest, load_checkpoint, save_checkpoint

    trainer = _setup(tp=1, pp=1)
    latest = find_latest(Path(root))
    load_checkpoint(trainer, latest)
    resumed_step = trainer.step
    trainer.train_step(_batch(1))
    save_checkpoint(trainer, Path(root), 2, {}, _config_for(trainer))
    torch.save({"latest": latest.name, "step": resumed_step}, out)


def test_crash_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    with pytest.raises(Exception):
        run_spawned(_crash_during_save, 1, str(root))
    assert (root / "step_00000002.tmp").is_dir(), "the crash must have happened mid-save"
    assert not (root / "step_00000002").exists()
    run_spawned(_resume_after_crash, 1, str(root), str(tmp_path / "out.pt"))
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    assert out["latest"] == "step_00000001" and out["step"] == 1
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert not (root / "step_00000002.tmp").exists(), "the stale partial save is cleaned up"


def test_retention_keeps_last_n_and_every_k(tmp_path):
    from megatron_rl.checkpoint.training import _apply_retention, list_checkpoints, step_dir

    for step in range(1, 8):
        step_dir(tmp_path, step).mkdir()
        (step_dir(tmp_path, step) / "meta.json").write_text("{}")
    _apply_retention(tmp_path, keep_last=2, keep_every=3)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 6, 7]
    # a directory holding higher steps of an earlier run: the checkpoint just saved (step 2) stays
    step_dir(tmp_path, 2).mkdir()
    (step_dir(tmp_path, 2) / "meta.json").write_text("{}")
    _apply_retention(tmp_path, keep_last=2, keep_every=None, saved=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 6, 7]


def test_retention_keeps_the_best_by_a_metric(tmp_path):
    import json

    from megatron_rl.checkpoint.training import KeepBest, _apply_retention, list_checkpoints, step_dir

    accuracy = {1: 0.2, 2: 0.6, 3: None, 4: 0.6, 5: 0.1, 6: 0.3}  # step 3: no evaluation at that step
    for step, value in accuracy.items():
        step_dir(tmp_path, step).mkdir()
        metrics = {} if value is None else {"eval/accuracy": value}
        (step_dir(tmp_path, step) / "meta.json").write_text(json.dumps({"metrics": metrics}))
    _apply_retention(tmp_path, keep_last=1, keep_every=None, keep_best=KeepBest(2, "eval/accuracy"))
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4, 6]  # the two 0.6s and the newest
    assert (tmp_path / "best").read_text().strip() == "step_00000004"  # a tie goes to the later step
    _apply_retention(tmp_path, keep_last=1, keep_every=None, keep_best=KeepBest(1, "eval/accuracy", "min"))
    assert [s for s, _ in list_checkpoints(tmp_path)] == [6]  # 0.3 is now the lowest (and the newest)
    assert (tmp_path / "best").read_text().strip() == "step_00000006"


def test_incomplete_checkpoints_are_never_picked(tmp_path):
    from megatron_rl.checkpoint.training import find_latest, step_dir

    step_dir(tmp_path, 1).mkdir()
    (step_dir(tmp_path, 1) / "meta.json").write_text("{}")
    step_dir(tmp_path, 2).mkdir()  # no meta.json: a save that never finished
    (tmp_path / "latest").write_text("step_00000002\n")
    assert find_latest(tmp_path) == step_dir(tmp_path, 1)


def test_mismatched_architecture_names_the_checkpoint_and_field(tmp_path):
    from megatron_rl.checkpoint.training import check_compatible
    from megatron_rl.config.schema import ModelConfig

    (tmp_path / "meta.json").write_text(json.dumps({"config": {"model": {"hidden_size": 256, "family": "qwen2"}}}))
    with pytest.raises(ValueError, match=rf"checkpoint {tmp_path} was written for model.hidden_size=256, "
                                         r"this run has model.hidden_size=128"):
        check_compatible(tmp_path, ModelConfig())
    # rope scaling changes no weight's shape, only what the trained weights mean
    (tmp_path / "meta.json").write_text(json.dumps({"config": {"model": {"rope_scaling_factor": 8.0}}}))
    with pytest.raises(ValueError, match=r"model.rope_scaling_factor=8.0, this run has model.rope_scaling_factor=None"):
        check_compatible(tmp_path, ModelConfig())
    # nor do the RoPE base and the norms' epsilon (a resume or export that rebuilds the model from another config)
    for key, saved in (("rope_theta", 1000000.0), ("norm_eps", 1e-05)):
        (tmp_path / "meta.json").write_text(json.dumps({"config": {"model": {key: saved}}}))
        with pytest.raises(ValueError, match=rf"model.{key}={saved}, this run has model.{key}="):
            check_compatible(tmp_path, ModelConfig())
    # nor does how much of each head RoPE turns, or the expert layout
    glm = ModelConfig(family="glm4_moe", num_experts=4, moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=64,
                      moe_dense_layers=[0], rotary_percent=0.5)
    for key, saved in (("rotary_percent", 1.0), ("moe_dense_layers", [0, 1])):
        (tmp_path / "meta.json").write_text(json.dumps({"config": {"model": {key: saved}}}))
        with pytest.raises(ValueError, match=rf"model.{key}={re.escape(str(saved))}, this run has model.{key}="):
            check_compatible(tmp_path, glm)
    # LoRA: the adapters' shapes, and alpha: what the merged model is
    for key, saved in (("lora_rank", 8), ("lora_alpha", 32.0)):
        (tmp_path / "meta.json").write_text(json.dumps({"config": {"model": {key: saved}}}))
        with pytest.raises(ValueError, match=rf"model.{key}={saved}, this run has model.{key}="):
            check_compatible(tmp_path, ModelConfig(lora_rank=4))


def _moe_setup(ep, dense_layers, tp=1, etp=None, distopt=False):
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions

    if not torch.distributed.is_initialized():
        mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    groups = state.initialize(tp, 1, ep=ep, etp=etp, sequence_parallel=tp > 1)
    model_cfg = ModelConfig(family="qwen3_moe", num_layers=3, num_experts=4, moe_ffn_hidden_size=64,
                            moe_dense_layers=dense_layers)
    trainer = Trainer(model_cfg, OptimizerConfig(lr=1e-3), groups,
                      TrainerOptions(micro_batch_tokens=40, use_distributed_optimizer=distopt))
    trainer.initialize_weights()
    return trainer


def _moe_writer(rank, world, root, dense_layers, out, distopt=False):
    from megatron_rl.checkpoint.training import save_checkpoint

    trainer = _moe_setup(2, dense_layers, distopt=distopt)
    trainer.train_step(_batch(0))
    save_checkpoint(trainer, Path(root), 1, {}, _config_for(trainer))
    at_save = trainer.full_state_dict()
    metrics = trainer.train_step(_batch(1))
    after = trainer.full_state_dict()
    if rank == 0:
        torch.save({"at_save": at_save, "metrics": metrics, "after": after}, out)


def _moe_reader(rank, world, root, ep, dense_layers, out, tp=1, etp=None, distopt=False):
    from megatron_rl.checkpoint.training import find_latest, load_checkpoint

    trainer = _moe_setup(ep, dense_layers, tp, etp, distopt)
    try:
        load_checkpoint(trainer, find_latest(Path(root)))
    except ValueError as exc:
        result = {"error": str(exc)}
    else:
        result = {"loaded": trainer.full_state_dict(), "metrics": trainer.train_step(_batch(1)),
                  "after": trainer.full_state_dict()}
    if rank == 0:
        torch.save(result, out)


@pytest.mark.parametrize("dense_layers", [[], [1]], ids=["all_sparse", "dense_layer_1"])
def test_moe_checkpoint_resumes_at_its_expert_parallel_size_and_refuses_another(tmp_path, dense_layers):
    """EP=2 (the two ranks hold different experts): resuming gives the saved weights and the same
    next step; resuming at EP=1 is refused up front (Megatron-core cannot reshape the optimizer).
    With a dense layer among the sparse ones Megatron's sharded state dict is per layer."""
    root = tmp_path / "checkpoints"
    run_spawned(_moe_writer, 2, str(root), dense_layers, str(tmp_path / "writer.pt"))
    run_spawned(_moe_reader, 2, str(root), 2, dense_layers, str(tmp_path / "ep2.pt"))
    run_spawned(_moe_reader, 2, str(root), 1, dense_layers, str(tmp_path / "ep1.pt"))
    writer, same = torch.load(tmp_path / "writer.pt"), torch.load(tmp_path / "ep2.pt")
    assert sorted(same["loaded"]) == sorted(writer["at_save"])
    assert any(".1.mlp.linear_fc1." in key for key in writer["at_save"]) == bool(dense_layers)
    for key, value in writer["at_save"].items():
        assert torch.equal(same["loaded"][key], value), key
    assert same["metrics"]["loss"] == pytest.approx(writer["metrics"]["loss"], rel=1e-6)
    assert same["metrics"]["grad_norm"] == pytest.approx(writer["metrics"]["grad_norm"], rel=1e-5)
    error = torch.load(tmp_path / "ep1.pt")["error"]
    assert "parallel.ep=2" in error and "parallel.ep=1" in error and str(root) in error
    assert "an optimizer of their own" in error and "the dense optimizer" in error


@pytest.mark.parametrize("distopt", [False, True], ids=["adam", "distributed_optimizer"])
def test_moe_checkpoint_reshards_between_layouts_that_keep_an_expert_optimizer(tmp_path, distopt):
    """Written at EP=2 on two ranks, resumed at EP=4 on four ranks (one expert each) and at EP=1 with the
    experts unsplit over TP=2 (etp=1: they keep an optimizer of their own there too): the loaded weights are
    the saved ones and the next step is the writer's, weights included, so the optimizer state resharded with
    the experts. A fresh Adam's first step moves every weight by lr = 1e-3 (the sign of its gradient), which a
    step with the saved moments does not; the readers' steps differ from the writer's by 2e-7 (EP=4) and up to
    7.8e-6 (TP=2 with sequence parallelism, at one element: its re-ordered gradient sums differ by rounding,
    which Adam scales by lr / eps where a gradient is near eps = 1e-8): 5e-5. Also with the distributed
    optimizer, whose expert state is sharded over the expert-data-parallel ranks (one at EP=4, two at TP=2 x
    etp=1)."""
    root = tmp_path / "checkpoints"
    run_spawned(_moe_writer, 2, str(root), [1], str(tmp_path / "writer.pt"), distopt)
    run_spawned(_moe_reader, 4, str(root), 4, [1], str(tmp_path / "ep4.pt"), 1, None, distopt)
    run_spawned(_moe_reader, 2, str(root), 1, [1], str(tmp_path / "tp2_etp1.pt"), 2, 1, distopt)
    writer = torch.load(tmp_path / "writer.pt")
    for name in ("ep4", "tp2_etp1"):
        got = torch.load(tmp_path / f"{name}.pt")
        assert "error" not in got, got.get("error")
        for key, value in writer["at_save"].items():
            assert torch.equal(got["loaded"][key], value), (name, key)
        assert got["metrics"]["loss"] == pytest.approx(writer["metrics"]["loss"], rel=1e-6)
        assert got["metrics"]["grad_norm"] == pytest.approx(writer["metrics"]["grad_norm"], rel=1e-5)
        for key, value in writer["after"].items():
            assert torch.allclose(got["after"][key], value, atol=5e-5), (name, key)


def _gpt_oss_setup(tp):
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions
    from tests.distributed.test_gpt_oss import ARCH

    if not torch.distributed.is_initialized():
        mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    groups = state.initialize(tp, 1, etp=1, sequence_parallel=tp > 1)
    trainer = Trainer(ModelConfig(**ARCH), OptimizerConfig(lr=1e-3), groups, TrainerOptions(micro_batch_tokens=40))
    trainer.initialize_weights()
    return trainer


def _gpt_oss_writer(rank, world, root, out):
    from megatron_rl.checkpoint.training import save_checkpoint

    trainer = _gpt_oss_setup(2)
    trainer.train_step(_batch(0))
    save_checkpoint(trainer, Path(root), 1, {}, _config_for(trainer))
    at_save = trainer.full_state_dict()
    metrics = trainer.train_step(_batch(1))
    if rank == 0:
        torch.save({"at_save": at_save, "metrics": metrics}, out)


def _gpt_oss_reader(rank, world, root, tp, out):
    from megatron_rl.checkpoint.training import find_latest, load_checkpoint

    trainer = _gpt_oss_setup(tp)
    try:
        load_checkpoint(trainer, find_latest(Path(root)))
    except ValueError as exc:
        result = {"error": str(exc)}
    else:
        result = {"loaded": trainer.full_state_dict(), "metrics": trainer.train_step(_batch(1))}
    if rank == 0:
        torch.save(result, out)


def test_gpt_oss_checkpoint_resumes_and_refuses_moving_its_experts_to_another_optimizer(tmp_path):
    """gpt-oss at TP=2 + SP with unsplit experts (their own optimizer, sinks split over the TP ranks): resuming
    gives the saved weights and the same next step; resuming at TP=1, where the experts are back in the dense
    optimizer, is refused up front (Megatron-core cannot load across that)."""
    root = tmp_path / "checkpoints"
    run_spawned(_gpt_oss_writer, 2, str(root), str(tmp_path / "writer.pt"))
    run_spawned(_gpt_oss_reader, 2, str(root), 2, str(tmp_path / "tp2.pt"))
    run_spawned(_gpt_oss_reader, 2, str(root), 1, str(tmp_path / "tp1.pt"))
    writer, same = torch.load(tmp_path / "writer.pt"), torch.load(tmp_path / "tp2.pt")
    assert any(key.endswith("core_attention.softmax_offset") for key in writer["at_save"])
    for key, value in writer["at_save"].items():
        assert torch.equal(same["loaded"][key], value), key
    assert same["metrics"]["loss"] == pytest.approx(writer["metrics"]["loss"], rel=1e-6)
    assert same["metrics"]["grad_norm"] == pytest.approx(writer["metrics"]["grad_norm"], rel=1e-5)
    error = torch.load(tmp_path / "tp1.pt")["error"]
    assert "an optimizer of their own" in error and "the dense optimizer" in error and str(root) in error


@pytest.mark.parametrize(("layout", "config", "etp"), [
    ({"tp": 2, "pp": 1, "ep": 1, "etp": 1}, {}, 1),  # recorded
    ({"tp": 2, "pp": 1}, {"model": {"family": "qwen3_moe"}}, 2),  # before parallel.etp: expert TP = tp
    ({"tp": 2, "pp": 1}, {"model": {"family": "gpt_oss"}, "parallel": {"etp": None}}, 1),  # gpt-oss's default
    ({"tp": 2, "pp": 1}, {"model": {"family": "qwen3_moe"}, "parallel": {"etp": 1}}, 1)])  # the run's setting
def test_saved_layout_fills_in_what_older_checkpoints_did_not_record(layout, config, etp):
    from megatron_rl.checkpoint.training import saved_layout_of

    got = saved_layout_of({"layout": layout, "config": config})
    assert (got["etp"], got["ep"], got["cp"]) == (etp, layout.get("ep", 1), 1)


def _reference_writer(rank, world, root, out):
    """TP=2: the KL reference is the policy before two steps; the checkpoint after them holds it."""
    from megatron_rl.checkpoint.training import save_checkpoint

    trainer = _setup(tp=2, pp=1)
    reference = trainer.snapshot_weights()
    want = trainer.full_state_dict()
    for step in range(2):
        trainer.train_step(_batch(step))
    save_checkpoint(trainer, Path(root), 2, {"reference": reference, "sampler": {"position": 8}},
                    _config_for(trainer))
    policy = trainer.full_state_dict()  # collective: every rank
    if rank == 0:
        torch.save({"reference": want, "policy": policy}, out)


def _reference_reader(rank, world, root, out, tp, pp):
    from megatron_rl.checkpoint.training import find_latest, load_checkpoint

    trainer = _setup(tp=tp, pp=pp)
    extra = load_checkpoint(trainer, find_latest(Path(root)))
    policy = trainer.full_state_dict()
    current = trainer.swap_weights(extra["reference"])
    reference = trainer.full_state_dict()
    trainer.swap_weights(current)
    after_swap = trainer.full_state_dict()
    if rank == 0:
        torch.save({"reference": reference, "policy": policy, "after_swap": after_swap,
                    "sampler": extra["sampler"]}, out)


@pytest.mark.parametrize("tp, pp", [(1, 2)], ids=["pp2"])
def test_the_kl_reference_resumes_with_each_ranks_own_shards(tmp_path, tp, pp):
    """Written at TP=2, read at PP=2: every rank gets its own part of the reference back, resharded (it
    travelled in rank 0's common state before: a TP=2 resume gave rank 1 rank 0's shards, and a PP=2
    one lists of the other stage's tensors). One layout: each reader is two spawned ranks on CPU."""
    root, written, read = tmp_path / "ckpt", tmp_path / "w.pt", tmp_path / "r.pt"
    run_spawned(_reference_writer, 2, str(root), str(written))
    run_spawned(_reference_reader, 2, str(root), str(read), tp, pp)
    want, got = torch.load(written, weights_only=False), torch.load(read, weights_only=False)
    assert got["sampler"] == {"position": 8}
    moved = [k for k in want["reference"] if not torch.equal(want["reference"][k], want["policy"][k])]
    assert moved  # the two steps changed the policy: the reference is another model
    for name, tensor in want["reference"].items():
        assert torch.equal(got["reference"][name], tensor), name
        assert torch.equal(got["policy"][name], want["policy"][name]), name
        assert torch.equal(got["after_swap"][name], want["policy"][name]), name


def _schedule_worker(rank, world, root, out):
    import dataclasses

    from megatron_rl.checkpoint.training import find_latest, load_checkpoint, save_checkpoint

    short = _setup(tp=1, pp=1)  # total_steps 10: warmup 2, cosine to step 10
    lrs_short = [short.train_step(_batch(step))["lr"] for step in range(2)]
    save_checkpoint(short, Path(root), 2, {}, _config_for(short))
    lrs_short.append(short.train_step(_batch(2))["lr"])
    longer = _setup(tp=1, pp=1)
    longer.options = dataclasses.replace(longer.options, total_steps=20)
    longer.reset_optimizer(longer_optimizer(), 20)
    load_checkpoint(longer, find_latest(Path(root)))
    resumed = longer.train_step(_batch(2))["lr"]
    fresh = _setup(tp=1, pp=1)
    fresh.reset_optimizer(longer_optimizer(), 20)
    lrs_fresh = [fresh.train_step(_batch(step))["lr"] for step in range(3)]
    torch.save({"short": lrs_short, "resumed": resumed, "fresh": lrs_fresh}, out)


def longer_optimizer():
    from megatron_rl.config.schema import OptimizerConfig

    return OptimizerConfig(lr=1e-3, lr_warmup_steps=2, lr_decay_style="cosine")


def test_a_resumed_run_follows_its_own_schedule(tmp_path):
    """num_steps extended from 10 to 20 at resume: the next step's LR is that of a 20-step schedule (it kept
    the checkpoint's 10-step decay before, reaching min_lr at step 10 and staying there)."""
    out = tmp_path / "lr.pt"
    run_spawned(_schedule_worker, 1, str(tmp_path / "ckpt"), str(out))
    got = torch.load(out, weights_only=False)
    assert got["resumed"] == pytest.approx(got["fresh"][2], rel=1e-12)
    assert got["fresh"][2] != pytest.approx(got["short"][2], rel=1e-6)


def _rng_writer(rank, world, root, out):
    from megatron_rl.checkpoint.training import save_checkpoint

    trainer = _setup(tp=1, pp=1)
    trainer.train_step(_batch(0))
    save_checkpoint(trainer, Path(root), 1, {}, _config_for(trainer))
    torch.save({"next_draw": torch.rand(4)}, out)  # what the saved RNG state draws next


def _rng_reader(rank, world, root, out):
    from megatron_rl.checkpoint.training import find_latest, load_checkpoint

    trainer = _setup(tp=1, pp=1)
    torch.manual_seed(999)  # a state of its own, unlike the saved one
    load_checkpoint(trainer, find_latest(Path(root)))
    torch.save({"next_draw": torch.rand(4)}, out)


def test_rng_states_are_restored_on_the_same_device_type_only(tmp_path):
    """A checkpoint's RNG states (CPU generators on a CPU run, CUDA ones on a GPU run) are restored at the same
    layout on the same device type; meta.json's "device" says which (missing: written on CPU). Marked as
    written on a GPU, this CPU checkpoint's states are left alone (a CUDA generator refuses a CPU state)."""
    root = tmp_path / "checkpoints"
    run_spawned(_rng_writer, 1, str(root), str(tmp_path / "saved.pt"))
    saved = torch.load(tmp_path / "saved.pt")["next_draw"]
    meta_path = root / "step_00000001" / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["device"] == "cpu"
    run_spawned(_rng_reader, 1, str(root), str(tmp_path / "same.pt"))
    assert torch.equal(torch.load(tmp_path / "same.pt")["next_draw"], saved)
    meta_path.write_text(json.dumps({**meta, "device": "cuda"}))
    run_spawned(_rng_reader, 1, str(root), str(tmp_path / "other.pt"))
    assert not torch.equal(torch.load(tmp_path / "other.pt")["next_draw"], saved)
    del meta["device"]  # written before the device was recorded: a CPU run's
    meta_path.write_text(json.dumps(meta))
    run_spawned(_rng_reader, 1, str(root), str(tmp_path / "old.pt"))
    assert torch.equal(torch.load(tmp_path / "old.pt")["next_draw"], saved)
