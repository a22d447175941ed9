"""Held-out evaluation: in the loop (`evaluate`, every task.eval_every steps) and offline, of a run's
checkpoints (`evaluate_checkpoints`, `python -m megatron_rl.eval`). Both draw the same samples with the
same seeds; records and metrics come from megatron_rl/evaluation/."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from pathlib import Path
from typing import Any

from megatron_rl.evaluation.records import eval_metrics, pass_at_k_prompts, records_from_rollouts
from megatron_rl.rl.metrics import sandbox_client
from megatron_rl.rl.model_rewards import score_with_reward_models
from megatron_rl.rollout.collect import Rollout, is_scored

logger = logging.getLogger(__name__)


def evaluation_records(rt, run: Any, repeat: int = 0) -> tuple[list[dict[str, Any]], list[Rollout]]:
    """Per-sample records (megatron_rl/evaluation/records.py) and rollouts of `task.eval_samples`
    samples for each of `run.eval`, with the current weights. Repeat 0 draws what every
    training-time evaluation draws; offline evaluation's further seeds are repeats 1, 2, ..."""
    cfg, prompts = rt.cfg, run.eval
    params = run.generation.sampling(cfg.task.eval_samples, seed=cfg.seed * 7 + 1 + 7919 * repeat, evaluation=True)
    client = sandbox_client(run)
    trained_as = getattr(client, "priority_class", None)
    if trained_as is not None:  # evaluation traffic is its own class at the sandbox (weighted fair queueing)
        client.priority_class = "evaluation"
    try:
        rollouts, _ = run.controller.rollout(lambda: run.generation.generate(prompts, params))
    finally:
        if trained_as is not None:
            client.priority_class = trained_as
    score_with_reward_models(run, rollouts)  # a reward-model task's held-out reward is its model's score
    return records_from_rollouts(prompts, rollouts, run.task.reward_scale_of), rollouts


def evaluate(rt, run: Any, step: int) -> dict[str, float]:
    """Mean reward (accuracy) and pass@k on the held-out prompts, with the current weights."""
    prompts = run.eval
    if not prompts:
        return {}
    k = rt.cfg.task.eval_samples
    records, rollouts = evaluation_records(rt, run)  # the same draws at every evaluation
    found = eval_metrics(records, [k])
    accuracy, pass_k = found["accuracy"], found[f"pass@{k}"]
    logger.info("eval at step %d: accuracy %.3f, pass@%d %.3f (%d prompts)", step, accuracy, k, pass_k, len(prompts))
    per_domain = run.domains.eval_metrics(step, records) if run.domains else {}
    lost = sum(bool(r["lost"]) for r in records)
    if lost:
        over, _ = pass_at_k_prompts(records, k)
        logger.warning("eval at step %d: %d of %d samples got no verdict (sandbox or verifier failures) and are "
                       "left out of the metrics; pass@%d is over the %d of %d prompts that kept all %d samples",
                       step, lost, len(records), k, over, len(prompts), k)
    return {"eval/accuracy": accuracy, "eval/pass@k": pass_k, "eval/samples": float(len(rollouts) - lost),
            "eval/lost": float(lost), "eval/truncated": found["truncated"], **lenient_accuracy(run, rollouts),
            **per_domain}


def lenient_accuracy(run: Any, rollouts: list[Rollout]) -> dict[str, float]:
    """A single-task run with reward=math read strictly: the held-out accuracy had each answer been read by
    its last number too (`eval/accuracy_last_number`), beside the share of answers in no asked format
    (`eval/unformatted`). A gain in the strict accuracy alone is a format gain; a skill gain lifts both."""
    from megatron_rl.rewards.rule import score_answer

    task = run.task
    if getattr(task, "reward_kind", None) != "math" or task.cfg.answer_extraction != "strict":  # one task, no domains
        return {}
    decode, prompts = run.generation.decode, run.eval
    rollouts = [r for r in rollouts if is_scored(r)]  # as the strict accuracy: over the samples with a verdict
    if not rollouts:
        return {}
    per_prompt: dict[int, list[tuple[float, float]]] = {}
    for r in rollouts:
        reward, how = score_answer(decode(list(r.output_ids)), prompts[r.prompt_index].meta["answer"],
                                   task.cfg.reward_tolerance, last_number=True)
        per_prompt.setdefault(r.prompt_index, []).append((reward, float(how not in ("boxed", "####"))))
    # each prompt's mean, averaged over the prompts, as the strict accuracy (evaluation/records.py)
    means = [[sum(x) / len(pairs) for x in zip(*pairs)] for pairs in per_prompt.values()]
    return {"eval/accuracy_last_number": sum(m[0] for m in means) / len(means),
            "eval/unformatted": sum(m[1] for m in means) / len(means)}


