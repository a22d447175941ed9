"""`python -m megatron_rl.eval --regression [SET=]SPEC`, repeated: how each regression set is
named and what is refused before any work (`evaluation.runner.regression_sets`)."""

from __future__ import annotations

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.evaluation.runner import regression_sets


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("aime.jsonl", "gsm8k.test.parquet"):
        (tmp_path / name).write_text("")
    return tmp_path


def test_one_set_without_a_name_is_called_regression(files):
    assert regression_sets(["aime.jsonl"]) == (("regression", "aime.jsonl"),)
    assert regression_sets(["task=arithmetic,num_eval=3"]) == (("regression", "task=arithmetic,num_eval=3"),)
    assert regression_sets([]) == ()


def test_several_sets_are_named_by_name_task_or_file(files):
    given = ["aime.jsonl", str(files / "gsm8k.test.parquet"), "task=arithmetic,num_eval=3", "hard=task=arithmetic,seed=9"]
    assert regression_sets(given) == (("aime", "aime.jsonl"), ("gsm8k", str(files / "gsm8k.test.parquet")),
                                      ("arithmetic", "task=arithmetic,num_eval=3"), ("hard", "task=arithmetic,seed=9"))
    assert regression_sets(["old=aime.jsonl"]) == (("old", "aime.jsonl"),)  # a name for one set too


@pytest.mark.parametrize("given, message", [
    (["task=arithmetic", "task=arithmetic,seed=4"], "two sets would be called 'arithmetic'"),
    (["aime.jsonl", "x=aime.jsonl", "x=task=arithmetic"], "two sets would be called 'x'"),
    (["heldout=aime.jsonl"], "'heldout'"),
    (["missing.jsonl"], "--regression missing.jsonl: no such file"),
    (["x=missing.jsonl"], "--regression x=missing.jsonl: no such file"),
    (["task=arithmetic,num_eval"], "'num_eval' is not key=value"),
])
def test_clashing_names_and_missing_sets_are_refused(files, given, message):
    with pytest.raises(ConfigError, match=message):
        regression_sets(given)
