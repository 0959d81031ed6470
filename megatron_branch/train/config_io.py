"""The training config as data: YAML file + dotted overrides -> TrainConfig (one-line errors naming the key), and
back (the run folder's resolved config.yaml).

    cfg = load_config("CONFIG.yaml", ["rollout.n=8", "optim.lr=1e-5"])
    write_resolved(cfg, out / "config.yaml")

Every value is converted to its field's type here (`_convert`: ints where floats are meant, YAML lists for tuples,
Literal choices with the closest name on a typo); the rules between fields run when TrainConfig is built
(validate.py), and an error is blamed on the override that set one of the keys it names, else on the file.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

from megatron_branch.errors import SettingError, UserError
from megatron_branch.train.config import TrainConfig
from megatron_branch.train.validate import SPELLING


def _yaml(text: str) -> Any:
    """yaml.safe_load with YAML 1.2's numbers: no underscores inside them, so "0.5_2" (verl's lower_upper
    rollout_rs_threshold) stays that string instead of YAML 1.1's float 0.52. (yaml is imported here, not at the
    top: the CLI's start-up stays light.)"""
    import yaml

    class Loader(yaml.SafeLoader):
        yaml_implicit_resolvers = {
            first: [
                (
                    tag,
                    re.compile(rx.pattern.replace("_]", "]"), rx.flags)
                    if tag.endswith((":int", ":float"))
                    else rx,
                )
                for tag, rx in resolvers
            ]
            for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
        }

    return yaml.load(text, Loader=Loader)  # noqa: S506 (a SafeLoader)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin is not None:
        return getattr(origin, "__name__", str(tp))
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    """`value` as type `tp` or a UserError naming `key`. ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        if (
            len(arms) == 1
        ):  # `X | None` given a value: X's own error ("model.arch.family must be one of ..."),
            return _convert(value, arms[0], key)  # not "must be a mapping | null"
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, key)
            except UserError:
                continue
        raise UserError(f"{key} must be {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            close = difflib.get_close_matches(str(value), [str(a) for a in typing.get_args(tp)], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UserError(f"{key} must be one of {_type_name(tp)}, got {value!r}{hint}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise UserError(f"{key} must be a mapping of its fields, got {value!r}")
        return from_dict(tp, value, prefix=key + ".")
    if origin is list:
        if not isinstance(value, list):
            raise UserError(f"{key} must be a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_convert(v, item, f"{key}[{j}]") for j, v in enumerate(value)]
    if origin is tuple:  # a shared type's field (ModelArch's, say): a YAML list
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{key} must be a list, got {value!r}")
        args = typing.get_args(tp)
        items = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(items) != len(value):
            raise UserError(f"{key} must be a list of {len(items)}, got {value!r}")
        return tuple(_convert(v, a, f"{key}[{j}]") for j, (v, a) in enumerate(zip(value, items)))
    if origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise UserError(f"{key} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{key} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise UserError(f"{key} must be a string, got {value!r}")
        return value
    raise AssertionError(f"unhandled config type {tp} at {key}")


def from_dict(cls: Any, raw: dict[str, Any], *, prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested dict; unknown keys are refused with the closest known name."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise UserError(f"unknown config key {prefix}{key}{hint}")
        kwargs[key] = _convert(value, hints[key], prefix + key)
    try:
        return cls(**kwargs)
    except (
        SettingError
    ) as e:  # a rule of a shared type (layout, objective, estimators), in the config's names
        raise e.spelled(SPELLING) from None
    except (TypeError, ValueError) as e:
        if isinstance(e, UserError):
            raise
        raise UserError(f"{prefix.rstrip('.') or 'config'}: {e}") from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain data (what config.yaml in the run folder holds; tuples as lists, as YAML)."""

    def plain(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    return plain(dataclasses.asdict(cfg))


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value parsed as YAML: `8` is an int, `1e-5` a float, `null` None)."""
    import yaml

    if "=" not in text:
        raise UserError(f"override {text!r} must look like section.key=value")
    key, _, value = text.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise UserError(f"override {text!r}: empty key part")
    try:
        parsed = _yaml(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    # YAML 1.1 reads `1e-5` as a string (it wants `1.0e-5`): accept what a user means.
    if isinstance(parsed, str):
        try:
            # (not "0.5_2": Python's float() reads underscores as digit separators; verl reads a bound pair)
            parsed = float(parsed) if any(c in parsed for c in ".eE") and "_" not in parsed else parsed
        except ValueError:
            pass
    return parts, parsed


def _set_path(raw: dict[str, Any], parts: list[str], value: Any, text: str) -> None:
    node = raw
    for p in parts[:-1]:
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise UserError(f"override {text!r}: {p} is not a section")
        node = child
    node[parts[-1]] = value


def _fix_yaml_floats(node: Any) -> Any:
    """YAML 1.1 (pyyaml) reads `1e-5` as a string; numbers written that way are meant as floats."""
    if isinstance(node, dict):
        return {k: _fix_yaml_floats(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_fix_yaml_floats(v) for v in node]
    if isinstance(node, str):
        try:
            return float(node) if any(c in node for c in "eE") and node[0] in "0123456789.-+" else node
        except ValueError:
            return node
    return node


VERL_KEYS = {("actor", "policy_loss", "loss_mode"): ("actor", "policy_loss")}
"""verl's spellings of a key, accepted as aliases: verl nests the loss mode (`actor.policy_loss.loss_mode`)."""


