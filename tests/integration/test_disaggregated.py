"""Disaggregated (asynchronous) RL end to end on CPU: `rollout.mode=disaggregated` with real
generator processes (hf engine, rule rewards on the math task, so no sandbox), the trainer
publishing weights over its own gloo group each step.

From the timelines the processes write (`run_dir/timeline/{trainer,generator<i>}.jsonl`,
wall-clock spans) and the metrics:
- generation and training overlap in time;
- every trained group obeys the staleness bound (version of its oldest token >= step - k);
- the generator's weight version advances by one per step;
- partial rollouts: groups whose tokens span two weight versions are trained on, with the
  truncated-IS weight logged; at staleness 0 (step 0) the generator's log-probs equal the
  trainer's recomputed ones, i.e. the broadcast weights are the trainer's;
- metrics every step; the generators stop with the run.
The settings make generation the bottleneck (long responses, chunks of 2 tokens), so the
generator is busy when the trainer publishes and partial rollouts happen.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from megatron_rl.disagg.channel import HEARTBEAT_S
from megatron_rl.disagg.events import overlap_seconds, read_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


def _args(run_dir: Path, *extra: str) -> list[str]:
    """The main job in disaggregated mode on the math task (rule rewards: no sandbox); `extra` overrides."""
    return [sys.executable, "-m", "megatron_rl.train", "+experiment=demo_countdown", "task=arithmetic",
            "task.sft_warmup_steps=10", "global_batch_size=32", "rollout.n_samples_per_prompt=4",
            "task.num_eval=8", "task.eval_samples=1", "task.eval_every=0", "algorithm.num_inner_updates=1",
            "algorithm.entropy_coef=0.01",  # the policy changes every step even when all rewards are equal
            "checkpoint.save_every=0", "checkpoint.save_at_end=false", "logging.progress=false",
            "rollout.mode=disaggregated", f"run_dir={run_dir}",
            # the tiny model, briefly warm-started, seldom writes a whole `\\boxed{}` sum: its answers are
            # read by their last number too (task.answer_extraction=last_number) so that rewards vary,
            # which the mechanics tested here need
            "task.answer_extraction=last_number", *extra]


def _run(run_dir: Path, *extra: str) -> tuple[list[dict], float]:
    args = _args(run_dir, *extra)
    start = time.monotonic()
    proc = subprocess.run(args, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and "reward/mean" not in rows[0]  # the evaluation before any update
    return rows[1:], time.monotonic() - start


def _spans(events: list[dict], name: str) -> list[tuple[float, float]]:
    return [(e["start"], e["end"]) for e in events if e["event"] == name]


@pytest.fixture(scope="module")
def one_step_off(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("disagg") / "run"
    rows, seconds = _run(run_dir, "num_steps=5", "algorithm.max_staleness=1", "rollout.max_new_tokens=64",
                         "rollout.partial_rollout_tokens=2")
    return run_dir, rows, seconds


def _trained(metrics: Path) -> bool:
    """Whether metrics.jsonl has a training step's row (row 0, the evaluation before any update, comes first)."""
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return any(line.endswith("}") and json.loads(line)["step"] > 0 for line in lines)


def test_generation_and_training_overlap(one_step_off):
    run_dir, rows, _ = one_step_off
    trainer = read_events(run_dir / "timeline" / "trainer.jsonl")
    generator = read_events(run_dir / "timeline" / "generator0.jsonl")
    train, generate = _spans(trainer, "train"), _spans(generator, "generate")
    assert len(train) == 5
    overlap = overlap_seconds(generate, train)
    total_train = sum(e - s for s, e in train)
    steps_overlapping = sum(overlap_seconds(generate, [span]) > 0 for span in train)
    print(f"train {total_train:.2f}s, generation during training {overlap:.2f}s, "
          f"{steps_overlapping}/5 steps overlap")
    assert overlap >= 0.3 * total_train
    assert steps_overlapping >= 3


