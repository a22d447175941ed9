"""`python -m megatron_rl.eval` on a real run: a few RL steps of the math task (rule rewards, no
sandbox) with a checkpoint after every step, then two checkpoints evaluated with two seeds on
the held-out set and a regression file. Every number in the outputs is recomputed here from
records.jsonl (means, pass@k with math.comb, t intervals from the textbook formula), and seed 0
of each checkpoint must reproduce the training-time evaluation logged at that step."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
SAMPLES, NUM_EVAL, SEEDS = 4, 12, 2
REGRESSION = [(3, 4), (2, 2), (5, 1)]  # "Ann has a pens and gets b more. How many ...?" -> a + b


def _run(args: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", *args], env=dict(os.environ, OMP_NUM_THREADS="1",
                                                                     PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _pass_at_k(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    run = tmp / "run"
    _run(["megatron_rl.train", "+experiment=demo_countdown", "task=arithmetic", f"run_dir={run}", "num_steps=3",
          "global_batch_size=32", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=12",
          "task.sft_warmup_steps=40", f"task.num_eval={NUM_EVAL}", "task.eval_every=1",
          f"task.eval_samples={SAMPLES}", "checkpoint.save_every=1", "checkpoint.keep_last=5", "checkpoint.keep_best=1",
          "logging.progress=false", "logging.dump_rollouts=true"])
    regression = tmp / "regression.jsonl"
    question = "Ann has {} pens and gets {} more. How many pens does Ann have now? Answer in \\boxed{{}}.\n"
    regression.write_text("".join(json.dumps({"prompt": question.format(a, b), "answer": a + b}) + "\n"
                                  for a, b in REGRESSION))
    proc = _run(["megatron_rl.eval", "--run", str(run), "--checkpoints", "1", "latest", "--seeds", str(SEEDS),
                 "--pass-k", "1", "2", str(SAMPLES), "--regression", str(regression), "--name", "check",
                 "--resamples", "2000"])
    return run, run / "eval" / "check", proc


def test_the_best_checkpoint_is_named_by_its_logged_metric(evaluated):
    """checkpoint.keep_best: each checkpoint's meta.json carries the metrics of the step it was saved after,
    and checkpoints/best names the one with the highest eval/accuracy (ties: the later step)."""
    run, _, _ = evaluated
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1:]  # 0: before RL
    for row in rows:  # the checkpoint after step k: step_k
        meta = json.loads((run / "checkpoints" / f"step_{row['step']:08d}" / "meta.json").read_text())
        assert meta["metrics"]["eval/accuracy"] == row["eval/accuracy"] and meta["metrics"]["loss"] == row["loss"]
    best = max(rows, key=lambda r: (r["eval/accuracy"], r["step"]))
    assert (run / "checkpoints" / "best").read_text().strip() == f"step_{best['step']:08d}"
    from megatron_rl.evaluation.runner import resolve_checkpoints

    assert [c.name for c in resolve_checkpoints(run, ["best"])] == [f"step_{best['step']:08d}"]


def test_outputs_and_records(evaluated):
    _, out, proc = evaluated
    for name in ("records.jsonl", "summary.json", "comparison.json", "comparison.md", "report.md", "accuracy.png"):
        assert (out / name).is_file(), name
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 2 * SEEDS * (NUM_EVAL + 3) * SAMPLES
    assert {r["checkpoint"] for r in records} == {"step_00000001", "step_00000003"}
    assert {r["set"] for r in records} == {"heldout", "regression"}
    assert all(0.0 <= r["reward"] <= 1.0 and r["correct"] == (r["reward"] >= 1.0) for r in records)
    # each record holds what was generated: the reference rule verifier scores it the same
    from megatron_rl.rewards.rule import math_reward

    from megatron_rl.config import TaskConfig
    from megatron_rl.data.tasks import Task
    from megatron_rl.data.tokenizer import load_tokenizer

    held_out = Task(TaskConfig(name="math", type="arithmetic", num_eval=NUM_EVAL), load_tokenizer("builtin:char"))
    answers = {"heldout": [p.meta["answer"] for p in held_out.prompts("eval")],
               "regression": [str(a + b) for a, b in REGRESSION]}
    for r in records:
        assert r["response"], r
        assert math_reward(r["response"].replace("<|endoftext|>", ""), answers[r["set"]][r["prompt"]]) == r["reward"], r
    assert any(r["correct"] for r in records)  # both verdicts were re-derived
    log = proc.stderr + proc.stdout
    assert "step_00000001 (step 1) | heldout: accuracy" in log and "step_00000003 (step 3) | heldout:" in log
    report = (out / "report.md").read_text()
    assert "## Set `regression` (3 prompts" in report and "accuracy.png" in report


def _by(records, **where):
    return [r for r in records if all(r[k] == v for k, v in where.items())]


def test_summary_recomputed_from_records(evaluated):
    _, out, _ = evaluated
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert [c["name"] for c in summary["checkpoints"]] == ["step_00000001", "step_00000003"]
    for ckpt in summary["checkpoints"]:
        for set_name, got in ckpt["sets"].items():
            rows = _by(records, checkpoint=ckpt["name"], set=set_name)
            per_seed_acc, per_seed_pass = [], {k: [] for k in (1, 2, SAMPLES)}
            for seed in range(SEEDS):
                seed_rows = _by(rows, seed=seed)
                per_seed_acc.append(sum(r["reward"] for r in seed_rows) / len(seed_rows))
                prompts = sorted({r["prompt"] for r in seed_rows})
                for k in per_seed_pass:
                    per_seed_pass[k].append(statistics.fmean(
                        _pass_at_k(SAMPLES, sum(r["correct"] for r in _by(seed_rows, prompt=p)), k) for p in prompts))
            for name, values in [("accuracy", per_seed_acc), *((f"pass@{k}", v) for k, v in per_seed_pass.items())]:
                m = got["metrics"][name]
                assert m["per_seed"] == pytest.approx({str(s): v for s, v in enumerate(values)}, abs=1e-12)
                mean = statistics.fmean(values)
                half = 12.7062 * statistics.stdev(values) / math.sqrt(SEEDS)  # t_{0.975, 1}
                assert m["seeds"]["mean"] == pytest.approx(mean, abs=1e-12)
                assert m["seeds"]["low"] == pytest.approx(mean - half, abs=1e-3)
                assert m["seeds"]["high"] == pytest.approx(mean + half, abs=1e-3)
                assert m["seeds"]["low"] <= mean <= m["seeds"]["high"]
                assert m["prompts"]["low"] <= m["prompts"]["mean"] <= m["prompts"]["high"]
            pooled = [sum(r["reward"] for r in _by(rows, prompt=p)) / (SEEDS * SAMPLES)
                      for p in sorted({r["prompt"] for r in rows})]
            assert got["metrics"]["accuracy"]["prompts"]["mean"] == pytest.approx(statistics.fmean(pooled))


def test_seed_zero_reproduces_training_time_evaluation(evaluated):
    run, out, _ = evaluated
    summary = json.loads((out / "summary.json").read_text())
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for ckpt in summary["checkpoints"]:
        row = next(r for r in logged if r["step"] == ckpt["step"])  # evaluated after step `step`
        metrics = ckpt["sets"]["heldout"]["metrics"]
        assert metrics["accuracy"]["per_seed"]["0"] == pytest.approx(row["eval/accuracy"], abs=1e-12)
        assert metrics[f"pass@{SAMPLES}"]["per_seed"]["0"] == pytest.approx(row["eval/pass@k"], abs=1e-12)



def test_answer_formats_and_truncation_are_counted(evaluated):
    """Strict reading: each training step counts its answers and those in no asked format (recounted here from
    the dumped responses); each evaluation logs the accuracy had answers been read by their last number and the
    share cut at the length limit, which seed 0 of the offline evaluation reproduces from its records."""
    from megatron_rl.config import TaskConfig
    from megatron_rl.data.tasks import Task
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.rewards.rule import extract_answer, math_reward

    run, out, _ = evaluated
    logged = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    for step in (1, 2, 3):
        dumped = [json.loads(line) for line in (run / "rollouts" / f"step_{step:08d}.jsonl").read_text().splitlines()]
        unformatted = sum(extract_answer(r["response_text"])[0] is None for r in dumped)
        row = logged[step]
        assert len(dumped) == 32 and (row["reward/answers"], row["reward/unformatted_answers"]) == (32, unformatted)
        assert row["reward/unformatted_share"] == pytest.approx(unformatted / 32)
        assert "reward/last_number_answers" not in row and "reward/last_number_share" not in row  # strict
    held_out = Task(TaskConfig(name="math", type="arithmetic", num_eval=NUM_EVAL), load_tokenizer("builtin:char"))
    answers = [p.meta["answer"] for p in held_out.prompts("eval")]
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    for step in (1, 3):
        seed0 = _by(records, step=step, set="heldout", seed=0)
        texts = [r["response"].replace("<|endoftext|>", "") for r in seed0]
        lenient = statistics.fmean(math_reward(t, answers[r["prompt"]], last_number=True) for t, r in zip(texts, seed0))
        assert logged[step]["eval/accuracy_last_number"] == pytest.approx(lenient, abs=1e-12)
        assert logged[step]["eval/accuracy_last_number"] >= logged[step]["eval/accuracy"]  # strict answers read alike
        assert logged[step]["eval/truncated"] == pytest.approx(statistics.fmean(r["truncated"] for r in seed0))
        assert logged[step]["eval/unformatted"] == pytest.approx(
            statistics.fmean(extract_answer(t)[0] is None for t in texts))


def test_comparison_lists_the_pair(evaluated):
    _, out, _ = evaluated
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    comparison = json.loads((out / "comparison.json").read_text())
    assert comparison["baseline"] == "step_00000001"
    pairs = {(c["set"], c["baseline"], c["candidate"]) for c in comparison["comparisons"]}
    assert pairs == {(s, "step_00000001", "step_00000003") for s in ("heldout", "regression")}
    for c in comparison["comparisons"]:
        means = [statistics.fmean(r["reward"] for r in _by(records, checkpoint=name, set=c["set"]))
                 for name in (c["baseline"], c["candidate"])]
        acc = c["metrics"]["accuracy"]
        assert acc["difference"] == pytest.approx(means[1] - means[0], abs=1e-12)
        assert acc["low"] <= acc["difference"] <= acc["high"] and 0.0 <= acc["p_value"] <= 1.0
        assert acc["significant"] == (acc["p_value"] < 0.05)
        assert set(c["metrics"]) == {"accuracy", "pass@1", "pass@2", f"pass@{SAMPLES}"}
    assert "| heldout | step_00000003 | accuracy |" in (out / "comparison.md").read_text()


def test_bad_arguments_fail_before_any_work(evaluated, tmp_path):
    run, _, _ = evaluated
    for args, message in [(["--run", str(tmp_path)], "has no config.yaml"),
                          (["--run", str(run), "--pass-k", "9"], "--pass-k 9 is invalid"),
                          (["--run", str(run), "--checkpoints", "7"], "neither a complete training checkpoint"),
                          (["--run", str(run), "+task.foo=1"], "is invalid: evaluation takes key=value"),
                          (["--run", str(run), "--regression", "task=nosuch"], "--regression task=nosuch:"),
                          (["--run", str(run), "--regression", "task=arithmetic,num_eval"],
                           "'num_eval' is not key=value"),
                          (["--run", str(run), "--regression", str(tmp_path / "no.jsonl")], "no such file"),
                          (["--run", str(run), "--regression", "task=arithmetic", "--regression",
                            "task=arithmetic,seed=4"],
                           "two sets would be called 'arithmetic'")]:
        proc = subprocess.run([sys.executable, "-m", "megatron_rl.eval", *args], capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr[-2000:])


def test_regression_sets_given_as_task_configs(evaluated):
    """`--regression SET=task=NAME,key=value,...`, repeated: several regression sets in one
    evaluation, each the eval split of its task config with its own verifier: generated math
    problems with another seed, and an agent task set (episodes in the sandbox, offline), on the
    math run's checkpoint. The prompts are those each task config itself makes; the summary has
    every set under its name."""
    from megatron_rl.config import compose, to_typed
    from megatron_rl.data.tasks import Task
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.rollout.multiturn import TurnFormat
    from tests.integration.sandbox_servers import runtime_args

    run, _, _ = evaluated
    cases = {"seed3": ("task=arithmetic,num_eval=5,seed=3", "math")}  # generated problems, read by the math rule
    if runtime_args("bwrap") is not None:
        cases["agent"] = ("task=arithmetic,type=agent,generator=function,num_eval=2,max_turns=2,max_episode_tokens=400",
                          "environment")
    given = [arg for name, (spec, _) in cases.items() for arg in ("--regression", f"{name}={spec}")]
    proc = _run(["megatron_rl.eval", "--run", str(run), "--checkpoints", "latest", "--seeds", "1", *given,
                 "--name", "regression_sets", "--resamples", "200", "rollout.max_new_tokens=32"])
    out = run / "eval" / "regression_sets"
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {r["set"] for r in records} == {"heldout", *cases}
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["checkpoints"][0]["sets"]) == {"heldout", *cases}
    for name, (spec, reward) in cases.items():
        cfg = to_typed(compose(["task=arithmetic", *(f"task.{item}" for item in spec.split(",")[1:])]))
        task = Task(cfg.task, load_tokenizer(cfg.model.tokenizer))
        want = len(task.prompts("eval"))
        assert task.reward_kind == reward and want == cfg.task.num_eval
        assert f"regression set {spec}: {want} prompts, reward {reward} (set {name})" in proc.stderr, \
            proc.stderr[-3000:]
        mine = [r for r in records if r["set"] == name]
        assert sorted({r["prompt"] for r in mine}) == list(range(want)) and len(mine) == want * SAMPLES, name
        assert all(0.0 <= r["reward"] <= 1.0 for r in mine)
        if name == "agent":  # each episode's turns: a tool turn answers every model turn but the last
            observation = TurnFormat(task.tokenizer, "").observation_prefix
            for r in mine:
                assert 1 <= r["turns"] <= 2 and r["ended"] in ("submitted", "max_turns", "max_tokens"), r
                assert r["response"].count(observation) == r["turns"] - 1, r
                assert isinstance(r["env"], dict)
            episodes = summary["checkpoints"][0]["sets"][name]["episodes"]
            assert episodes["num_episodes"] == len(mine)
            assert episodes["turns_mean"] == pytest.approx(statistics.fmean(r["turns"] for r in mine))
        else:
            assert not any(key in r for r in mine for key in ("turns", "ended", "env"))


def test_multi_domain_run_per_domain_breakdown(tmp_path):
    """Two dataset domains, one on a 0..10 reward scale: records come back in [0, 1], the summary
    has both domains, and seed 0 reproduces the training-time per-domain accuracy."""
    rows = {name: [{"prompt": f"{name.upper()}{i}:", "answer": (i * 7 + seed) % 2 + 1} for i in range(100)]
            for name, seed in (("a", 0), ("b", 1))}
    for name, data in rows.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    run = tmp_path / "run"
    domains = (f"+domains={{a:{{task:{{name:a,type:dataset,path:{tmp_path / 'a.jsonl'},num_eval:6}}}},"
               f"b:{{task:{{name:b,type:dataset,path:{tmp_path / 'b.jsonl'},num_eval:6,reward_scale:10.0}}}}}}")
    _run(["megatron_rl.train", "mode=rl", f"run_dir={run}", "num_steps=2", "global_batch_size=32",
          "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=8", "task.sft_warmup_steps=30",
          f"task.eval_samples={SAMPLES}", "task.eval_every=1", "checkpoint.save_every=1", "logging.progress=false",
          domains])
    _run(["megatron_rl.eval", "--run", str(run), "--seeds", "2", "--name", "domains", "--resamples", "1000"])
    out = run / "eval" / "domains"
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {r["domain"] for r in records} == {"a", "b"} and all(0 <= r["reward"] <= 1 for r in records)
    summary = json.loads((out / "summary.json").read_text())
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [c["name"] for c in summary["checkpoints"]] == ["step_00000001", "step_00000002"]
    for ckpt in summary["checkpoints"]:
        row = next(r for r in logged if r["step"] == ckpt["step"])
        for domain, got in ckpt["sets"]["heldout"]["domains"].items():
            mine = _by(records, checkpoint=ckpt["name"], domain=domain, seed=0)
            assert got["metrics"]["accuracy"]["per_seed"]["0"] == pytest.approx(
                statistics.fmean(r["reward"] for r in mine), abs=1e-12)
            assert got["metrics"]["accuracy"]["per_seed"]["0"] == pytest.approx(row[f"eval/{domain}/accuracy"],
                                                                                   abs=1e-12)
    assert "### Domain `b`" in (out / "report.md").read_text()


def test_pooling_reads_real_evaluations(evaluated, tmp_path):
    """`--pool` on this evaluation's output (given twice, as two identical runs): each run value is
    the summary's seed mean at the latest step, per set; identical runs give a zero-width interval."""
    _, out, _ = evaluated
    summary = json.loads((out / "summary.json").read_text())
    latest = next(c for c in summary["checkpoints"] if c["name"] == "step_00000003")
    for set_name in ("heldout", "regression"):
        dest = tmp_path / set_name
        _run(["megatron_rl.eval", "--pool", str(out), str(out), "--set", set_name, "--out", str(dest)])
        pooled = json.loads((dest / "pooled.json").read_text())["groups"]["pool"]
        assert [r["step"] for r in pooled["runs"]] == [3, 3]
        for metric in ("accuracy", "pass@1", f"pass@{SAMPLES}"):
            want = latest["sets"][set_name]["metrics"][metric]["seeds"]["mean"]
            assert pooled["pooled"][metric]["mean"] == pytest.approx(want, abs=1e-12)
            assert pooled["pooled"][metric]["low"] == pytest.approx(want, abs=1e-12)
