"""Prompt sources (JSONL, Parquet, saved Hugging Face datasets), the train / held-out split,
chat templates and the per-task choice of verifier."""

from __future__ import annotations

import asyncio
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.config import TaskConfig
from megatron_rl.data.sources import detect_format, first_row, load_rows
from megatron_rl.data.tasks import RuleVerifier, Task, end_of_turn, needs_sandbox_of, reward_kind_of
from megatron_rl.data.tokenizer import load_tokenizer

ROWS = [{"prompt": f"What is {i} + 1?", "answer": i + 1} for i in range(10)]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin:char")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_parquet_and_saved_dataset_give_the_same_rows(tmp_path):
    import datasets

    jsonl = _jsonl(tmp_path / "p.jsonl", ROWS)
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(saved))
    assert [detect_format(p) for p in (jsonl, parquet, saved)] == ["jsonl", "parquet", "hf_disk"]
    for source in (jsonl, parquet, saved):
        assert load_rows(source, "eval", num_eval=3) == ROWS[:3], source
        assert load_rows(source, "train", num_eval=3) == ROWS[3:], source


def test_first_row_reads_one_row_of_every_format(tmp_path):
    import datasets

    jsonl = _jsonl(tmp_path / "p.jsonl", ROWS)
    (tmp_path / "blank_first.jsonl").write_text("\n" + json.dumps(ROWS[0]) + "\n")
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    saved = tmp_path / "dd"
    datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS[5:]),
                          "train": datasets.Dataset.from_list(ROWS[:5])}).save_to_disk(str(saved))
    for source in (jsonl, tmp_path / "blank_first.jsonl", parquet, saved):  # a DatasetDict: its train split's
        assert first_row(source) == ROWS[0], source
    assert first_row(_jsonl(tmp_path / "empty.jsonl", [])) is None
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not a JSON object"):
        first_row(tmp_path / "bad.jsonl")


def test_the_checks_and_the_task_agree_on_the_verifier(tmp_path, tokenizer):
    """reward_kind_of / needs_sandbox_of decide for the config checks and the Slurm batch step (no tokenizer, one
    row read) what the Task that trains uses."""
    tests = [{"prompt": "write f", "tests": [{"name": "t", "argv": ["python3", "-c", "1"]}]}] * 3
    cases = {"rows": (ROWS, "auto", "math", False), "tests": (tests, "auto", "tests", True),
             "exact": (ROWS, "exact", "exact", False)}
    for name, (rows, reward, kind, sandbox) in cases.items():
        path = str(_jsonl(tmp_path / f"{name}.jsonl", rows))
        cfg = TaskConfig(chat_template=False, name=name, type="dataset", path=path, num_eval=1, reward=reward)
        task = Task(cfg, tokenizer)
        assert (reward_kind_of(cfg), needs_sandbox_of(cfg)) == (task.reward_kind, task.needs_sandbox) == (kind, sandbox)
    assert needs_sandbox_of(TaskConfig(type="countdown")) and not needs_sandbox_of(TaskConfig(type="arithmetic"))
    assert not needs_sandbox_of(TaskConfig(type="agent", environment="countdown", generator="countdown"))
    assert needs_sandbox_of(TaskConfig(type="agent", environment="repo"))


def test_every_row_by_default_and_a_cap_is_said(tmp_path, tokenizer, caplog):
    path = str(_jsonl(tmp_path / "rows.jsonl", ROWS))
    every = Task(TaskConfig(chat_template=False, type="dataset", path=path, num_eval=2, num_train=None), tokenizer)
    assert len(every.prompts("train")) == len(ROWS) - 2
    capped = Task(TaskConfig(chat_template=False, name="m", type="dataset", path=path, num_eval=2, num_train=5),
                  tokenizer)
    assert len(capped.prompts("train")) == 5
    assert "task m: 5 of 8 training rows are used (task.num_train=5; null: all)" in caplog.text


def test_dataset_dict_splits_and_a_separate_eval_file(tmp_path):
    import datasets

    saved = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:6]),
                          "test": datasets.Dataset.from_list(ROWS[6:])}).save_to_disk(str(saved))
    assert load_rows(saved, "train", num_eval=2) == ROWS[:6]
    assert load_rows(saved, "eval", num_eval=2) == ROWS[6:8]
    held_out = _jsonl(tmp_path / "eval.jsonl", ROWS[8:])
    assert load_rows(_jsonl(tmp_path / "train.jsonl", ROWS[:8]), "train", 5, eval_path=held_out) == ROWS[:8]
    assert load_rows(tmp_path / "train.jsonl", "eval", 5, eval_path=held_out) == ROWS[8:]