def test_every_trained_group_obeys_the_staleness_bound(one_step_off):
    run_dir, rows, _ = one_step_off
    groups = [e for e in read_events(run_dir / "timeline" / "trainer.jsonl") if e["event"] == "group"]
    assert len(groups) == 5 * 8  # 32 samples / 4 per prompt, each step
    for g in groups:
        assert g["staleness"] == g["step"] - g["version"] == g["step"] - min(g["versions"])
        assert 0 <= g["staleness"] <= 1
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for r in rows:
        assert r["async/staleness_max"] <= 1 and r["buffer/dropped_stale"] == 0
        for key in ("async/wait_s", "buffer/size", "time/publish", "sync/seconds", "reward/mean", "tis_weight"):
            assert key in r, key
    assert max(r["async/staleness_max"] for r in rows) == 1  # one step off-policy did happen


def test_the_generators_reward_counts_are_the_steps(one_step_off):
    """The generators score every sample and the trainer's own verifier none: the step's reward counts are the
    generators' (they were 0 before), each of its 32 samples' answer read once, by its last number or not."""
    _, rows, _ = one_step_off
    for r in rows:
        assert r["reward/answers"] == 32 and r["reward/verifier_calls"] >= 1, r
        assert r["reward/unscored"] == r["reward/timeouts"] == r["reward/failed_batches"] == 0, r
        assert 0 <= r["reward/last_number_answers"] <= 32


def test_generator_weight_versions_advance(one_step_off):
    run_dir, rows, _ = one_step_off
    generator = read_events(run_dir / "timeline" / "generator0.jsonl")
    assert [e["version"] for e in generator if e["event"] == "weights"] == [0, 1, 2, 3, 4]
    versions = [e["version"] for e in generator if e["event"] == "generate"]
    assert versions == sorted(versions) and versions[-1] >= 3
    assert "generator 0 stops at weights v4" in (run_dir / "logs" / "generator0.log").read_text()


def test_partial_rollouts_span_two_versions_and_are_importance_weighted(one_step_off):
    run_dir, rows, _ = one_step_off
    groups = [e for e in read_events(run_dir / "timeline" / "trainer.jsonl") if e["event"] == "group"]
    spanning = [g for g in groups if len(g["versions"]) == 2]
    assert spanning, "no group was generated across a weight update"
    assert all(g["versions"][1] == g["versions"][0] + 1 for g in spanning)
    assert sum(r["async/partial_groups"] for r in rows) == len(spanning)
    # step 1 trains on version-0 groups: the generator's log-probs are the trainer's (same weights)
    assert rows[0]["rollout/logprob_mismatch"] <= 1e-4 and rows[0]["async/staleness_max"] == 0
    # later steps train on older weights: old log-probs (recomputed) differ from the engine's, and
    # the truncated-IS weight (tis_cap) is applied to the loss
    assert max(r["rollout/logprob_mismatch"] for r in rows[1:]) > 1e-3
    assert all(0 < r["tis_weight"] <= 2.0 for r in rows)


RESUMED = ["algorithm.max_staleness=1", "rollout.max_new_tokens=64", "rollout.partial_rollout_tokens=2"]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """The fixture run's settings, stopped by SIGTERM after its first step, then run again to the end.

    SIGTERM goes to the whole process group twice, as Slurm ends a job at its time limit (SIGTERM to every
    process of it, twice: measured with Slurm 22.05), and the generator got srun's forward of the USR1 stop
    warning before: the trainer must take the repeat as the same request, and the local generator process
    (and multiprocessing's resource tracker) must outlive all of them, or the trainer dies or fails on a
    dead generator instead of checkpointing."""
    root = tmp_path_factory.mktemp("disagg_resumed")
    run_dir, stderr = root / "run", root / "stderr.txt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    with open(stderr, "w") as err:
        proc = subprocess.Popen(_args(run_dir, "num_steps=5", *RESUMED), env=env, stdout=subprocess.DEVNULL,
                                stderr=err, start_new_session=True)
    metrics, generator_log = run_dir / "metrics.jsonl", run_dir / "logs" / "generator0.log"

    def wait_for(ready, what: str) -> None:
        deadline = time.monotonic() + 400
        while not ready():
            assert proc.poll() is None and time.monotonic() < deadline, f"no {what}: {stderr.read_text()[-4000:]}"
            time.sleep(0.2)

    try:
        wait_for(lambda: _trained(metrics), "training step")
        pid = int(re.search(r"generator 0 of 1 on .* \(pid (\d+),", generator_log.read_text()).group(1))
        os.kill(pid, signal.SIGUSR1)
        wait_for(lambda: "generator 0 got SIGUSR1" in generator_log.read_text(), "word of SIGUSR1")
        for _ in range(2):  # as Slurm at the time limit
            os.killpg(proc.pid, signal.SIGTERM)
            time.sleep(0.2)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = stderr.read_text()
    assert proc.returncode == 0, err[-4000:]
    assert "process died unexpectedly" not in err and "exited with code" not in err, err[-4000:]
    marker = json.loads((run_dir / "preempted.json").read_text())
    stopped = marker["steps_done"]
    assert marker["signal"] == "SIGTERM" and 1 <= stopped < 5, marker
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:08d}"
    log = generator_log.read_text()
    # the generator lived on to stop when the trainer did (a killed one writes neither a traceback nor this)
    assert "Traceback" not in log and log.count("generator 0 stops at weights v") == 1, log[-3000:]
    assert "generator 0 got SIGTERM" in log, log[-3000:]
    rows, _ = _run(run_dir, "num_steps=5", *RESUMED, "checkpoint.save_at_end=true")  # evaluated below
    return run_dir, rows, stopped


