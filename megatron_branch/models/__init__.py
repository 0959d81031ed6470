"""Model construction: architecture mapping and the megatron-core GPT model with branch-aware attention.

`ModelArch` is plain arithmetic on a config; the model classes import megatron-core (seconds), so they are loaded
on first use: `megatron-branch --help`, `plan` and config validation never pay for megatron.
"""

from typing import Any

from megatron_branch.models.arch import ModelArch

_LAZY = {
    "BranchCriticModel": "megatron_branch.models.critic",
    "build_critic": "megatron_branch.models.critic",
    "BranchGPTModel": "megatron_branch.models.gpt",
    "branch_layer_spec": "megatron_branch.models.gpt",
    "build_model": "megatron_branch.models.gpt",
}

__all__ = ["ModelArch", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:  # PEP 562
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron_branch.models' has no attribute {name!r}")
