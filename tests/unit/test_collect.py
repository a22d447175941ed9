"""rollout.collect: a verifier that fails or is late leaves its samples unscored (status "unscored",
left out of the update by the RL step) instead of crashing the step or scoring them 0."""

from __future__ import annotations

import dataclasses
import importlib
import types

import torch

from megatron_rl.data.tasks import RuleVerifier
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.rewards.custom import CustomVerifier
from megatron_rl.rewards.service import RewardService
from megatron_rl.rl.advantages import step_advantages
from megatron_rl.rollout.collect import is_scored
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.collect import collect
from megatron_rl.rollout.scripted import ScriptedPolicy

GROUPS = types.SimpleNamespace(dp_size=1, dp_rank=0, is_first_model_parallel_rank=True)


@dataclasses.dataclass
class _Prompt:
    tokens: list[int]
    meta: dict


def _run(verifier_factory, metas, **kwargs):
    tokenizer = load_tokenizer("builtin:char")
    engine = ScriptedPolicy(tokenizer, ["\\boxed{7}"])
    text = tokenizer.apply_chat_template([{"role": "user", "content": "3+4"}], tokenize=False,
                                         add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    service = RewardService(verifier_factory)
    try:
        return collect(engine, [_Prompt(prompt, m) for m in metas], SamplingParams(max_new_tokens=16, n=2), service,
                       GROUPS, lambda ids: tokenizer.decode(ids, skip_special_tokens=True), num_chunks=2, **kwargs)
    finally:
        service.close()


def test_a_failing_verifier_leaves_its_chunk_unscored():
    # the second chunk's rows have no answer: the math verifier raises KeyError on them
    rollouts, stats = _run(lambda: RuleVerifier("math"), [{"answer": "7"}, {"answer": "8"}, {}, {}])
    assert [r.status for r in rollouts] == [""] * 4 + ["unscored"] * 4
    assert [r.reward for r in rollouts[:4]] == [1.0, 1.0, 0.0, 0.0]
    assert stats["reward/failed_batches"] == 1.0 and stats["reward/timeouts"] == 0.0
    assert stats["reward/unscored"] == 4.0  # the failed batch's samples are samples without a verdict too
    assert [is_scored(r) for r in rollouts] == [True] * 4 + [False] * 4
    assert [r.scored for r in rollouts] == [True] * 4 + [False] * 4


def test_a_late_verifier_leaves_its_samples_unscored(tmp_path, monkeypatch):
    # the reward waits for a gate opened only after collect() returned: late however slow this machine is
    (tmp_path / "slow_reward.py").write_text("import threading\nGATE = threading.Event()\n"
                                             "def score(c, s):\n    GATE.wait(60)\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        rollouts, stats = _run(lambda: CustomVerifier("slow_reward:score"), [{"answer": "7"}] * 2,
                               reward_timeout_s=0.2)
    finally:
        importlib.import_module("slow_reward").GATE.set()
    assert [r.status for r in rollouts] == ["unscored"] * 4 and stats["reward/timeouts"] >= 1.0
    assert stats["reward/unscored"] == 4.0
    cfg = types.SimpleNamespace(algorithm=types.SimpleNamespace(advantage_estimator="grpo"))
    assert step_advantages(cfg, rollouts, torch.zeros(4)) == ([None] * 4, None)


def test_no_verdict_from_a_verifier_leaves_that_sample_unscored(tmp_path, monkeypatch):
    """A reward function that raises on some completions: those samples only are unscored (NaN from the
    verifier), the others keep their rewards."""
    (tmp_path / "picky_reward.py").write_text(
        "def score(c, s):\n    if s['answer'] == '8':\n        raise ValueError('no')\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rollouts, stats = _run(lambda: CustomVerifier("picky_reward:score"), [{"answer": "7"}, {"answer": "8"}])
    assert [r.status for r in rollouts] == ["", "", "unscored", "unscored"]
    assert [r.reward for r in rollouts] == [1.0, 1.0, 0.0, 0.0] and stats["reward/unscored"] == 2.0
