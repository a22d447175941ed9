"""The configuration reference (docs/config-reference.md), generated from the schema: every key, its type, its
default and the docstring written under its field. `python -m megatron_rl.config.reference` prints it;
tests/unit/test_config_reference.py fails when the page and the schema differ.

Written by hand: attribute docstrings are not kept at run time (Python drops them), so they are read from each
dataclass's source with `ast`; no documentation tool reads dataclass fields into a key table.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any, Iterator

from megatron_rl.checks import format_value

HEADER = """# Configuration reference

Every key of the run configuration, generated from the schema (`megatron_rl/config/`) by
`python -m megatron_rl.config.reference`; do not edit by hand. Defaults are the base config's, a
pretrained model's; the tiny models built from config take `conf/preset/tiny.yaml` over them and the
model configs (`conf/model/*.yaml`) their architecture ([configuration.md](configuration.md)).
"""


def field_docs(cls: type) -> dict[str, str]:
    """field name -> the docstring under its definition in `cls`'s source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return f"optional {' or '.join(_type_name(a) for a in rest)}"
    if origin in (list, tuple):
        return f"list[{_type_name(args[0])}]" if args else "list"
    if origin is dict:
        return f"dict[{_type_name(args[0])}, {_type_name(args[1])}]"
    return getattr(hint, "__name__", str(hint))


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if isinstance(value, str) and value == "???":
        return "required"
    if isinstance(value, (list, tuple, dict)):
        return repr(value) if value else "[]" if not isinstance(value, dict) else "{}"
    return format_value(value)


def rows(cls: type, prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    """(key, type, default, doc) of every leaf key under `cls`, nested groups expanded."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for field in dataclasses.fields(cls):
        hint, key = hints[field.name], prefix + field.name
        if dataclasses.is_dataclass(hint):
            yield from rows(hint, key + ".")
            continue
        yield key, _type_name(hint), _default(field), docs.get(field.name, "")
        args = typing.get_args(hint)
        if typing.get_origin(hint) is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
            yield from rows(args[1], key + ".<name>.")


def render() -> str:
    from megatron_rl.config.schema import TrainConfig

    out = [HEADER]
    sections: dict[str, list[tuple[str, str, str, str]]] = {}
    for row in rows(TrainConfig):
        group = row[0].split(".")[0] if "." in row[0] else "top level"
        sections.setdefault(group, []).append(row)
    for group, items in sections.items():
        out += [f"\n## {group}\n", "| key | type | default | meaning |", "|---|---|---|---|"]
        for key, type_name, default, doc in items:
            cell = doc.replace("|", "\\|")
            out.append(f"| `{key}` | {type_name} | `{default}` | {cell} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
