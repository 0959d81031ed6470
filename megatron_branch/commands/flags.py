"""Command-line flags generated from config dataclasses: one spelling per setting.

A flag's name, type, choices, default and help come from the dataclass field it sets (its annotation, its default,
its docstring: the same field the train config reads and docs/training.md documents), so a field added to
ObjectiveConfig, ScheduleConfig, ParallelLayout or MoEConfig is a flag of every command built this way, and a
default or a choice is written once. What a command spells differently is said per field:

    add_fields(group, ObjectiveConfig, flags={"policy_loss": "--objective"}, aliases={"dpo_beta": ["--beta"]})
    cfg = read_fields(args, ObjectiveConfig)

    flag     `--` + prefix + the field name with `-` for `_` (`--clip-ratio-low`, `--moe-z-loss-coeff`), unless
             `flags` renames it; `aliases` are further spellings of the same flag (the older ones keep working)
    dest     prefix + field name (`args.clip_ratio_low`), unless `dests` renames it
    type     bool: a switch (store_true); Literal[...]: its choices; int / float / str (optional or not): that
             type, unless `types_` gives a parser (`_positive_int`); `choices` narrows a Literal; a field of
             another type (a list, a section) or without a plain default has no flag (its default applies)
    default  the field's default, unless `defaults` says what this command's contract fixes
    help     the field's docstring
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from megatron_branch.train.reference import field_docs


def _positive_int(text: str) -> int:  # (argparse names it in its error: "invalid _positive_int value")
    """An argparse type: a positive integer (argparse's one-line error otherwise)."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_int_or_off(text: str) -> int | None:
    """An argparse type: a positive integer, or 0 for off (None: what `null` says in a config)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 0 (off), got {text}")
    return value or None


def _positive_float(text: str) -> float:
    """An argparse type: a positive number (argparse's one-line error otherwise)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _number_or_text(text: str) -> float | str:
    """An argparse type for a field that takes a number or a string (verl's rollout_rs_threshold): the number when
    the text is one ("0.5_2" stays text: Python's float() would read its "_" as a digit separator)."""
    if "_" in text:
        return text
    try:
        return float(text)
    except ValueError:
        return text


def _base(tp: Any) -> Any:
    """`X | None` -> X; anything else as it is."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _kind(
    tp: Any, default: Any, parser: Callable[[str], Any] | None, choices: Sequence[Any] | None
) -> dict[str, Any] | None:
    """argparse keywords for a field type; None for a type no single flag spells (a list, a mapping, a section)."""
    base = _base(tp)
    if base is bool:  # a switch; one that defaults on also gets its --no- form
        return {"action": "store_true" if default is False else argparse.BooleanOptionalAction}
    if typing.get_origin(base) is typing.Literal:
        return {"choices": list(choices or typing.get_args(base))}
    if (
        base not in (int, float, str) and parser is None
    ):  # a union other than `X | None` needs the caller's parser
        return None
    out: dict[str, Any] = {"type": parser or base}
    if choices is not None:
        out["choices"] = list(choices)
    return out


def flag_of(name: str, prefix: str = "", flags: Mapping[str, str] | None = None) -> str:
    """The flag of field `name` (see the module doc)."""
    return (flags or {}).get(name) or "--" + (prefix + name).replace("_", "-")


def dest_of(name: str, prefix: str = "", dests: Mapping[str, str] | None = None) -> str:
    return (dests or {}).get(name) or (prefix + name).replace("-", "_")


def add_fields(
    group: Any,
    cls: type,
    *,
    prefix: str = "",
    skip: Iterable[str] = (),
    flags: Mapping[str, str] | None = None,
    dests: Mapping[str, str] | None = None,
    aliases: Mapping[str, Sequence[str]] | None = None,
    defaults: Mapping[str, Any] | None = None,
    types_: Mapping[str, Callable[[str], Any]] | None = None,
    choices: Mapping[str, Sequence[Any]] | None = None,
    notes: Mapping[str, str] | None = None,
) -> None:
    """Add a flag to `group` (a parser or argument group) for every field of dataclass `cls` but `skip`
    (see the module doc); `notes` adds this command's words to a field's help."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    defaults, types_, choices, notes = defaults or {}, types_ or {}, choices or {}, notes or {}
    for f in dataclasses.fields(cls):
        if f.name in set(skip) or not f.init:
            continue
        default = defaults.get(f.name, f.default)
        if default is dataclasses.MISSING:  # a required field (or a default_factory): not a flag
            continue
        text = " ".join(x for x in (docs.get(f.name, ""), notes.get(f.name, "")) if x).replace("%", "%%")
        kind = _kind(hints[f.name], default, types_.get(f.name), choices.get(f.name))
        if kind is None:  # the dataclass default applies (the config file can set it)
            continue
        if "action" not in kind:
            text += " (default: %(default)s)"
        group.add_argument(
            flag_of(f.name, prefix, flags), *(aliases or {}).get(f.name, ()),
            dest=dest_of(f.name, prefix, dests), default=default, help=text, **kind,
        )  # fmt: skip


def read_fields(
    args: argparse.Namespace,
    cls: type,
    *,
    prefix: str = "",
    dests: Mapping[str, str] | None = None,
    **fixed: Any,
) -> dict[str, Any]:
    """The keyword arguments of `cls` that the flags added by add_fields hold (`fixed` wins)."""
    kw = {
        f.name: getattr(args, dest_of(f.name, prefix, dests))
        for f in dataclasses.fields(cls)
        if hasattr(args, dest_of(f.name, prefix, dests))
    }
    kw.update(fixed)
    return kw
