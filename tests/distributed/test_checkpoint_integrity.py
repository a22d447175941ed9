"""Damaged training checkpoints are named and skipped: a save writes a manifest (size and SHA-256 of every
file) before meta.json and `latest`; a file truncated, zeroed, changed or deleted afterwards is reported with
the file and the kind of damage, resuming falls back to the newest intact checkpoint (and logs it), and
reading the weights (evaluation, export) refuses it. Expected digests come from hashlib over the bytes on
disk, not from the code under test."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import run_spawned
from tests.distributed.test_training_checkpoint import _batch, _config_for, _setup

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

STEP_1, STEP_2 = "step_00000001", "step_00000002"
TENSOR_DATA = "__0_0.distcp"  # rank 0's model and optimizer tensors (torch_dist)


def _two_saves(rank, world, root, die_before_latest=False):
    """Checkpoints after steps 1 and 2; `die_before_latest` kills the process in the second save when every
    file is written and renamed into place, before `latest` moves (a crash earlier leaves `step_N.tmp`,
    which nothing reads: test_training_checkpoint.py)."""
    from megatron_rl.checkpoint import training

    trainer = _setup(tp=1, pp=1)
    for step in (1, 2):
        trainer.train_step(_batch(step))
        if step == 2 and die_before_latest:
            training._write_latest = lambda *a: os._exit(17)
        training.save_checkpoint(trainer, Path(root), step, {"sampler": {"position": step}}, _config_for(trainer))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity") / "checkpoints"
    run_spawned(_two_saves, 1, str(root))
    return root


@pytest.fixture
def checkpoints(saved, tmp_path):
    """A private copy of the two checkpoints, to damage."""
    root = tmp_path / "run" / "checkpoints"
    shutil.copytree(saved, root)
    return root


def _damage(file: Path, kind: str) -> None:
    data = file.read_bytes()
    if kind == "truncate":
        file.write_bytes(data[: len(data) // 2])
    elif kind == "zero":
        file.write_bytes(bytes(len(data)))
    elif kind == "flip":  # one byte inside the tensor data: same size, same pickled structure
        flipped = bytearray(data)
        flipped[len(data) * 3 // 4] ^= 0x01
        file.write_bytes(bytes(flipped))
    else:
        file.unlink()


def test_the_manifest_holds_every_file_with_its_size_and_digest(saved):
    for name in (STEP_1, STEP_2):
        ckpt = saved / name
        manifest = json.loads((ckpt / "manifest.json").read_text())
        on_disk = {p.relative_to(ckpt).as_posix(): p for p in ckpt.rglob("*") if p.is_file()}
        assert manifest["algorithm"] == "sha256"
        assert set(manifest["files"]) == set(on_disk) - {"meta.json", "manifest.json"}
        assert {TENSOR_DATA, "common.pt", ".metadata", "rng/rank0.pt"} <= set(manifest["files"])
        for file, entry in manifest["files"].items():
            data = on_disk[file].read_bytes()
            assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, file
        assert json.loads((ckpt / "meta.json").read_text())["manifest"] == "manifest.json"


EXPECTED = {"truncate": "size mismatch", "zero": "checksum mismatch", "flip": "checksum mismatch",
            "delete": "missing"}


@pytest.mark.parametrize("file", [TENSOR_DATA, "common.pt", "rng/rank0.pt"])
@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_a_damaged_checkpoint_is_named_and_resuming_falls_back(checkpoints, file, kind, caplog):
    from megatron_rl.checkpoint.integrity import checkpoint_damage
    from megatron_rl.checkpoint.training import find_intact

    _damage(checkpoints / STEP_2 / file, kind)
    (problem,) = checkpoint_damage(checkpoints / STEP_2)
    assert problem.startswith(f"{file}: {EXPECTED[kind]}"), problem
    assert checkpoint_damage(checkpoints / STEP_2, checksums=False) == ([] if EXPECTED[kind] == "checksum mismatch"
                                                                       else [problem])
    with caplog.at_level(logging.WARNING, logger="megatron_rl.checkpoint"):
        assert find_intact(checkpoints) == checkpoints / STEP_1
    log = caplog.text
    assert f"checkpoint {checkpoints / STEP_2} is damaged and is skipped: {file}: {EXPECTED[kind]}" in log
    assert f"resuming from {checkpoints / STEP_1}, the newest intact checkpoint (skipped as damaged: {STEP_2})" in log


def test_a_lost_manifest_is_damage_and_a_checkpoint_from_before_manifests_is_accepted(checkpoints, caplog):
    from megatron_rl.checkpoint.integrity import checkpoint_damage
    from megatron_rl.checkpoint.training import find_intact

    (checkpoints / STEP_2 / "manifest.json").unlink()
    assert checkpoint_damage(checkpoints / STEP_2) == [
        "manifest.json: missing (no manifest; meta.json says the save wrote one)"]
    assert find_intact(checkpoints) == checkpoints / STEP_1
    meta = json.loads((checkpoints / STEP_2 / "meta.json").read_text())
    del meta["manifest"]  # as every checkpoint written before manifests
    (checkpoints / STEP_2 / "meta.json").write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING, logger="megatron_rl.checkpoint"):
        assert find_intact(checkpoints) == checkpoints / STEP_2
    assert "was written before checksum manifests: its files cannot be verified" in caplog.text


def test_when_every_checkpoint_is_damaged_resuming_refuses(checkpoints):
    from megatron_rl.checkpoint.integrity import DamagedCheckpoint
    from megatron_rl.checkpoint.training import find_intact

    _damage(checkpoints / STEP_1 / TENSOR_DATA, "flip")
    _damage(checkpoints / STEP_2 / "rng/rank0.pt", "delete")
    with pytest.raises(DamagedCheckpoint, match=rf"every checkpoint under {checkpoints} is damaged "
                                                rf"\({STEP_2}/rng/rank0.pt: missing; {STEP_1}/{TENSOR_DATA}: "
                                                r"checksum mismatch"):
        find_intact(checkpoints)


def test_a_save_killed_before_latest_moves_leaves_the_previous_checkpoint_to_resume(tmp_path):
    from megatron_rl.checkpoint.integrity import checkpoint_damage
    from megatron_rl.checkpoint.training import find_intact

    root = tmp_path / "checkpoints"
    with pytest.raises(Exception):
        run_spawned(_two_saves, 1, str(root), True)
    assert (root / "latest").read_text().strip() == STEP_1 and (root / STEP_2 / "meta.json").is_file()
    assert find_intact(root) == root / STEP_1
    assert checkpoint_damage(root / STEP_1) == [] and checkpoint_damage(root / STEP_2) == []  # both whole


def _resume_and_read(rank, world, root, out):
    """Resume through the CheckpointManager (step 2 damaged), then read step 2's weights as eval/export do."""
    from types import SimpleNamespace

    from megatron_rl.checkpoint.integrity import DamagedCheckpoint
    from megatron_rl.checkpoint.manager import CheckpointManager
    from megatron_rl.checkpoint.training import load_weights

    trainer = _setup(tp=1, pp=1)
    manager = CheckpointManager(SimpleNamespace(resume=True), Path(root).parent, trainer, {}, 10)
    extra = manager.resume()
    try:
        load_weights(trainer, Path(root) / STEP_2)
        refused = None
    except DamagedCheckpoint as exc:
        refused = str(exc)
    torch.save({"step": trainer.step, "extra": extra, "refused": refused}, out)