def test_unreadable_sources_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="cannot tell the format"):
        detect_format(tmp_path / "rows.csv")
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(ValueError, match="not a dataset saved with datasets' save_to_disk"):
        detect_format(tmp_path / "plain_dir")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": 1}\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON object"):
        load_rows(bad, "train", 0)


def _task(tmp_path, tokenizer, rows=ROWS, **overrides) -> Task:
    overrides.setdefault("chat_template", False)
    cfg = TaskConfig(name="t", type="dataset", path=str(_jsonl(tmp_path / "rows.jsonl", rows)), num_eval=2,
                     **overrides)
    return Task(cfg, tokenizer)


def test_a_null_chat_template_follows_the_tokenizer(tmp_path, tokenizer):
    """task.chat_template=null (the default): the template of a tokenizer that has one, plain text otherwise."""
    import copy

    templated = _task(tmp_path, tokenizer, chat_template=None)
    assert templated.prompts("eval")[0].text == "<|im_start|>user\nWhat is 0 + 1?<|im_end|>\n<|im_start|>assistant\n"
    assert templated.end_of_turn
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    plain = _task(tmp_path, bare, chat_template=None)
    assert plain.prompts("eval")[0].text == _task(tmp_path, tokenizer, chat_template=False).prompts("eval")[0].text
    assert plain.end_of_turn == ""
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        _task(tmp_path, bare, chat_template=True)


def test_chat_template_renders_the_user_turn_and_ends_responses(tmp_path, tokenizer):
    task = _task(tmp_path, tokenizer, chat_template=True, system_prompt="Be brief.")
    first = task.prompts("eval")[0]
    # The Qwen-style template of the shipped tokenizer, written out by hand.
    assert first.text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 0 + 1?<|im_end|>\n"
                          "<|im_start|>assistant\n")
    assert first.tokens == tokenizer(first.text, add_special_tokens=False)["input_ids"]
    assert first.reference == "\\boxed{1}<|im_end|>"
    assert end_of_turn(tokenizer) == "<|im_end|>"
    assert task.stop_token_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    plain = Task(TaskConfig(chat_template=False, name="t", type="dataset", path=str(tmp_path / "rows.jsonl"),
                            num_eval=2), tokenizer)
    assert plain.prompts("eval")[0].text == "What is 0 + 1?" and plain.stop_token_ids == ()


def test_chat_messages_as_prompts(tmp_path, tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "answer": "x"}] * 3
    task = _task(tmp_path, tokenizer, rows=rows, chat_template=True)
    assert task.prompts("train")[0].text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="needs task.chat_template=true"):
        _task(tmp_path, tokenizer, rows=rows).prompts("train")


def test_verifier_choice_per_task(tmp_path, tokenizer):
    assert _task(tmp_path, tokenizer).reward_kind == "math"
    assert not _task(tmp_path, tokenizer).needs_sandbox
    assert _task(tmp_path, tokenizer, reward="exact").reward_kind == "exact"
    tests = [{"prompt": "write f", "tests": [{"name": "t", "argv": ["python3", "-c", "1"]}]}] * 3
    coded = _task(tmp_path, tokenizer, rows=tests)
    assert coded.reward_kind == "tests" and coded.needs_sandbox
    assert coded.prompts("train")[0].meta == {"tests": tests[0]["tests"], "files": {}, "solution_path": "solution.py"}
    countdown = Task(TaskConfig(chat_template=False, num_train=4, num_eval=2), tokenizer)
    assert countdown.reward_kind == "countdown" and countdown.needs_sandbox


def test_rule_verifiers_math_and_exact():
    """Math reads answers strictly unless told otherwise, and counts how it read them."""
    items = [({"answer": "7"}, "so \\boxed{7}"), ({"answer": "7"}, "7"), ({"answer": "0.5"}, "\\boxed{1/2}"),
             ({"answer": "7"}, "3 + 4 = 7\n#### 7"), ({"answer": "7"}, "no idea")]
    strict = RuleVerifier("math")
    assert asyncio.run(strict.score(items)) == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert strict.answer_counts == {"answers": 5, "unformatted_answers": 2}
    lenient = RuleVerifier("math", last_number=True)
    assert asyncio.run(lenient.score(items)) == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert lenient.answer_counts == {"answers": 5, "unformatted_answers": 2, "last_number_answers": 1}
    assert asyncio.run(RuleVerifier("exact").score(items)) == [0.0, 1.0, 0.0, 0.0, 0.0]


