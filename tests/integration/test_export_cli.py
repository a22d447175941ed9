"""`python -m megatron_rl.export`: a training checkpoint written by a mixture of experts at EP=2
(two ranks) is exported offline by one process at EP=1, and the result equals, tensor for tensor,
the HF export the training run itself wrote at the same step; the run's config file and the
checkpoint choice are checked before any work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("moe") / "run"
    args = [sys.executable, "-m", "megatron_rl.train", "mode=sft", "model=tiny_qwen3_moe", "cluster.nproc=2",
            "parallel.ep=2", "num_steps=2", "global_batch_size=8", "task=arithmetic", "task.num_train=32",
            "task.num_eval=4", "checkpoint.save_every=2", "checkpoint.hf_export_at_end=true",
            "logging.progress=false", f"run_dir={run}"]
    proc = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run


def test_an_ep2_checkpoint_exports_at_ep1_as_the_run_exported_it(moe_run, tmp_path):
    out = tmp_path / "exported"
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.export", "--run", str(moe_run), "--checkpoint", "2",
                           "--out", str(out)], env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"to {out}" in proc.stdout
    reference = moe_run / "hf" / "step_00000002"
    want, got = _tensors(reference), _tensors(out)
    assert sorted(got) == sorted(want) and any(".experts.3." in k for k in got)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert json.loads((out / "config.json").read_text()) == json.loads((reference / "config.json").read_text())
    assert (out / "tokenizer_config.json").is_file()


def test_bad_requests_fail_before_any_work(moe_run, tmp_path):
    for extra, message in ((["--checkpoint", "7"], "is neither a complete training checkpoint"),
                           (["--checkpoint", str(moe_run / "hf" / "step_00000002")], "is an HF directory already"),
                           (["parallel.ep=3"], "parallel.ep=3"),
                           (["--adapter"], "trained no LoRA adapters (model.lora_rank=0)"),
                           (["--adapter", "model.lora_rank=4", "model.lora_targets=[experts.linear_fc1]"],
                            "trained adapters on its experts (experts.linear_fc1), which export merged only")):
        proc = subprocess.run([sys.executable, "-m", "megatron_rl.export", "--run", str(moe_run), *extra],
                              env=_env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
        assert proc.stderr.strip().startswith("config error:")
