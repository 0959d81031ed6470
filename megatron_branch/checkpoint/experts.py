"""Routed experts under expert parallelism: a rank's local expert l of a layer is global expert ep_rank * E/ep + l.

megatron's SequentialMLP names its parameters `mlp.experts.local_experts.{l}.*` on every rank (l < E/ep) and puts
the global index into the dist checkpoint's offsets itself; full states (checkpoint/tp.py, the parameter map)
name experts by their global index, as if ep were 1. Process groups are arguments.
"""

from __future__ import annotations

import re
from typing import Any

import torch.distributed as dist

_LOCAL = re.compile(r"^(?P<head>.*\.mlp\.experts\.local_experts\.)(?P<idx>\d+)(?P<tail>\..*)$")


def expert_index(name: str) -> tuple[str, int, str] | None:
    """(head, local index, tail) of a routed expert's parameter name, else None."""
    m = _LOCAL.match(name)
    return None if m is None else (m["head"], int(m["idx"]), m["tail"])


def rank_size(ep_group: Any) -> tuple[int, int]:
    if ep_group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group=ep_group), dist.get_world_size(group=ep_group)


def local_experts(names: list[str]) -> int:
    """Experts per layer held by this rank (one layer's local indices)."""
    idx = {expert_index(n)[1] for n in names if expert_index(n) is not None}  # type: ignore[index]
    return max(idx) + 1 if idx else 0


def global_name(name: str, ep_rank: int, num_local: int) -> str:
    parts = expert_index(name)
    if parts is None:
        return name
    head, idx, tail = parts
    return f"{head}{ep_rank * num_local + idx}{tail}"


def local_name(name: str, ep_rank: int, num_local: int) -> str | None:
    """The local parameter name of global expert parameter `name` on this EP rank (None: another rank's)."""
    parts = expert_index(name)
    if parts is None:
        return name
    head, idx, tail = parts
    lo = ep_rank * num_local
    return f"{head}{idx - lo}{tail}" if lo <= idx < lo + num_local else None