def test_missing_columns_are_named(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"has no 'question' column \(task.prompt_key\)"):
        _task(tmp_path, tokenizer, prompt_key="question").prompts("train")
    with pytest.raises(ValueError, match=r"has no 'answer' column"):
        _task(tmp_path, tokenizer, rows=[{"prompt": "p"}] * 3).prompts("train")


def test_prompts_longer_than_the_limit_are_left_out(tmp_path, tokenizer, caplog):
    rows = [{"prompt": "x" * n, "answer": "1"} for n in (3, 9, 5, 12, 4, 7)]  # the char tokenizer: a token a char
    with caplog.at_level("WARNING"):
        train = _task(tmp_path, tokenizer, rows=rows, max_prompt_tokens=6).prompts("train")
    assert [len(p.tokens) for p in train] == [5, 4]  # rows 2.. (2 held out); 12 and 7 left out
    assert "2 of 4 train prompts are longer than task.max_prompt_tokens=6" in caplog.text
    with pytest.raises(ValueError, match=r"every train prompt is longer than task.max_prompt_tokens=3 \(the "
                                         r"shortest has 4 tokens\)"):
        _task(tmp_path, tokenizer, rows=rows, max_prompt_tokens=3).prompts("train")


def test_a_prompt_that_cannot_fit_a_micro_batch_with_its_response_is_refused_before_generation(tmp_path, tokenizer):
    import types

    from megatron_rl.rl.state import check_sample_budget

    rows = [{"prompt": "x" * n, "answer": "1"} for n in (3, 9, 5, 40)]
    prompts = _task(tmp_path, tokenizer, rows=rows).prompts("train")
    cfg = types.SimpleNamespace(rollout=types.SimpleNamespace(max_new_tokens=16), micro_batch_tokens=64,
                                model=types.SimpleNamespace(context_length=56))
    check_sample_budget(cfg, prompts)  # 40 + 16 <= 64, <= 56
    cfg.micro_batch_tokens = 50
    with pytest.raises(ValueError, match=r"longest training prompt has 40 tokens.*56 tokens, more than "
                                         r"micro_batch_tokens=50"):
        check_sample_budget(cfg, prompts)
    cfg.micro_batch_tokens, cfg.model.context_length = 64, 55  # fits a micro-batch, not the model
    with pytest.raises(ValueError, match=r"longest training prompt has 40 tokens.*56 tokens, more than "
                                         r"the model's context \(model.max_position_embeddings, or YaRN's "
                                         r"scaled one\)=55"):
        check_sample_budget(cfg, prompts)


def _solve(text: str) -> int:
    """The answer of a generated word problem, read from its sentences by rules of our own."""
    import re

    count = int(re.match(r"\w+ has (\d+) ", text).group(1))
    for verb, a, b in re.findall(r"(gets|loses|buys) (\d+)(?: more| boxes of (\d+))?", text):
        count += {"gets": int(a), "loses": -int(a), "buys": int(a) * int(b or 0)}[verb]
        assert count >= 0, text
    return count


@pytest.mark.parametrize("steps, answer_format", [(1, "boxed"), (3, "gsm8k")])
def test_generated_math_prompts_ask_a_question_and_state_the_answer_format(tokenizer, steps, answer_format):
    from megatron_rl.rewards.rule import math_reward

    task = Task(TaskConfig(chat_template=False, type="arithmetic", num_train=200, num_eval=50, math_steps=steps,
                           answer_format=answer_format),
                tokenizer)
    train, held_out = task.prompts("train"), task.prompts("eval")
    instruction = "Answer in \\boxed{}." if answer_format == "boxed" else "End with the answer as #### <number>."
    for p in train + held_out:
        question, rest = p.text.rsplit("?", 1)
        assert question.split(". ")[-1].startswith("How many ") and rest == f" {instruction}\n", p.text
        assert p.text.count("Then ") == (steps if steps > 1 else 0)
        assert str(_solve(p.text)) == p.meta["answer"]
        assert math_reward(p.reference, p.meta["answer"]) == 1.0  # the warm start's reference is in the format
        assert p.reference == (f"\\boxed{{{p.meta['answer']}}}" if answer_format == "boxed"
                               else f"#### {p.meta['answer']}")
    assert len({p.text for p in train}) > 100


