"""The config reference in docs/training.md, generated from the config dataclasses' field docstrings.

    python -m megatron_branch.train.reference --write     # regenerate docs/training.md's "## Config reference"

A field's docstring is the string literal right after it in the class body (the PEP 257 "attribute docstring"
convention megatron-core's configs use); `ast` reads it, since Python keeps none at run time. The test
(tests/unit/test_train_config.py) asserts the docs equal this output, so a new field without a row fails.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

from megatron_branch.train.config import ArchConfig, MultiTurnConfig, TrainConfig

HEADING = "## Config reference"
INTRO = (
    "Generated from the dataclasses' docstrings (`megatron_branch/train/config.py`, by\n"
    "`python -m megatron_branch.train.reference --write`); `tests/unit/test_train_config.py` checks that this\n"
    "section equals its output."
)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "training.md"


def field_docs(cls: type) -> dict[str, str]:
    """{field: docstring} over `cls` and its dataclass bases (a subclass's docstring wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body  # type: ignore[attr-defined]
        for stmt, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def type_name(tp: Any) -> str:
    """A YAML reader's name for a field type: int, str, 'a' | 'b', a mapping, ... | null."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin in (dict,):
        return "a mapping"
    if origin in (list, tuple):
        return "a list"
    return getattr(tp, "__name__", str(tp))


def default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        return "its section below" if dataclasses.is_dataclass(value) else repr(value)
    return "required"


def table(prefix: str, cls: type) -> list[str]:
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        cell = docs.get(f.name, "").replace("|", "\\|")
        kind = type_name(hints[f.name]).replace("|", "\\|")
        rows.append(f"| `{prefix}.{f.name}` | {kind} | `{default_text(f)}` | {cell} |")
    return rows


def first_sentence(cls: type) -> str:
    return " ".join((cls.__doc__ or "").split()).split(". ")[0].rstrip(".") + "."


def reference() -> str:
    """The whole "## Config reference" section (heading to end of file)."""
    hints = typing.get_type_hints(TrainConfig)
    out = [HEADING, "", INTRO, ""]
    for f in dataclasses.fields(TrainConfig):
        section = hints[f.name]
        out += [f"### `{f.name}`: {first_sentence(section)}", "", *table(f.name, section), ""]
    mt = "rollout.multi_turn"
    out += [f"### `{mt}`: {first_sentence(MultiTurnConfig)}", "", *table(mt, MultiTurnConfig), ""]
    out += [f"### `model.arch`: {first_sentence(ArchConfig)}", "", *table("model.arch", ArchConfig)]
    return "\n".join(out) + "\n"


def with_reference(text: str) -> str:
    """`text` (docs/training.md) with its config reference section replaced by a fresh one."""
    head, sep, _ = text.partition(HEADING)
    assert sep, f"{DOCS} has no {HEADING!r} section"
    return head + reference()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--write", action="store_true", help=f"rewrite {DOCS.name} in place (else print the section)"
    )
    args = p.parse_args()
    if args.write:
        DOCS.write_text(with_reference(DOCS.read_text()))
    else:
        print(reference(), end="")


if __name__ == "__main__":
    main()
