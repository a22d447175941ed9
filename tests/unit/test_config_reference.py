"""docs/config-reference.md is the schema's: every key, default and meaning, regenerated from the dataclasses."""

from __future__ import annotations

import dataclasses

from megatron_rl.config import CONF_DIR
from megatron_rl.config.reference import render, rows
from megatron_rl.config.schema import TrainConfig

PAGE = CONF_DIR.parent / "docs" / "config-reference.md"


def test_the_page_is_the_schemas():
    assert PAGE.read_text() == render(), "regenerate: python -m megatron_rl.config.reference > docs/config-reference.md"


def test_every_key_has_a_meaning_and_every_group_is_listed():
    table = list(rows(TrainConfig))
    undocumented = [key for key, _, _, doc in table if not doc]
    assert undocumented == []
    keys = {key for key, *_ in table}
    for group in (f.name for f in dataclasses.fields(TrainConfig)):
        assert group in keys or any(k.startswith(group + ".") for k in keys)
    assert {"optimizer.lr", "rollout.max_new_tokens", "task.chat_template", "domains.<name>.weight"} <= keys


def test_a_documented_default_is_the_value_a_run_gets():
    table = {key: default for key, _, default, _ in rows(TrainConfig)}
    assert float(table["optimizer.lr"]) == TrainConfig().optimizer.lr == 1e-6
    assert table["rollout.backend"] == "auto" and table["task.chat_template"] == "null"