def test_answer_settings_are_checked():
    for key, value in [("answer_extraction", "lenient"), ("answer_format", "latex"), ("math_steps", 0)]:
        with pytest.raises(ValueError, match=f"task.{key}"):
            TaskConfig(chat_template=False, type="arithmetic", **{key: value})


@pytest.mark.parametrize("answer, reward, why", [
    ("", "math", "is '', which states no answer"), (" $ ", "math", r"is ' \$ ', which states no answer"),
    ("", "exact", "is '', which states no answer"),
    (["7"], "math", "is list"), (float("nan"), "math", "is float nan")])
def test_a_reference_answer_that_no_response_can_state_is_refused_naming_the_row(tmp_path, tokenizer, answer, reward,
                                                                                 why):
    """An empty reference matched `\\boxed{$}` and `#### .` (reward 1 for stating nothing); a list's str()
    ("['7']") matched nothing; both used to load silently."""
    rows = [{"prompt": "p", "answer": "1"}] * 3 + [{"prompt": "q", "answer": answer}]
    with pytest.raises(ValueError, match=rf"train row 1\): its 'answer' \(task.answer_key\) {why}"):
        _task(tmp_path, tokenizer, rows=rows, reward=reward).prompts("train")
    assert [p.meta["answer"] for p in _task(tmp_path, tokenizer, rows=rows[:3] + [{"prompt": "q", "answer": 0}],
                                            reward=reward).prompts("train")] == ["1", "0"]


def test_a_prompt_of_another_type_is_named_as_such(tmp_path, tokenizer):
    rows = [{"prompt": "p", "answer": "1"}] * 2 + [{"prompt": 5, "answer": "1"}]
    with pytest.raises(ValueError, match=r"train row 0\): its 'prompt' \(task.prompt_key\) is int 5; a prompt is a "
                                         r"string or a list of chat messages"):
        _task(tmp_path, tokenizer, rows=rows).prompts("train")


def test_a_system_prompt_without_a_chat_template_is_refused(tokenizer):
    """Plain-text prompts have no system turn: task.system_prompt used to be dropped without a word."""
    import copy

    from megatron_rl.config import ConfigError

    with pytest.raises(ConfigError, match=r"task.system_prompt=Be terse. is invalid: .*task.chat_template=false"):
        TaskConfig(type="arithmetic", chat_template=False, system_prompt="Be terse.")
    plain = copy.copy(tokenizer)
    plain.chat_template = None  # task.chat_template=null follows the tokenizer: plain text here
    with pytest.raises(ValueError, match="task.system_prompt is set but task t's prompts are plain text"):
        Task(TaskConfig(name="t", type="arithmetic", system_prompt="Be terse."), plain)
    templated = Task(TaskConfig(name="t", type="arithmetic", system_prompt="Be terse."), tokenizer)
    assert templated.prompts("train")[0].text.startswith("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n")


def test_the_models_context_is_yarns_scaled_one_where_config_json_leaves_max_position_embeddings_short():
    """As vLLM and SGLang derive it: Qwen's YaRN recipe (rope_scaling factor 4 over 32768, max_position_embeddings
    left at 32768) runs 131072 tokens; DeepSeek-V3 states its scaled context (4096 x 40 = 163840) itself; Llama 3.1's
    llama3 scaling and an unscaled model keep max_position_embeddings."""
    from megatron_rl.config.model import ModelConfig

    qwen = ModelConfig(family="qwen2", max_position_embeddings=32768, rope_scaling_type="yarn",
                       rope_scaling_factor=4.0, rope_scaling_original_max_position_embeddings=32768)
    assert qwen.context_length == 131072
    llama = ModelConfig(family="llama", max_position_embeddings=131072, rope_scaling_factor=8.0,
                        rope_scaling_original_max_position_embeddings=8192)
    assert not llama.yarn and llama.context_length == 131072
    assert ModelConfig(max_position_embeddings=512).context_length == 512


