"""megatron-branch: exact shared-prefix ("branch replay") RL training for Megatron-Core."""

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # `megatron_branch.patched()` without importing megatron-core for every `import megatron_branch`
    if name == "patched":
        from megatron_branch.integration import patched

        return patched
    raise AttributeError(f"module 'megatron_branch' has no attribute {name!r}")
