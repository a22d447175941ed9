"""Static task-set checks, the environment pool and the reward audit, on planted inputs."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_rl.quality import checks
from megatron_rl.rewards.audit import audit
from megatron_rl.data.env_pool import EnvPool
from megatron_rl.rollout.multiturn import Episode

BASE = ("Write a function that returns the sum of the two integers it is given, without using any imports. "
        "The function must be called add, take exactly two positional arguments, and must not print anything; "
        "negative numbers and zero are valid inputs and the result is returned as a plain integer value.")


def test_exact_duplicates_ignore_case_and_spacing_only():
    texts = [BASE, "something else entirely", BASE.upper().replace(" ", "   \n"), "x", BASE + "!!"]
    assert checks.exact_duplicates(texts) == {2: 0}  # BASE + "!!" is another text (a near duplicate at most)


def test_exact_duplicates_keep_code_operators():
    """`a + b`, `a - b` and `a * b` are different code tasks, not one task three times."""
    code = "Fix the bug in calc/ops.py.\n\ndef f(a, b):\n    return a {} b\n"
    texts = [code.format(op) for op in "+-*/"] + [code.format("+").upper().replace("    ", "\t")]
    assert checks.exact_duplicates(texts) == {4: 0}
    assert checks.normalize("Return A  *\tB") == "return a * b"


def test_generated_repo_tasks_are_exact_duplicates_only_when_their_text_is_the_same():
    """repo_tasks differ in which operator is broken; only those whose whole text is the same
    (modulo case and whitespace: compared independently here) are duplicates, and a pair whose
    code differs by an operator is not a near duplicate at 1.0 either."""
    from megatron_rl.data.agent_tasks import repo_tasks

    tasks = repo_tasks(40)
    texts = [checks.task_text(t) for t in tasks]
    keys = [" ".join(t.lower().split()) for t in texts]
    same = {i: keys.index(k) for i, k in enumerate(keys) if keys.index(k) < i}
    assert checks.exact_duplicates(texts) == same
    ids = {t["id"]: i for i, t in enumerate(tasks)}
    mul, add = ids["repo-8-mul"], ids["repo-11-add"]
    assert texts[mul] != texts[add] and mul not in same and add not in same
    assert (mul, add, 1.0) not in checks.near_duplicates(texts)


def test_near_duplicates_catch_small_edits_only():
    edited = BASE.replace("two integers", "two whole integers")
    unrelated = "Parse a date string in ISO format and return the weekday name of that date in English."
    pairs = checks.near_duplicates([BASE, unrelated, edited], threshold=0.6)
    assert [(i, j) for i, j, _ in pairs] == [(0, 2)]
    # the estimate is close to the true Jaccard of the 5-shingles, computed by hand here
    a, b = (checks.ngrams(checks.tokens(t), 5) for t in (BASE, edited))
    assert abs(pairs[0][2] - len(a & b) / len(a | b)) < 0.15


def test_contamination_is_the_shared_ngram_fraction():
    eval_text = "intro words here " + BASE
    shares = checks.contamination([BASE, "a completely different task about sorting lists of strings by length"],
                                  [eval_text], n=8)
    assert shares == [1.0, 0.0]
    half = " ".join(checks.words(BASE)[:10]) + " then print the answer to standard output right away please"
    tokens = checks.words(half)
    grams = checks.ngrams(tokens, 8)
    expected = len(grams & checks.ngrams(checks.words(eval_text), 8)) / len(grams)
    assert checks.contamination([half], [eval_text], n=8) == [pytest.approx(expected)] and 0 < expected < 1


def test_contamination_of_a_task_shorter_than_n_words():
    """No 8-gram in a 6-word task: it is contaminated when its word sequence occurs inside an
    evaluation text (whole words, one text), whatever the punctuation and case."""
    eval_texts = ["Ann has 3 pens and gets 2 more. How many pens does Ann have now?", "Bob reads a book."]
    tasks = ["ann has 3 pens, and gets", "Ann has 3 pens and loses", "nn has 3 pens", "have now? Bob reads",
             "Bob reads a book", ""]
    assert checks.contamination(tasks, eval_texts, n=8) == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]


def test_empty_and_ambiguous_descriptions():
    tasks = [{"prompt": "", "answer": "1"}, {"prompt": "What is it?", "answer": "1"},
             {"prompt": "What is it?", "answer": "2"}, {"prompt": "Add 2 and 3 please.", "answer": "5"}]
    assert checks.description_flags(tasks) == [["empty_description"], ["ambiguous"], ["ambiguous"], []]


def test_flip_rate_and_difficulty_buckets():
    assert checks.flip_rate([1, 1, 1, 1]) == 0.0
    assert checks.flip_rate([1, 0, 1, 1]) == 0.25
    assert [checks.difficulty_bucket(p) for p in (0.0, 0.1, 0.25, 0.5, 0.8, 1.0)] == \
        ["never", "hard", "hard", "medium", "easy", "always"]


def test_env_pool_retires_trivial_and_flaky_tasks_and_refills_slots():
    items = ["t0", "t1", "t2"]
    pool = EnvPool(items, task_id=str, queue=["n0"], trivial_pass_rate=0.9, min_samples=4)
    for _ in range(4):
        pool.observe(0, 1.0, "same")  # always solved
        pool.observe(2, 0.0)
    pool.observe(1, 1.0, "resp")
    pool.observe(1, 0.0, "resp")  # the same response scored 1 then 0: flaky
    changes = pool.gc_and_refresh(step=7)
    assert [(c["retired"], c["injected"]) for c in changes] == [("t0", "n0")]
    assert items == ["n0", "t1", "t2"] and "trivial" in changes[0]["why"]
    assert pool.gc_and_refresh(step=8) == []  # t1 is flaky but the queue is empty: it stays, flagged
    assert pool.stats[1].retired.startswith("flaky") and pool.metrics()["env_pool/flaky_suspects"] == 1.0
    state = json.loads(json.dumps(pool.state_dict()))  # travels in a checkpoint
    again = EnvPool(["t0", "t1", "t2"], task_id=str, queue=["n0"])
    again.load_state_dict(state, {t: t for t in ("t0", "t1", "t2", "n0")})
    assert again.items == items and list(again.queue) == [] and again.stats[1].contradictions == 1


def _episode(reward, model_tokens, info=None):
    return Episode(0, [1, 2], [5] * (model_tokens + 3), [0.0] * (model_tokens + 3), "stop", 1, reward,
                   model_mask=[1] * model_tokens + [0] * 3, info=info or {})


def test_audit_flags_shortcuts_among_high_reward_trajectories(tmp_path):
    rollouts = [_episode(1.0, 40), _episode(1.0, 44), _episode(1.0, 5), _episode(1.0, 42, {"tampered": ["tests/a"]}),
                _episode(0.0, 40)]
    counts = audit(3, rollouts, lambda ids: "x" * len(ids), tmp_path, num_samples=4)
    records = [json.loads(line) for line in (tmp_path / "step_00000003.jsonl").read_text().splitlines()]
    assert [r["model_tokens"] for r in records] == [5, 40, 42, 44]  # top reward, shortest first
    assert [r["flags"] for r in records] == [["suspiciously_short"], [], ["test_edit"], []]
    assert counts == {"audit/flagged": 2.0, "audit/flagged_rewarded": 2.0}


def test_audit_flags_a_repeated_final_answer(tmp_path):
    """The pattern TRL's GRPO run taught SmolLM2: `#### N` repeated up to the length limit."""
    texts = {1: "3 + 4 = 7\n#### 7\nThe answer is \\boxed{}.", 2: "#### 7\n#### 7\n#### 7",
             3: "\\boxed{7} so \\boxed{ 7}", 4: "7"}  # 1: an empty box (the instruction copied) states nothing
    rollouts = [Episode(0, [1], [t] * 20, [0.0] * 20, "stop", 1, 1.0) for t in texts]
    counts = audit(1, rollouts, lambda ids: texts[ids[0]], tmp_path, num_samples=4)
    records = [json.loads(line) for line in (tmp_path / "step_00000001.jsonl").read_text().splitlines()]
    assert {r["response"]: r["flags"] for r in records} == {texts[1]: [], texts[2]: ["repeated_answer"],
                                                             texts[3]: ["repeated_answer"], texts[4]: []}
    assert counts == {"audit/flagged": 2.0, "audit/flagged_rewarded": 2.0}


@pytest.mark.parametrize("model", ["tiny_qwen2", "tiny_qwen3_moe", "tiny_gpt_oss"])
def test_policy_engine_holds_the_checkpoints_weights(tmp_path, model):
    """The difficulty policy's engine holds exactly the checkpoint's tensors, whether transformers keeps them
    as written (Qwen2), fuses the experts in memory (Qwen3-MoE) or stores them stacked (gpt-oss)."""
    import types

    from megatron_rl.checkpoint.hf import read_tensors
    from megatron_rl.config import load_config
    from megatron_rl.models.hf import build_hf_model
    from megatron_rl.quality.runner import policy_engine

    model_cfg = load_config([f"model={model}"], world_size=1).model
    build_hf_model(model_cfg, seed=3).save_pretrained(tmp_path)
    engine = policy_engine(str(tmp_path), types.SimpleNamespace(eos_token_id=0, pad_token_id=0))
    held, written = engine.hf_state_dict(), read_tensors(tmp_path)
    assert set(written) <= set(held)
    for name, tensor in written.items():
        assert torch.equal(held[name], tensor), name
    assert engine.weight_version == 1