def test_a_checkpoints_other_end_of_sequence_ids_end_responses_and_agent_turns(tmp_path, tokenizer):
    """generation_config.json may list more end ids than the tokenizer's eos (Llama-3.1-Instruct: <|end_of_text|>,
    <|eom_id|>, <|eot_id|>), which SGLang stops at: the task's and an agent turn's stop ids carry them (so the hf
    engine stops there too, and a turn ended by one counts as closed); here id 3 ("\\n") stands in for one."""
    from megatron_rl.data.special_tokens import end_of_sequence_ids
    from megatron_rl.rollout.multiturn import TurnFormat
    from megatron_rl.rollout.openai_server import OpenAIServer

    tokenizer.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 3]}))
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    reloaded = load_tokenizer(str(tmp_path / "ckpt"))
    assert reloaded.eos_token_id == 0 and end_of_sequence_ids(reloaded) == (0, 3)
    assert end_of_sequence_ids(tokenizer) == (0,)  # the shipped assets: the tokenizer's eos alone
    eot = 2  # <|im_end|>, the chat template's end of turn
    assert _task(tmp_path, reloaded, chat_template=True).stop_token_ids == (eot, 3)
    assert _task(tmp_path, reloaded, chat_template=False).stop_token_ids == (3,)
    assert _task(tmp_path, tokenizer, chat_template=True).stop_token_ids == (eot,)
    assert TurnFormat(reloaded, "s").stop_token_ids == (eot, 3)
    endpoint = OpenAIServer(reloaded).start()
    try:
        assert (endpoint.chat_stop_ids, endpoint.end_ids) == ((eot, 3), (3,))
    finally:
        endpoint.shutdown()
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 500]}))
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id \[0, 500\] is not a list of ids"):
        end_of_sequence_ids(load_tokenizer(str(tmp_path / "ckpt")))


def test_plain_text_prompts_start_with_the_bos_a_tokenizer_adds_of_its_own(tmp_path, tokenizer):
    """transformers' tokenizer(text) (and vLLM's completions) put a Llama-like tokenizer's BOS before a plain text;
    the project encodes rendered text without special tokens, so a plain-text prompt carries the BOS as text: its
    ids are tokenizer(text)'s, and every later encoding of Prompt.text (the warm start's) gets the same. Here the
    shipped tokenizer, given a post-processor that adds <|im_start|> (id 1) as its BOS."""
    import copy

    from tokenizers.processors import TemplateProcessing

    from megatron_rl.data.special_tokens import plain_text_prefix
    from megatron_rl.sft import prompt_response_sample

    bos_adding = copy.deepcopy(tokenizer)
    bos_adding.bos_token = "<|im_start|>"
    bos_adding.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", pair="<|im_start|> $A $B", special_tokens=[("<|im_start|>", 1)])
    expected = bos_adding("What is 0 + 1?")["input_ids"]
    assert expected[0] == 1 and expected[1:] == tokenizer("What is 0 + 1?", add_special_tokens=False)["input_ids"]
    assert (plain_text_prefix(bos_adding), plain_text_prefix(tokenizer)) == ("<|im_start|>", "")
    prompt = _task(tmp_path, bos_adding, chat_template=False).prompts("eval")[0]
    assert prompt.tokens == expected and prompt.text == "<|im_start|>What is 0 + 1?"
    sample = prompt_response_sample(bos_adding, prompt.text, "1")
    assert sample.tokens.tolist()[:len(expected)] == expected
    assert _task(tmp_path, tokenizer, chat_template=False).prompts("eval")[0].tokens == expected[1:]


def test_a_judge_template_that_shows_the_reference_needs_every_rows_answer(tmp_path, tokenizer):
    """A custom judge template with {reference} would grade a row without an answer against ''; refused naming the
    row. Without {reference} in the template such rows are fine."""
    from megatron_rl.config.task import JudgeConfig

    rows = [{"prompt": "What is 1 + 1?", "answer": 2}, {"prompt": "Write a poem."}]

    def task(template: str) -> Task:
        cfg = TaskConfig(name="t", type="dataset", path=str(_jsonl(tmp_path / "rows.jsonl", rows)), num_eval=0,
                         chat_template=False, reward="judge", judge=JudgeConfig(template=template))
        return Task(cfg, tokenizer)

    with pytest.raises(ValueError, match=r"train row 1\) has no 'answer' column .*shows the judge as \{reference\}"):
        task("Q: {prompt}\nA: {response}\nGold: {reference}\nscore:").prompts("train")
    assert len(task("Q: {prompt}\nA: {response}\nscore:").prompts("train")) == 2


def test_a_row_with_its_own_system_message_and_task_system_prompt_is_refused(tmp_path, tokenizer):
    rows = [{"prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "1 + 1?"}],
             "answer": 2}] * 3
    with pytest.raises(ValueError, match=r"system message of its own and task.system_prompt is set"):
        _task(tmp_path, tokenizer, rows=rows, chat_template=True, system_prompt="Think.").prompts("train")
    [prompt] = _task(tmp_path, tokenizer, rows=rows, chat_template=True).prompts("train")
    assert prompt.text.count("<|im_start|>system") == 1
