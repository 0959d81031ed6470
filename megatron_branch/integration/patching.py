"""`with megatron_branch.patched(): ...`: branch replay for a megatron-core script that cannot be edited.

Inside the block
  * `gpt_layer_specs.get_gpt_layer_local_spec` and `get_gpt_layer_with_transformer_engine_spec` return specs with
    `BranchCoreAttention` in the core-attention slot (integration/spec.py);
  * every `GPTModel` built follows its forward's position ids in RoPE (models/rotary.py);
  * `megatron.core.pipeline_parallel.get_forward_backward_func` (and the one in `schedules`) return the branch
    step (integration/schedule.py), configured by `patched(**kwargs)`.
Names are replaced on megatron's modules, so code must look them up there inside the block (`from
megatron.core.models.gpt import gpt_layer_specs; gpt_layer_specs.get_gpt_layer_local_spec(...)`, or a
`from ... import` executed inside the block). Everything is restored on exit, also after an exception. A
megatron-core version this was not tested with is refused with one line, before anything is patched.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from megatron_branch.errors import UserError

TESTED_MEGATRON_CORE = ("0.16.1",)
"""megatron-core versions whose names and signatures the patch was tested against (tests/unit/test_integration.py)."""

_SPEC_BUILDERS = ("get_gpt_layer_local_spec", "get_gpt_layer_with_transformer_engine_spec")
_FB_MODULES = ("megatron.core.pipeline_parallel", "megatron.core.pipeline_parallel.schedules")


def megatron_core_version() -> str:
    from megatron.core import package_info

    return str(package_info.__version__)


def check_version(version: str | None = None) -> None:
    version = version or megatron_core_version()
    if version not in TESTED_MEGATRON_CORE:
        raise UserError(
            f"megatron_branch.patched() was tested with megatron-core {', '.join(TESTED_MEGATRON_CORE)}, "
            f"not {version}; patch the spec and the step by hand (see patches/) or pin megatron-core"
        )


def _targets() -> list[tuple[Any, str]]:
    specs = importlib.import_module("megatron.core.models.gpt.gpt_layer_specs")
    out: list[tuple[Any, str]] = [(specs, name) for name in _SPEC_BUILDERS]
    out += [(importlib.import_module(m), "get_forward_backward_func") for m in _FB_MODULES]
    gpt = importlib.import_module("megatron.core.models.gpt.gpt_model")
    out.append((gpt.GPTModel, "__init__"))
    for owner, name in out:
        if name not in vars(owner):
            raise UserError(f"megatron-core has no {owner.__name__}.{name} to patch (renamed?)")
    return out


@contextmanager
def patched(*, version: str | None = None, **step_options: Any) -> Iterator[None]:
    """Patch megatron-core for branch replay inside the block; `step_options` go to get_forward_backward_func
    (schedule, objective, vocab_size, branch_micro_batch, ...). `version` overrides the detected version
    (for tests)."""
    check_version(version)
    from megatron_branch.integration.schedule import get_forward_backward_func
    from megatron_branch.integration.spec import patch_layer_spec
    from megatron_branch.models.rotary import enable_position_rope

    targets = _targets()
    saved = [(owner, name, vars(owner)[name]) for owner, name in targets]
    originals = {name: orig for _, name, orig in saved}

    def spec_builder(orig: Any) -> Any:
        def builder(*args: Any, **kwargs: Any) -> Any:
            return patch_layer_spec(orig(*args, **kwargs))

        builder.__wrapped__ = orig  # type: ignore[attr-defined]
        return builder

    orig_init = originals["__init__"]

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        if getattr(self, "position_embedding_type", None) == "rope":
            enable_position_rope(self)

    def fb(pp_size: int | None = None, vp_size: int | None = None) -> Any:
        return get_forward_backward_func(pp_size, vp_size, **step_options)

    replacement = {
        "get_gpt_layer_local_spec": spec_builder(originals["get_gpt_layer_local_spec"]),
        "get_gpt_layer_with_transformer_engine_spec": spec_builder(
            originals["get_gpt_layer_with_transformer_engine_spec"]
        ),
        "get_forward_backward_func": fb,
        "__init__": init,
    }
    try:
        for owner, name, _ in saved:
            setattr(owner, name, replacement[name])
        yield
    finally:
        for owner, name, orig in saved:
            setattr(owner, name, orig)
