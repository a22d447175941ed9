"""Model rewards without a model forward: the judge's prompt and verdicts (rewards/judge.py) run on a scripted
engine through the real judging path (rollout/judging.py: prompts rendered by the task, greedy requests,
verdicts parsed, failures counted and left unscored), `task.judge.show_reference=false` respected, the config
checks of task.reward=reward_model|judge (checkpoint kind, num_labels, tokenizer), and the reward-hacking
guard's disagreement count and audit flag. The reward model's scores against transformers are
tests/distributed/test_reward_model.py."""

from __future__ import annotations

import json
import logging
import shutil
import types

import pytest

from megatron_rl.checks import ConfigError
from megatron_rl.config.task import JudgeConfig, TaskConfig
from megatron_rl.data.tasks import Task
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.rewards.audit import audit
from megatron_rl.rewards.judge import judge_prompt, parse_verdict
from megatron_rl.rl.model_rewards import rule_disagreements
from megatron_rl.rollout.collect import Rollout
from megatron_rl.rollout.judging import judge_rollouts
from megatron_rl.rollout.scripted import ScriptedPolicy

ONE_PROCESS = types.SimpleNamespace(dp_size=1, dp_rank=0, is_first_model_parallel_rank=True)


@pytest.mark.parametrize(("verdict", "reply", "expected"), [
    ("score", "Looks right.\nscore: 7", 0.7),
    ("score", "Score = 3 at first... on reflection SCORE: 10", 1.0),  # the last one counts
    ("score", "score: 11", None),  # beyond max_score: no verdict
    ("score", "I would give it a seven", None),
    ("yes_no", "No, wait. Yes", 1.0),
    ("yes_no", "The answer is wrong: no", 0.0),
    ("yes_no", "nobody knows", None),  # `no` inside a word is not a verdict
    ("yes_no", "**Yes**.", 1.0),
    ("yes_no", "Yes, the response is correct.", 1.0),  # not at the end, but the only one it says
    ("yes_no", "Yes, the response is correct and has no errors.", None),  # not the last `no` it happens to say
    ("yes_no", "Answer: No. It says yes but 2+3 is 5.", None),
])
def test_verdicts(verdict, reply, expected):
    assert parse_verdict(JudgeConfig(verdict=verdict), reply) == expected


def test_the_reference_is_shown_only_when_asked():
    shown = judge_prompt(JudgeConfig(), "What is 2+2?", "4", "4")
    hidden = judge_prompt(JudgeConfig(show_reference=False), "What is 2+2?", "4", "4")
    assert "Reference answer:\n4" in shown and "Reference" not in hidden and "What is 2+2?" in hidden
    custom = JudgeConfig(template="Q: {prompt} A: {response} Gold: {reference} {braces}")
    assert judge_prompt(custom, "q", "{reference}", "g") == "Q: q A: {reference} Gold: g {braces}"
    with pytest.raises(ConfigError, match="show_reference=false"):
        JudgeConfig(template="{prompt} {response} {reference}", show_reference=False)
    with pytest.raises(ConfigError, match="no {response}"):
        JudgeConfig(template="{prompt}")


def _judged(show_reference: bool, rule_check=None, reward_scale: float = 1.0):
    return judged_on(ONE_PROCESS, show_reference, rule_check, reward_scale)


