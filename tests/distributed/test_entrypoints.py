"""The main job as a user runs it: bad settings fail fast and write nothing; a short run
writes a complete run directory with a falling loss; two ranks (TP=2 with sequence parallelism,
or CP=2; local launcher) reproduce the single-process metrics; RL steps with CP=2, with a
DeepSeek-V3 model, with LoRA and with LoRA on a mixture's experts at EP=2 keep the trainer's log-probs equal
to the rollout engine's; the LoRA
run's adapters, exported as a PEFT adapter, compute what its merged export computes."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


def _run(args, cwd, timeout=300):
    """(the finished process, the CPU seconds it used): CPU time, not wall time, which a loaded machine stretches."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


@pytest.mark.parametrize("override, words", [
    (["parallel.tp=3"], ["parallel.tp=3", "valid parallel.tp values"]),
    (["optimizer.lr=-1"], ["optimizer.lr=-1", "> 0"]),
    (["parallel.tpp=2"], ["parallel.tpp", "allowed keys"]),
    (["model=qwen2_5_7b"], ["model.path", "required"]),
    (["model.path=/nonexistent/ckpt"], ["model.path=/nonexistent/ckpt", "does not exist"]),
    (["cluster.nproc=2", "parallel.tp=2", "model.num_attention_heads=3", "model.num_query_groups=3",
      "model.hidden_size=96"], ["parallel.tp=2"]),
    (["global_batch_size=30", "rollout.n_samples_per_prompt=8"],
     ["global_batch_size=30", "rollout.n_samples_per_prompt=8"]),
])
def test_invalid_settings_fail_fast_and_write_nothing(tmp_path, override, words):
    proc, cpu_s = _run([*override, f"run_dir={tmp_path}/run"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("config error: "), proc.stderr
    for word in words:
        assert word in lines[0]
    assert cpu_s < 30, f"used {cpu_s:.1f} s of CPU"  # ~4.5 s: no rank started, no model built
    assert list(tmp_path.iterdir()) == [], "nothing may be written for a bad config"


@pytest.mark.parametrize("weights", ["none", "truncated shard"])
def test_a_model_path_without_whole_weights_fails_before_the_run_directory_exists(tmp_path, weights):
    """A directory with config.json but no weights, or a shard cut short, is refused at config time, naming
    what is wrong (it used to surface only once the run directory, its logs and a sandbox server existed)."""
    import numpy as np
    from safetensors.numpy import save_file

    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.families import get_converter

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(get_converter("qwen2").config_dict(ModelConfig(family="qwen2"))))
    if weights == "truncated shard":
        shard = ckpt / "model-00001-of-00001.safetensors"
        save_file({"model.norm.weight": np.ones(128, np.float32)}, str(shard))
        shard.write_bytes(shard.read_bytes()[:-100])
        index = {"weight_map": {"model.norm.weight": shard.name}}
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    proc, _ = _run(["model=tiny_qwen2", f"model.path={ckpt}", f"run_dir={tmp_path}/run"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.strip()]
    expected = ("no model.safetensors or model.safetensors.index.json" if weights == "none"
                else f"{shard}: shard listed in {ckpt / 'model.safetensors.index.json'} is truncated: ")
    assert line.startswith(f"config error: model.path={ckpt}: ") and expected in line, line
    assert not (tmp_path / "run").exists()


def test_cfg_job_prints_the_composed_config(tmp_path):
    proc, _ = _run(["--cfg", "job", "parallel.tp=2", "optimizer.lr=1e-6"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "tp: 2" in proc.stdout and "lr: 1.0e-06" in proc.stdout
    assert list(tmp_path.iterdir()) == []


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single") / "run"
    proc, _ = _run(["mode=sft", "num_steps=12", f"run_dir={run_dir}", "logging.progress=false"], cwd=run_dir.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc


def test_main_job_writes_a_complete_run_directory(single_run):
    run_dir, proc = single_run
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "logs" / "rank0.log").is_file()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "plots" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(13))  # 0: the held-out loss before any update
    assert set(metrics[0]) == {"step", "eval_loss"}
    assert "SFT done" in proc.stderr


def test_main_job_loss_falls(single_run):
    metrics = _metrics(single_run[0])
    trained = [m for m in metrics if "loss" in m]
    first = sum(m["loss"] for m in trained[:3]) / 3
    last = sum(m["loss"] for m in trained[-3:]) / 3
    assert last < 0.8 * first, (first, last)
    assert metrics[-1]["eval_loss"] < metrics[0]["eval_loss"]


@pytest.mark.parametrize("layout", [["parallel.tp=2", "parallel.sequence_parallel=true"], ["parallel.cp=2"]],
                         ids=["tp2_sp", "cp2"])
def test_two_ranks_reproduce_single_process_metrics(single_run, tmp_path, layout):
    run_dir = tmp_path / "run"
    proc, _ = _run(["mode=sft", "num_steps=12", f"run_dir={run_dir}", "logging.progress=false", "cluster.nproc=2", *layout],
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "logs" / "rank1.log").is_file()
    for got, want in zip(_metrics(run_dir)[1:], _metrics(single_run[0])[1:], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-3)


def _two_rl_steps_keep_the_engines_logprobs(tmp_path, *layout: str) -> list[dict]:
    """Two RL steps on two ranks: the trainer's log-probs of the rollouts equal the engine's, so
    the first update's KL is 0. Returns the steps' metrics."""
    run_dir = tmp_path / "run"
    proc, _ = _run(["num_steps=2", "global_batch_size=16", "rollout.n_samples_per_prompt=4",
                    "rollout.max_new_tokens=12", "task.sft_warmup_steps=10", "task.num_eval=0",
                    "cluster.nproc=2", *layout, f"run_dir={run_dir}", "logging.progress=false"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]  # no held-out prompts: no evaluation at step 0
    for m in metrics:
        assert m["rollout/logprob_mismatch"] < 1e-4, m["rollout/logprob_mismatch"]
        assert m["kl/policy_old_new_first_update"] == pytest.approx(0.0, abs=1e-6)
    return metrics


def test_rl_loop_with_context_parallelism(tmp_path):
    """Two RL steps with CP=2: the trainer's log-probs of the rollouts, computed from rows
    split over two ranks, equal the rollout engine's (one process, whole sequences)."""
    _two_rl_steps_keep_the_engines_logprobs(tmp_path, "parallel.cp=2")


def test_rl_loop_with_a_deepseek_v3_model(tmp_path):
    """Two RL steps of the tiny DeepSeek-V3 (multi-latent attention, biased sigmoid router) at TP=2 with
    sequence parallelism: the hf engine (transformers' DeepseekV3ForCausalLM) generates with the synced
    weights, and the trainer's log-probs of its samples equal the engine's. With rollout routing replay and
    two updates a step (test_routing_replay.py tests the replay itself): the engine returns its routing,
    the old forward and both updates route so, and the log reports the drift the replay hid."""
    metrics = _two_rl_steps_keep_the_engines_logprobs(
        tmp_path, "model=tiny_deepseek_v3", "parallel.tp=2", "parallel.sequence_parallel=true",
        "algorithm.routing_replay=rollout", "algorithm.num_inner_updates=2")
    for m in metrics:
        assert 0.0 <= m["routing/drift"] < 0.5, m["routing/drift"]


def test_rl_loop_with_a_gpt_oss_model(tmp_path):
    """Two RL steps of the tiny gpt-oss (attention sinks, sliding windows, biased clamped experts) at TP=2 with
    sequence parallelism and unsplit experts (parallel.etp defaults to 1 for gpt_oss): the hf engine
    (transformers' GptOssForCausalLM) generates with the synced weights, and the trainer's log-probs of its
    samples equal the engine's. With the old policy's routing replayed in a second update a step."""
    metrics = _two_rl_steps_keep_the_engines_logprobs(
        tmp_path, "model=tiny_gpt_oss", "parallel.tp=2", "parallel.sequence_parallel=true",
        "algorithm.routing_replay=old", "algorithm.num_inner_updates=2")
    for m in metrics:
        assert 0.0 <= m["routing/drift"] < 0.5, m["routing/drift"]


def test_rl_loop_with_lora(tmp_path):
    """Two RL steps with LoRA adapters (model.lora_rank) at TP=2 with sequence parallelism: the warm start and
    the updates train only the adapters, the engine gets the merged weights W + alpha / r B A, and the
    trainer's log-probs of its samples equal the engine's (a wrong merge, e.g. without the scale, moves them
    by far more than 1e-4 with alpha / r = 8). An entropy bonus moves the policy whatever the rewards (the tiny
    model rarely earns one), so step 1 samples from updated adapters; with a KL loss, the reference (the adapters
    after the warm start) is the policy at step 0 and not at step 1."""
    metrics = _two_rl_steps_keep_the_engines_logprobs(
        tmp_path, "parallel.tp=2", "parallel.sequence_parallel=true", "model.lora_rank=4", "model.lora_alpha=32",
        "optimizer.lr=1e-2", "algorithm.kl_coef=0.01", "algorithm.entropy_coef=0.1",
        "algorithm.filter_zero_variance=false")
    assert all(m["grad_norm"] > 0 for m in metrics)
    assert metrics[0]["kl/ref"] == pytest.approx(0.0, abs=1e-6) and metrics[1]["kl/ref"] > 1e-3
    _the_peft_adapter_equals_the_merged_export(tmp_path / "run", rank=4, alpha=32)


def test_rl_loop_with_lora_on_the_experts(tmp_path):
    """Two RL steps of the tiny Qwen2-MoE with LoRA adapters on its attention, on every routed expert
    (model.lora_targets experts.linear_fc1 / .linear_fc2) and on its shared expert (shared_experts.*) at EP=2:
    each rank trains the adapters of its two experts, the engine (transformers' Qwen2MoeForCausalLM) gets
    every expert's merged weights (gathered over the expert-parallel ranks), and the trainer's log-probs of its
    samples equal the engine's (with the routed experts left out of the merge they differed by 0.034 and 0.051,
    tried on the tiny Qwen3-MoE)."""
    metrics = _two_rl_steps_keep_the_engines_logprobs(
        tmp_path, "model=tiny_qwen2_moe", "parallel.ep=2", "model.lora_rank=4", "model.lora_alpha=32",
        "model.lora_targets=[linear_qkv,linear_proj,experts.linear_fc1,experts.linear_fc2,shared_experts.linear_fc1,"
        "shared_experts.linear_fc2]", "optimizer.lr=1e-2", "algorithm.entropy_coef=0.1",
        "algorithm.filter_zero_variance=false")
    assert all(m["grad_norm"] > 0 for m in metrics)
    log = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    # per layer: 2 attention adapters, 2 of the shared expert, 2 of each of this rank's 2 routed experts
    assert ", shared_experts.linear_fc2: 32 adapters" in log


def _export(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.export", *args], env=dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _the_peft_adapter_equals_the_merged_export(run: Path, rank: int, alpha: float) -> None:
    """`megatron_rl.export --adapter` at the run's TP=2 (gathering B of linear_qkv and linear_fc1, A of the row
    layers) writes a PEFT adapter and the frozen base it belongs on; loaded by `peft` onto that base, it computes
    the logits of the merged export, written by one process (TP=1). The adapters moved the model: the base
    alone computes other logits. Exported at PP=2 (each stage its layers), the adapter is the same."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    adapter, merged, staged = run / "peft" / "step_00000002", run / "merged", run / "staged"
    _export("--run", str(run), "--adapter")
    _export("--run", str(run), "--out", str(merged), "cluster.nproc=1", "parallel.tp=1",
            "parallel.sequence_parallel=false")
    _export("--run", str(run), "--adapter", "--out", str(staged), "parallel.tp=1", "parallel.pp=2",
            "parallel.sequence_parallel=false")
    want_tensors, got_tensors = (load_file(d / "adapter_model.safetensors") for d in (adapter, staged))
    assert sorted(got_tensors) == sorted(want_tensors)
    assert all(torch.equal(got_tensors[k], want_tensors[k]) for k in want_tensors)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (rank, alpha) and config["base_model_name_or_path"] == str(
        (adapter / "base").resolve())
    hf_config = json.loads((merged / "config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(
        f"model.layers.{i}.{module}" for i in range(hf_config["num_hidden_layers"])
        for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
    tokens = torch.randint(0, hf_config["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(tokens).logits
        base = AutoModelForCausalLM.from_pretrained(adapter / "base", dtype=torch.float32)
        before = base(tokens).logits
        got = PeftModel.from_pretrained(base, adapter)(tokens).logits
    assert (want - before).abs().max() > 1e-3
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