def test_a_resumed_run_asks_again_for_the_prompts_in_flight(one_step_off, resumed):
    """Checkpoints keep the prompts sent to the generators but not trained on yet. The run stopped
    after `stopped` steps (its checkpoint holds the next step's prompts, sent a step earlier) and
    resumed to 5: every step trains on the same prompts as the uninterrupted run (one generator:
    step s trains on the sampler's s-th batch), and the first resumed step's groups were generated
    again after the resume, with the resumed weights (staleness 0)."""
    reference_dir, reference, _ = one_step_off
    run_dir, rows, stopped = resumed

    def sources(run_dir: Path) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for e in read_events(run_dir / "timeline" / "trainer.jsonl"):
            if e["event"] == "group":
                out.setdefault(e["step"], []).append(e["source"])
        return {step: sorted(found) for step, found in out.items()}

    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    expected = sources(reference_dir)  # by the timeline's step: the steps done before the one that took them
    assert sorted(expected) == [0, 1, 2, 3, 4] and all(len(v) == 8 for v in expected.values())
    assert sources(run_dir) == expected
    assert rows[stopped]["async/staleness_max"] == 0


def test_evaluating_a_disaggregated_runs_checkpoint_starts_no_generators(resumed):
    """Offline evaluation of a disaggregated run's checkpoint generates on the evaluating job's own
    engine: no generator starts (it would wait for the hub, or for external generators), and with
    seed 0 it draws what the run's final evaluation drew (same weights, same samples)."""
    run_dir, rows, _ = resumed
    out = run_dir / "eval" / "latest"
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.eval", "--run", str(run_dir), "--checkpoints",
                           "latest", "--seeds", "1", "--name", "latest"],
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "disaggregated rollout" not in proc.stderr and not list(out.rglob("generator*"))
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 8 and {r["step"] for r in records} == {5}
    accuracy = sum(r["reward"] for r in records) / len(records)
    assert accuracy == pytest.approx(rows[-1]["eval/accuracy"])


@pytest.mark.slow
def test_two_generators_with_two_steps_of_staleness(tmp_path):
    """k=2, two generators taking requests from one queue, no partial rollouts: groups may
    arrive out of order; none older than 2 versions is trained on (stale ones are dropped,
    counted and their prompts generated again), and both generators contribute. PPO with a critic
    here: the trainer's critic scores the groups whatever version generated them, and learns."""
    run_dir = tmp_path / "run"
    rows, _ = _run(run_dir, "num_steps=4", "algorithm.max_staleness=2", "rollout.num_generators=2",
                   "rollout.max_new_tokens=24", "task.sft_warmup_steps=40", "algorithm=ppo", "algorithm.critic=true")
    for row in rows:
        assert row["critic/value_loss"] >= 0 and row["time/critic"] > 0
    # a step with rewards trains the critic (all-zero returns give its zero head no gradient)
    trained = [row for row in rows if row["critic/returns"] != 0]
    assert trained and all(row["critic/grad_norm"] > 0 for row in trained)
    groups = [e for e in read_events(run_dir / "timeline" / "trainer.jsonl") if e["event"] == "group"]
    assert len(groups) == 4 * 8 and all(0 <= g["staleness"] <= 2 for g in groups)
    assert {g["generator"] for g in groups} == {0, 1}
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for i in (0, 1):
        weights = [e["version"] for e in read_events(run_dir / "timeline" / f"generator{i}.jsonl")
                   if e["event"] == "weights"]
        assert weights == [0, 1, 2, 3]