def judged_on(groups, show_reference: bool, rule_check=None, reward_scale: float = 1.0):
    """A judged arithmetic task's prompts, one right and one wrong response to each, the scripted judge's
    inputs, and the rollouts after judging. The judge says `score: 8` when it sees the right answer as the
    reference, `score: 2` for a wrong response, and nothing it can parse without a reference."""
    tokenizer = load_tokenizer("builtin:char")
    task = Task(TaskConfig(name="a", type="arithmetic", reward="judge", chat_template=True, num_train=3, num_eval=0,
                           judge=JudgeConfig(show_reference=show_reference), rule_check=rule_check,
                           reward_scale=reward_scale), tokenizer)
    prompts = task.prompts("train")
    seen = []

    def judge(conversation: str) -> str:
        seen.append(conversation)
        if "Reference answer:" not in conversation:
            return "I cannot tell."
        return "score: 8" if "Response:\n\\boxed{right}" in conversation else "score: 2"
    engine = ScriptedPolicy(tokenizer, [judge])
    rollouts = []
    for i, p in enumerate(prompts):
        for text in ("\\boxed{right}", "\\boxed{wrong}"):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            rollouts.append(Rollout(i, list(p.tokens), ids, [0.0] * len(ids), "stop", 1, reward=1.0 * (i == 0)))
    stats = judge_rollouts(engine, groups, task, prompts, rollouts,
                           lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    return prompts, seen, rollouts, stats


def test_the_policy_engine_judges_each_response_with_the_reference():
    prompts, seen, rollouts, stats = _judged(show_reference=True, reward_scale=2.0)
    assert len(seen) == 6 and all(f"Reference answer:\n{p.meta['answer']}" in s for p, s in zip(prompts, seen[::2]))
    assert [r.reward for r in rollouts] == pytest.approx([1.6, 0.4] * 3)  # 8/10 and 2/10, times reward_scale
    assert all(r.scored for r in rollouts)
    assert stats["reward/judge_calls"] == 6 and stats["reward/judge_parse_failures"] == 0


def test_show_reference_false_hides_it_and_a_reply_without_verdict_is_unscored_not_zero(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.judging"):
        prompts, seen, rollouts, stats = _judged(show_reference=False)
    assert len(seen) == 6 and not any("Reference" in s for s in seen)
    assert all(p.meta["question"].split(" Answer")[0] in s for p, s in zip(prompts, seen[::2]))
    assert [r.status for r in rollouts] == ["unscored"] * 6 and not any(r.scored for r in rollouts)
    assert stats["reward/judge_parse_failures"] == 6
    assert "no verdict for 6 of 6 responses" in caplog.text and "I cannot tell." in caplog.text


def test_a_judge_reply_cut_at_max_new_tokens_is_no_verdict(caplog):
    """The verdict comes last; a reply cut at task.judge.max_new_tokens holds, at most, a `score: X` from its
    middle (here the judged response quoted back): no verdict, counted, the sample unscored."""
    tokenizer = load_tokenizer("builtin:char")
    task = Task(TaskConfig(name="a", type="arithmetic", reward="judge", chat_template=True, num_train=1, num_eval=0,
                           judge=JudgeConfig(max_new_tokens=40)), tokenizer)
    [prompt] = task.prompts("train")
    quoted = "The response says 'score: 10' and then " + "rambles " * 20
    engine = ScriptedPolicy(tokenizer, [lambda conversation: quoted])
    ids = tokenizer("\\boxed{1}", add_special_tokens=False)["input_ids"]
    rollouts = [Rollout(0, list(prompt.tokens), ids, [0.0] * len(ids), "stop", 1, reward=0.0)]
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.judging"):
        stats = judge_rollouts(engine, ONE_PROCESS, task, [prompt], rollouts,
                               lambda i: tokenizer.decode(i, skip_special_tokens=True))
    assert parse_verdict(task.cfg.judge, quoted[:40]) == 1.0  # what reading the cut reply would have given
    assert rollouts[0].status == "unscored" and not rollouts[0].scored
    assert (stats["reward/judge_parse_failures"], stats["reward/judge_cut"]) == (1.0, 1.0)
    assert "1 of them cut at task.judge.max_new_tokens" in caplog.text


def test_a_rule_check_disagreeing_with_the_judge_is_counted_and_flagged(tmp_path):
    # the rule check gave 1 to both responses of prompt 0 (as if both were right) and 0 to the others
    _, _, rollouts, _ = _judged(show_reference=True, rule_check="math")
    assert [r.checks["rule_reward"] for r in rollouts] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    # the judge passes every right response (0.8 > 0.5) and fails every wrong one: it and the rule disagree on
    # prompt 0's wrong response and on prompts 1 and 2's right ones
    assert rule_disagreements(rollouts) == {"reward/model_rule_checked": 6.0, "reward/model_rule_disagree": 3.0}
    counts = audit(1, rollouts, lambda ids: "x" * len(ids), tmp_path, num_samples=6)
    records = [json.loads(line) for line in (tmp_path / "step_00000001.jsonl").read_text().splitlines()]
    flagged = [r for r in records if "model_rule_disagree" in r["flags"]]
    assert counts["audit/model_rule_disagree"] == 3.0 and len(flagged) == 3
    assert all(r["checks"]["model_passes"] != (r["checks"]["rule_reward"] > 0) for r in flagged)


def test_task_config_of_model_rewards():
    with pytest.raises(ConfigError, match="task.reward_model.path=null"):
        TaskConfig(type="arithmetic", reward="reward_model")
    with pytest.raises(ConfigError, match="task.rule_check=math is invalid: it cross-checks"):
        TaskConfig(type="arithmetic", reward="math", rule_check="math")
    with pytest.raises(ConfigError, match="task.type=countdown allows"):
        TaskConfig(type="countdown", reward="judge")


# -- config-time checks of a reward model's checkpoint --------------------------------------------------------

@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    from tests.distributed.test_reward_model import save_reward_model

    return save_reward_model(tmp_path_factory.mktemp("rm"), "qwen2")


def _validate(tmp_path, rm_path, *more):
    from megatron_rl.config.loader import load_config

    return load_config(["model=tiny_qwen2", "task=arithmetic", "task.reward=reward_model",
                        f"task.reward_model.path={rm_path}", f"run_dir={tmp_path / 'run'}", *more], world_size=1)


def test_a_reward_model_checkpoint_is_checked_before_any_work(tmp_path, reward_model):
    cfg = _validate(tmp_path, reward_model)
    assert cfg.task.reward_model.path == str(reward_model)
    with pytest.raises(ConfigError, match="does not exist"):
        _validate(tmp_path, tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        _validate(tmp_path, reward_model, "algorithm.dynamic_sampling=true")


def test_a_causal_lm_is_no_reward_model(tmp_path):
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.hf import build_hf_model

    build_hf_model(ModelConfig(num_layers=1), seed=0).save_pretrained(tmp_path / "lm")
    load_tokenizer("builtin:char").save_pretrained(tmp_path / "lm")
    with pytest.raises(ConfigError, match=r"Qwen2ForCausalLM.*no \*ForSequenceClassification"):
        _validate(tmp_path, tmp_path / "lm")


def test_a_classifier_with_two_labels_is_refused(tmp_path, reward_model):
    shutil.copytree(reward_model, tmp_path / "two")
    config = json.loads((tmp_path / "two" / "config.json").read_text())
    config["id2label"] = {"0": "bad", "1": "good"}
    (tmp_path / "two" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="num_labels=2"):
        _validate(tmp_path, tmp_path / "two")


def test_a_reward_model_with_another_tokenizer_is_refused(tmp_path, reward_model):
    shutil.copytree(reward_model, tmp_path / "other")
    data = json.loads((tmp_path / "other" / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two letters swapped: same size, other ids
    (tmp_path / "other" / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"tokenizer differs from model.tokenizer=builtin:char.*'a' is id"):
        _validate(tmp_path, tmp_path / "other")
    (tmp_path / "other" / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="holds no tokenizer.json"):
        _validate(tmp_path, tmp_path / "other")
