"""Reward audit: every `logging.audit_every` steps the highest-reward trajectories of the
step go to `<run_dir>/audit/step_<N>.jsonl` for a human to read, each with the heuristics
that flag a likely shortcut:

- `test_edit`: the episode changed a protected file (tests, verifier) - from the
  environment's verification;
- `hardcoded_output`: a changed function returns an expected literal for a tested input;
- `suspiciously_short`: a rewarded response much shorter than the step's typical
  rewarded response (under `short_fraction` of their median length, in model tokens);
- `repeated_answer`: the response states a final answer (a `\\boxed{}` or `####` line that is not empty)
  more than once, the pattern of a policy that learned to repeat `#### N` until the length limit (a
  strict verifier reads the last one, so the repeats cost nothing but the end of the response).
- `model_rule_disagree`: a task scored by a model (task.reward=reward_model|judge) with a rule check
  (task.rule_check): the model passes the response (its score above task.rule_check_threshold) and the rule
  gives 0, or the other way round - a policy that learned to please the model rather than to be right shows
  here first. The record's `checks` hold both verdicts.

A flag is a prompt to look, not a verdict: the first two already zero the reward in the
`repo` environment, so a flagged high-reward trajectory means a guard was bypassed.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any, Callable, Sequence


# A final answer stated: a box or a `####` line with something in it (an empty `\\boxed{}`, the instruction
# copied, states nothing)
_STATED_ANSWER = re.compile(r"\\boxed\{\s*[^\s}]|####[ \t]*[^\s#]")


def model_tokens(rollout: Any) -> int:
    mask = getattr(rollout, "model_mask", None)
    return sum(mask) if mask is not None else len(rollout.output_ids)


def flags_of(rollout: Any, typical_length: float, short_fraction: float, text: str = "") -> list[str]:
    """The flags of one trajectory; `text`: its decoded response."""
    info = getattr(rollout, "info", {}) or {}
    flags = []
    if info.get("tampered"):
        flags.append("test_edit")
    if info.get("hardcoded"):
        flags.append("hardcoded_output")
    if rollout.reward > 0 and typical_length > 0 and model_tokens(rollout) < short_fraction * typical_length:
        flags.append("suspiciously_short")
    if len(_STATED_ANSWER.findall(text)) > 1:
        flags.append("repeated_answer")
    checks = getattr(rollout, "checks", None) or {}
    if "rule_reward" in checks and "model_passes" in checks and checks["model_passes"] != (checks["rule_reward"] > 0):
        flags.append("model_rule_disagree")
    return flags


def audit(step: int, rollouts: Sequence[Any], decode: Callable[[list[int]], str], out_dir: Path,
          num_samples: int = 8, short_fraction: float = 0.25) -> dict[str, float]:
    """Write the step's top `num_samples` trajectories by reward (ties: shortest first) with
    their flags; returns counts for the metrics."""
    rewarded = [r for r in rollouts if r.reward > 0]
    typical = statistics.median(model_tokens(r) for r in rewarded) if rewarded else 0.0
    chosen = sorted(rollouts, key=lambda r: (-r.reward, model_tokens(r)))[:num_samples]
    out_dir.mkdir(parents=True, exist_ok=True)
    records = []
    texts = {id(r): decode(list(r.output_ids)) for r in rollouts}
    for r in chosen:
        records.append({"step": step, "group": r.prompt_index, "reward": r.reward, "model_tokens": model_tokens(r),
                        "flags": flags_of(r, typical, short_fraction, texts[id(r)]),
                        "prompt": decode(list(r.prompt_tokens)), "response": texts[id(r)],
                        "info": getattr(r, "info", {}) or {}, "checks": getattr(r, "checks", {}) or {}})
    (out_dir / f"step_{step:08d}.jsonl").write_text("".join(json.dumps(x, default=str) + "\n" for x in records))
    flagged_all = [flags_of(r, typical, short_fraction, texts[id(r)]) for r in rollouts]
    counts = {"audit/flagged": float(sum(bool(f) for f in flagged_all)),
              "audit/flagged_rewarded": float(sum(bool(f) and r.reward > 0 for f, r in zip(flagged_all, rollouts)))}
    if any("rule_reward" in (getattr(r, "checks", None) or {}) for r in rollouts):  # a task with a rule check
        counts["audit/model_rule_disagree"] = float(sum("model_rule_disagree" in f for f in flagged_all))
    return counts