def test_tensor_parallel_trainer_publishes_the_gathered_weights(tmp_path):
    """Two trainer ranks (parallel.tp=2): both take part in the weight sync (TP all-gather), rank 0
    broadcasts to the generator, and both train on the groups rank 0 took from the buffer. At
    staleness 0 the generator's log-probs equal the trainer's, so it got the gathered weights."""
    run_dir = tmp_path / "run"
    rows, _ = _run(run_dir, "num_steps=3", "cluster.nproc=2", "parallel.tp=2", "rollout.max_new_tokens=24",
                   "rollout.partial_rollout_tokens=4", "task.sft_warmup_steps=5")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["async/staleness_max"] == 0 and rows[0]["rollout/logprob_mismatch"] <= 1e-4
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    assert max(r["rollout/logprob_mismatch"] for r in rows[1:]) > 1e-3
    assert all(r["reward/answers"] == 32 for r in rows)  # the generator's counts, once: not once per trainer rank


def test_a_lora_run_publishes_the_base_once_and_then_the_adapters_alone(tmp_path):
    """rollout.weight_sync=adapters: the first publish carries the frozen base weights and the adapters, later
    ones the adapters alone (their bytes counted from the architecture: A [r, in] and B [out, r] of q, k, v, o,
    gate, up and down in every layer, fp32). On-policy (max_staleness=0), each step's groups come from that
    step's weights, so the generator's log-probs equal the trainer's at every step: it applied each new
    adapter (the updates at lr 1e-2 move the log-probs by far more than 1e-4)."""
    from omegaconf import OmegaConf

    from megatron_rl.config.schema import ModelConfig

    run_dir = tmp_path / "run"
    rows, _ = _run(run_dir, "num_steps=3", "model.lora_rank=4", "rollout.weight_sync=adapters", "optimizer.lr=1e-2",
                   "algorithm.max_staleness=0", "rollout.max_new_tokens=16", "task.sft_warmup_steps=5")
    assert [r["step"] for r in rows] == [1, 2, 3]
    model = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml").model)
    m = ModelConfig(**model)
    h, q, kv, f = m.hidden_size, m.num_attention_heads * m.resolved_head_dim, \
        m.num_query_groups * m.resolved_head_dim, m.ffn_hidden_size
    adapter_bytes = 4 * m.num_layers * sum(m.lora_rank * (i + o) for i, o in
                                           [(h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h)])
    assert rows[0]["sync/bytes"] > 10 * adapter_bytes
    assert rows[1]["sync/bytes"] == rows[2]["sync/bytes"] == adapter_bytes
    for r in rows:
        assert r["async/staleness_max"] == 0 and r["rollout/logprob_mismatch"] <= 1e-4, r
    publishes = [e for e in read_events(run_dir / "timeline" / "trainer.jsonl") if e["event"] == "publish"]
    assert [e["bytes"] for e in publishes] == [r["sync/bytes"] for r in rows]


