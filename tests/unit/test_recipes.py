"""The recipes (conf/experiment/) resolve as they stand, with the paths a user gives, and fit the ranks their
header names; the example data in docs/examples/ reads as the recipes say."""

from __future__ import annotations

import json
import re

import pytest

from megatron_rl.config import CONF_DIR, ConfigError, compose, to_typed
from megatron_rl.config.checks.layout import check_layout
from megatron_rl.config.checks.model import check_model

EXAMPLES = CONF_DIR.parent / "docs" / "examples"
GPU_RECIPES = ["qwen2_5_7b_math", "qwen3_8b_code", "qwen3_30b_a3b_math"]


def _sbatch_overrides(text: str) -> list[str]:
    """The Hydra overrides of the recipe's `sbatch ...` line (its header comment, `\\` continuations joined)."""
    header = "\n".join(line[1:].strip() for line in text.splitlines() if line.startswith("#"))
    line = re.search(r"sbatch (.*?)(?:\n[^\n]*Never run)", header.replace("\\\n", " "), re.S).group(1)
    words = line.split()
    given = words[words.index(next(w for w in words if w.startswith("+experiment="))) + 1:]
    assert {"model.path", "task.path"} <= {w.split("=")[0] for w in given}, line
    return given


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_a_gpu_recipe_resolves_and_fits_the_ranks_it_names(name):
    text = (CONF_DIR / "experiment" / f"{name}.yaml").read_text()
    assert "Never run on a GPU" in text  # what it was tested on, said in the file
    ranks = int(re.search(r"passes the layout checks for (\d+) ranks", text).group(1))
    cfg = to_typed(compose([f"+experiment={name}", *_sbatch_overrides(text), "cluster=slurm"]))  # as submitted
    check_layout(cfg, ranks)
    check_model(cfg)
    assert cfg.rollout.backend == "sglang" and cfg.optimizer.lr <= 1e-6
    assert cfg.rollout.max_new_tokens + 1024 <= cfg.micro_batch_tokens
    nodes = re.search(r"--nodes=(\d+) --gpus-per-node=(\d+)", text)
    if nodes:  # the sbatch line's GPUs are the ranks checked
        assert int(nodes.group(1)) * int(nodes.group(2)) == ranks
    for key in {w.split("=")[0] for w in _sbatch_overrides(text)} - {"model.path"}:
        # the data (and the image) are the user's: nothing is made up for them
        rest = [w for w in _sbatch_overrides(text) if not w.startswith(key + "=")]
        with pytest.raises(ConfigError, match=f"{key}=.*(required|invalid)"):
            to_typed(compose([f"+experiment={name}", *rest]))


def test_the_math_example_reads_as_the_math_recipes_say(tmp_path):
    from megatron_rl.data.tasks import Task
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.rewards.rule import math_reward

    cfg = to_typed(compose(["+experiment=qwen2_5_7b_math", "model.path=/ckpt/x", f"task.path={EXAMPLES / 'math.jsonl'}",
                            "task.num_eval=2", "task.chat_template=false"]))
    task = Task(cfg.task, load_tokenizer("builtin:char"))
    prompts = task.prompts("train")
    rows = [json.loads(line) for line in (EXAMPLES / "math.jsonl").read_text().splitlines()]
    assert len(rows) == 10 and len(prompts) == 8
    for row in rows:
        assert "\\boxed{}" in row["question"]
        assert math_reward(f"So the answer is \\boxed{{{row['answer']}}}.", row["answer"]) == 1.0


def test_the_code_example_has_tests_and_a_fenced_reference():
    from megatron_rl.rewards.sandboxed import response_code

    rows = [json.loads(line) for line in (EXAMPLES / "code.jsonl").read_text().splitlines()]
    assert len(rows) == 10
    for row in rows:
        assert row["tests"] and all(t["argv"][0] == "python3" for t in row["tests"])
        assert response_code(row["response"]).startswith("def ")
    assert "From: python:3.11" in (EXAMPLES / "python.def").read_text()