def evaluate_checkpoints(rt, spec: Any) -> dict[str, Any]:
    """Evaluate every checkpoint on every set for every seed; returns the summary (rank 0 writes
    records.jsonl and the report under spec.out_dir)."""
    from tqdm import tqdm

    from megatron_rl.evaluation.report import write_report
    from megatron_rl.rl.state import build_run
    from megatron_rl.evaluation.runner import HELD_OUT, generated_fields, load_checkpoint, one_line

    # the policy alone, on this job's engine (no critic, no generators); offline: no domain pausing,
    # per-domain numbers come from the records
    run = dataclasses.replace(build_run(rt, evaluation=True), domains=None)
    sets = {HELD_OUT: run}
    for set_name, regression in spec.regression:
        sets[set_name] = _regression_run(rt, run, regression, set_name)
    out = Path(spec.out_dir)
    records_path = out / "records.jsonl"
    # What was generated, special tokens kept: an agent episode's turn and observation markers show.
    decode = functools.partial(run.tokenizer.decode, skip_special_tokens=False)
    if rt.is_main:
        records_path.unlink(missing_ok=True)
    bar = tqdm(total=len(spec.checkpoints) * len(sets) * spec.num_seeds, desc="eval", unit="eval",
               disable=not (rt.is_main and rt.cfg.logging.progress))
    records: list[dict[str, Any]] = []
    try:
        for ckpt in spec.checkpoints:
            start = time.perf_counter()
            load_checkpoint(run.trainer, ckpt)
            found: list[dict[str, Any]] = []
            for set_name, set_run in sets.items():
                for seed in range(spec.num_seeds):
                    got, rollouts = evaluation_records(rt, set_run, repeat=seed)
                    got = [{"set": set_name, "checkpoint": ckpt.name, "step": ckpt.step, "seed": seed, **r,
                            **generated_fields(rollout, decode)} for r, rollout in zip(got, rollouts)]
                    if rt.is_main:
                        with open(records_path, "a") as f:
                            f.writelines(json.dumps(r) + "\n" for r in got)
                    found += got
                    bar.update()
            records += found
            logger.info("%s", one_line(ckpt, found, spec, time.perf_counter() - start))
    finally:
        bar.close()
        for set_run in sets.values():
            set_run.rewards.close()
    if not rt.is_main:
        return {}
    return write_report(out, records, spec)


def _regression_run(rt, run: Any, spec: str, set_name: str) -> Any:
    """The run with the regression set's prompts, task and reward service: a file's rows
    read with the run's task settings (prompt_key, answer_key, chat_template, ...), or the eval
    split of a task config (`regression_task_config`: generated problems, an agent task set)
    with its own verifier."""
    from megatron_rl import runtime
    from megatron_rl.data.tasks import Task
    from megatron_rl.evaluation.runner import regression_task_config
    from megatron_rl.rewards.service import RewardService

    task_cfg = regression_task_config(spec)
    if task_cfg is None:
        base = rt.cfg.task
        from megatron_rl.rewards.custom import is_reward_path

        # a reward function by path serves the file's rows as well
        reward = base.reward if base.reward in ("math", "exact", "tests") or is_reward_path(base.reward) else "auto"
        task_cfg = dataclasses.replace(base, name=set_name, type="dataset", path=spec, eval_path=spec,
                                       num_eval=10**9, reward=reward)
    task = Task(task_cfg, run.tokenizer)
    prompts = task.prompts("eval")
    if not prompts:
        raise ValueError(f"the regression set {spec} has no rows")
    addresses = runtime.sandbox_addresses(rt) if task.needs_sandbox else []
    logger.info("regression set %s: %d prompts, reward %s (set %s)", spec, len(prompts), task.reward_kind, set_name)
    rewards = RewardService(task.verifier_factory(addresses))
    generation = dataclasses.replace(run.generation, task=task, rewards=rewards, turn_formats={})
    return dataclasses.replace(run, task=task, eval=prompts, rewards=rewards, generation=generation)