def test_a_delta_publish_sends_only_what_changed_and_the_generator_computes_the_trainers_logprobs(tmp_path):
    """rollout.weight_sync_delta=true with LoRA on linear_qkv and the merged weights published (weight_sync=full):
    the first publish sends every bucket (of 0.1 MiB: 18 for the model's 3 MB), later ones only those holding
    a changed QKV (the embedding, the attention output and the MLPs stay put). On-policy, the generator's log-probs equal the trainer's at every
    step: after each delta publish it holds the trainer's weights."""
    run_dir = tmp_path / "run"
    rows, _ = _run(run_dir, "num_steps=3", "model.lora_rank=4", "model.lora_targets=[linear_qkv]",
                   "optimizer.lr=1e-2", "rollout.weight_sync_delta=true", "rollout.weight_sync_bucket_mb=0.1",
                   "algorithm.max_staleness=0",
                   "rollout.max_new_tokens=16", "task.sft_warmup_steps=5")
    assert [r["step"] for r in rows] == [1, 2, 3]
    first, *later = rows
    assert first["weight_sync/bytes_sent"] == first["weight_sync/bytes_full"] == first["sync/bytes"]
    for r in later:
        assert 0 < r["weight_sync/bytes_sent"] < 0.5 * r["weight_sync/bytes_full"], r
        assert r["weight_sync/bytes_full"] == r["sync/bytes"] and r["weight_sync/resends"] == 0
    for r in rows:
        assert r["async/staleness_max"] == 0 and r["rollout/logprob_mismatch"] <= 1e-4, r


def test_a_mixture_of_experts_replays_the_generators_routing(tmp_path):
    """algorithm.routing_replay=rollout (R3) with a generator: it returns each sample's routing with its
    group, and the trainer's old-log-prob forward and both updates route every token as the generator did,
    for groups of the current and of the previous weights (a sample without the routing, or with routing
    of another length, stops the run). Partial rollouts (chunks of 8 of the 24 tokens): each continuation
    adds the rows of the positions it fed first (tests/unit/test_disagg.py checks which call each row
    comes from); at staleness 0, every chunk of the same weights, the trainer's log-probs equal the
    generator's, which a continuation's routing row of the wrong position would break."""
    run_dir = tmp_path / "run"
    rows, _ = _run(run_dir, "num_steps=3", "model=tiny_qwen3_moe", "algorithm.routing_replay=rollout",
                   "algorithm.num_inner_updates=2", "algorithm.max_staleness=1", "rollout.partial_rollout_tokens=8",
                   "rollout.max_new_tokens=24", "task.sft_warmup_steps=5",
                   "optimizer.lr=5e-5")  # small steps: an update's own drift stays below that of a misaligned replay
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["async/staleness_max"] == 0 and rows[0]["rollout/logprob_mismatch"] <= 1e-4
    calls = Counter(e["request"] for e in read_events(run_dir / "timeline" / "generator0.jsonl")
                    if e["event"] == "generate")
    assert max(calls.values()) > 1  # requests were continued (chunks), their routing extended
    assert max(r["async/staleness_max"] for r in rows) == 1
    assert all(0 <= r["routing/drift"] < 0.5 for r in rows), [r["routing/drift"] for r in rows]


def _trainer_args(run_dir: Path, *extra: str) -> list[str]:
    """A trainer that starts no generator of its own (one is started separately)."""
    return _args(run_dir, "task.sft_warmup_steps=5", "global_batch_size=16", "rollout.generator_nodes=1",
                 "rollout.max_new_tokens=24", *extra)