def test_resume_loads_the_intact_checkpoint_and_reading_weights_refuses_the_damaged(checkpoints, tmp_path):
    _damage(checkpoints / STEP_2 / TENSOR_DATA, "flip")
    run_spawned(_resume_and_read, 1, str(checkpoints), str(tmp_path / "out.pt"))
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    assert out["step"] == 1 and out["extra"]["sampler"] == {"position": 1}
    assert out["refused"] == (f"checkpoint {checkpoints / STEP_2} is damaged: {TENSOR_DATA}: checksum mismatch "
                              "(sha256 differs from the manifest's)")


@pytest.mark.parametrize("cli", ["export", "eval"])
def test_export_and_eval_refuse_a_damaged_checkpoint_naming_the_file(checkpoints, cli, capsys):
    import importlib

    from omegaconf import OmegaConf

    from megatron_rl.config import compose, to_typed

    run = checkpoints.parent
    OmegaConf.save(OmegaConf.structured(to_typed(compose([]))), run / "config.yaml")  # the default (tiny) run's
    _damage(checkpoints / STEP_2 / TENSOR_DATA, "truncate")
    argv = ["--run", str(run), "--checkpoint" if cli == "export" else "--checkpoints", "latest"]
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(f"megatron_rl.{cli}").main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"config error: checkpoint {checkpoints / STEP_2} is damaged: {TENSOR_DATA}: size mismatch (" in err
    assert not (run / "eval").exists() and not (run / "export").exists() and not (run / "hf").exists()