def _verl_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with each verl-spelled key (VERL_KEYS) moved to the config's own key."""
    for (*section, leaf), (*target, name) in VERL_KEYS.items():
        node: Any = raw
        for p in section:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict):
            extra = sorted(set(node) - {leaf})
            if extra:
                raise UserError(f"unknown config key {'.'.join(section)}.{extra[0]} (only {leaf} is read)")
            parent: Any = raw
            for p in target:
                parent = parent[p]
            parent[name] = node[leaf]
    return raw


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:  # type: ignore[assignment]
    """Read the YAML file (None = all defaults), apply dotted overrides, build and validate the config."""
    import yaml

    raw: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise UserError(f"cannot read config: {e.strerror or e}", where=str(path)) from None
        try:
            loaded = _yaml(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise UserError(f"invalid YAML ({problem})", where=f"{path}{line}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise UserError("the config must be a mapping of sections", where=str(path))
        raw = _fix_yaml_floats(loaded or {})
    keys = []
    for text in overrides:
        parts, value = parse_override(text)
        parts = list(VERL_KEYS.get(tuple(parts), parts))
        try:
            _check_override(parts, value)
        except UserError as e:
            raise UserError(str(e), where=f"override {text!r}") from None
        _set_path(raw, parts, value, text)
        keys.append((".".join(parts), text))
    try:
        return from_dict(TrainConfig, _verl_keys(raw))
    except UserError as e:
        # a rule between fields: blamed on the override that set one of them, else on the file
        blamed = [t for k, t in keys if _names_key(str(e), k)]
        where = f"override {blamed[-1]!r}" if blamed else (f"{path}" if path is not None else "config")
        raise UserError(str(e), where=where) from None


def _names_key(message: str, key: str) -> bool:
    """Whether an error `message` is about config key `key` ("a.b.c"): it names the key, its section and field
    ("a.b: c must be ..."), or its section's wildcard ("a.* need ...")."""

    def word(w: str) -> str:
        return rf"(?<![\w.]){re.escape(w)}(?![\w])"

    if re.search(word(key), message):
        return True
    parts = key.split(".")
    for j in range(1, len(parts)):
        section, rest = ".".join(parts[:j]), ".".join(parts[j:])
        if re.search(word(section) + r"\.\*", message):
            return True
        if re.search(word(section) + ":", message) and re.search(
            rf"(?<![\w.]){re.escape(rest)}(?![\w])", message
        ):
            return True
    return False


def _check_override(parts: list[str], value: Any) -> None:
    """One override on its own: its key exists and its value has the field's type (so a mistake in it is blamed
    on it, not on the YAML file)."""
    cls: Any = TrainConfig
    for j, name in enumerate(parts):
        key = ".".join(parts[: j + 1])
        names = [f.name for f in dataclasses.fields(cls)]
        if name not in names:
            prefix = ".".join(parts[:j])
            close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
            hint = f" (did you mean {prefix + '.' if prefix else ''}{close[0]}?)" if close else ""
            raise UserError(f"unknown config key {key}{hint}")
        tp = typing.get_type_hints(cls)[name]
        if j == len(parts) - 1:
            _convert(value, tp, key)
            return
        inner = [a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
        if not inner:
            raise UserError(f"{key} is not a section")
        cls = inner[0]


def resolved_yaml(cfg: TrainConfig) -> str:
    """The whole config, every default filled in, as YAML that `load_config` reads back (`train --print-config`,
    OUT/config.yaml)."""
    import yaml

    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def write_resolved(cfg: TrainConfig, path: Path) -> None:
    """OUT/config.yaml, replaced whole (a resume rewrites it: a crash keeps the previous one)."""
    from megatron_branch.outputs import write_text

    write_text(path, resolved_yaml(cfg), overwrite=True, what="resolved config")