def _start_generator(run_dir: Path, env: dict, index: int = 0) -> subprocess.Popen:
    """A generator started on its own, as the Slurm generator step (or a user on another node) does:
    not a child of the trainer; it finds the trainer through the run directory."""
    return subprocess.Popen([sys.executable, "-m", "megatron_rl.disagg.generator", "--run-dir", str(run_dir),
                             "--index", str(index), "--wait-s", "300"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_a_generator_started_separately_joins_through_the_run_directory(tmp_path):
    """rollout.generator_nodes=1: the trainer starts no generator; it writes the hub file and waits.
    A generator process started separately (before the trainer is up: it waits for the file)
    connects, receives every weight version and serves the run's groups; both exit 0."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    generator = _start_generator(run_dir, env)
    trainer = subprocess.run(_trainer_args(run_dir, "num_steps=3"), env=env, capture_output=True, text=True,
                             timeout=500)
    out, _ = generator.communicate(timeout=120)
    assert trainer.returncode == 0, trainer.stderr[-4000:]
    assert generator.returncode == 0, out[-4000:]
    assert "waiting for 1 generator(s) started separately" in trainer.stderr
    hub_file = run_dir / "disagg" / "hub.json"
    assert oct(hub_file.stat().st_mode & 0o777) == "0o600"
    assert json.loads(hub_file.read_text())["host"] not in ("127.0.0.1", "localhost")  # reachable from others
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # 0: the evaluation before any update
    assert rows[1]["rollout/logprob_mismatch"] <= 1e-4  # the separately started generator got the trainer's weights
    events = read_events(run_dir / "timeline" / "generator0.jsonl")
    assert [e["version"] for e in events if e["event"] == "weights"] == [0, 1, 2]
    groups = [e for e in read_events(run_dir / "timeline" / "trainer.jsonl") if e["event"] == "group"]
    assert len(groups) == 3 * 4 and {g["generator"] for g in groups} == {0}
    log = (run_dir / "logs" / "generator0.log").read_text()
    assert f"pid {generator.pid}" in log and "generator 0 stops at weights v2" in log


def test_a_generator_that_dies_stops_the_trainer_with_its_name(tmp_path):
    """A generator killed (SIGKILL: no goodbye) mid-run: the trainer stops with an error naming it
    once its heartbeat has been missing for rollout.generator_timeout_s, instead of waiting forever."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    generator = _start_generator(run_dir, env)
    trainer = subprocess.Popen(_trainer_args(run_dir, "num_steps=50", "rollout.generator_timeout_s=15"), env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not _trained(run_dir / "metrics.jsonl"):
            assert trainer.poll() is None and time.monotonic() < deadline, "no training step"
            time.sleep(0.2)
        generator.kill()
        killed = time.monotonic()
        _, err = trainer.communicate(timeout=120)
        waited = time.monotonic() - killed
    finally:
        for proc in (trainer, generator):
            if proc.poll() is None:
                proc.kill()
    assert trainer.returncode != 0
    # Killed while the trainer waited for groups: found by its missing heartbeat; killed just
    # before a publish: the weight broadcast fails at once and the error says who went silent.
    heartbeat = "generator 0 on" in err and "has sent no heartbeat" in err and "generator_timeout_s=15" in err
    broadcast = "publishing weights" in err and re.search(r"generator 0 on \S+: last heartbeat \d+s ago", err)
    assert heartbeat or broadcast, err[-3000:]
    # the timeout runs from the last heartbeat, which came up to HEARTBEAT_S before the kill
    assert waited < 90 and (broadcast or waited >= 15 - HEARTBEAT_S)
    assert "did not confirm stopping" not in err  # a dead generator is not waited for


def test_dynamic_sampling_trains_only_on_groups_with_reward_variance(tmp_path):
    """algorithm.dynamic_sampling in disaggregated mode: groups whose rewards are all equal are
    refused as they come out of the buffer and new prompts are asked for in their place; a step
    that did not hit the refusal limit trains only on groups with reward variance (the
    zero-variance filter, on as a check, finds nothing to drop)."""
    run_dir = tmp_path / "run"
    rows, _ = _run(run_dir, "num_steps=4", "task.sft_warmup_steps=40", "algorithm.dynamic_sampling=true",
                   "algorithm.dynamic_sampling_max_rounds=8", "algorithm.filter_zero_variance=true",
                   "rollout.max_new_tokens=24")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert sum(r["dynamic_sampling/rejected"] for r in rows) > 0
    within = [r for r in rows if r["dynamic_sampling/exhausted"] == 0]
    assert within, "every step hit the refusal limit"
    for r in within:
        assert r["filter/zero_variance_dropped"] == 0 and r["filter/kept_samples"] == 32
    groups = [e for e in read_events(run_dir / "timeline" / "trainer.jsonl") if e["event"] == "group"]
    assert len(groups) == 4 * 8 and all(0 <= g["staleness"] <= 1 for g in groups)


def test_agent_episodes_come_from_the_generator(tmp_path):
    """task.type=agent in disaggregated mode (the countdown agent experiment, shortened: its
    environment answers in-process, no sandbox): the generator plays whole multi-turn episodes
    with its own environments and the async scheduler, and puts them in the buffer; the trainer
    logs their agent metrics and the generator's scheduler metrics (`sched/...`) as colocated mode
    does and trains on them within the staleness bound (the entropy bonus makes the policy move
    every step, so stale episodes differ from the trainer's weights). With partial rollouts on,
    updates land between turns; at step 1 the episodes' log-probs (model turns) equal the
    trainer's recomputed ones; the last step's evaluation plays episodes on the trainer's engine.

    The scheduler metrics are checked against the generator's own timeline: one generator and
    one request per step, so a step's engine-busy seconds (`sched/engine_busy` x
    `sched/generator_wall_s`) are its request's `generate` events (weight updates between turns
    left out), and its wall seconds fit inside its groups' `generated` span. (The lockstep
    scheduler on a generator is covered by tests/unit/test_disagg.py.)"""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "megatron_rl.train", "+experiment=demo_agent_countdown", "num_steps=3",
            "task.sft_warmup_steps=60", "algorithm.entropy_coef=0.01", "task.num_train=16", "task.num_eval=4",
            "task.eval_samples=1", "task.eval_every=0", "global_batch_size=16", "rollout.n_samples_per_prompt=4",
            "checkpoint.save_every=0", "checkpoint.save_at_end=false", "logging.progress=false",
            "rollout.mode=disaggregated", "algorithm.max_staleness=1", "rollout.partial_rollout_tokens=1",
            "rollout.agent_scheduler=async", f"run_dir={run_dir}"]
    proc = subprocess.run(args, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # 0: the evaluation before any update
    rows = rows[1:]
    ends = ("submitted", "max_turns", "max_tokens", "wall_time", "dropped", "aborted", "deadline", "partial")
    for r in rows:
        assert sum(r[f"agent/{s}"] for s in ends) == 16 and r["agent/dropped"] == 0
        assert 1 <= r["agent/turns_mean"] <= 3
        assert r["agent/env/attempts"] == pytest.approx(r["agent/turns_mean"])
        assert r["agent/env/solved"] == pytest.approx(r["reward/mean"])
        assert r["async/staleness_max"] <= 1 and r["buffer/dropped_stale"] == 0
        # the generator's environment judged every episode of the step's one request (the trainer's none)
        assert (r["reward/verifier_calls"], r["reward/verifier_errors"]) == (16, 0), r
    assert max(r["agent/turns_mean"] for r in rows) > 1  # episodes of several turns went through the buffer
    assert rows[0]["async/staleness_max"] == 0 and rows[0]["rollout/logprob_mismatch"] <= 1e-4
    # later steps train on episodes of older weights: the truncated-IS weight corrects their turns
    assert max(r["rollout/logprob_mismatch"] for r in rows[1:]) > 1e-3
    assert all(0 < r["tis_weight"] <= 2.0 for r in rows)
    groups = [e for e in read_events(run_dir / "timeline" / "trainer.jsonl") if e["event"] == "group"]
    assert len(groups) == 3 * 4 and all(g["step"] - min(g["versions"]) <= 1 for g in groups)
    generator = read_events(run_dir / "timeline" / "generator0.jsonl")
    assert [e["version"] for e in generator if e["event"] == "weights"] == [0, 1, 2]
    for step, r in enumerate(rows):  # the timeline's step: the steps done before
        # nothing is cut in this mode (no over-sampling, no step deadline) and no sandbox holds episodes back
        assert (r["sched/aborted"], r["sched/deadline"], r["sched/partial"]) == (0, 0, 0)
        assert r["sched/backpressure_wait_s"] == 0 and "sched/wall_s" not in r
        mine = [g for g in groups if g["step"] == step]
        (request,) = {g["request"] for g in mine}
        assert len(mine) == 4 and sum(g["request"] == request for g in groups) == 4  # the whole request
        busy = sum(e["end"] - e["start"] for e in generator if e["event"] == "generate" and e["request"] == request)
        span = max(g["end"] for g in mine) - min(g["start"] for g in mine)
        wall = r["sched/generator_wall_s"]
        assert 0.5 * span <= wall <= span + 0.05, (wall, span)
        assert 0 < r["sched/engine_busy"] <= 1
        assert r["sched/engine_busy"] * wall == pytest.approx(busy, rel=0.1, abs=0.05)
    assert "local sandbox server" not in proc.stderr
    assert 0 <= rows[-1]["eval/accuracy"] <= 1  # evaluation plays episodes on the trainer's own engine
