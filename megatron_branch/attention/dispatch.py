"""Backend names -> executors of THE plan, and the one-rank entry point `attention`.

SHAPE LEGEND (Megatron sequence-first):
    s  sequence (sq queries, sk keys)   b batch   n query heads   g query groups (kv heads)   h head dim
    q [sq, b, n, h]    k, v [sk, b, g, h] (or key blocks [sk_j, b, g, h] laid end to end)    out [sq, b, n * h]

Backends (attention/executor.py has the contract):
    merge      fused kernels per rectangle of the plan (default on every device)
    packed     one dense masked pass, FlashAttention-2's backward formulas
    reference  plain masked softmax differentiated by autograd (the float64 oracle)
    flex       FlexAttention with a mask from the plan (forward-only on CPU; the GPU path for general trees)
    repeat     PrefixGrouper's repeated-prefix method: a ONE-RANK benchmark baseline, not an executor
The backend is passed in (ScheduleOptions.backend -> the context), never set globally; `None` means
`default_backend()`. Every executor serves one rank and the ring alike, so a name means the same at CP1 and under CP.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from megatron_branch.attention.dense_executors import PACKED, REFERENCE
from megatron_branch.attention.executor import Executor, PlanAttention
from megatron_branch.attention.flex import FLEX
from megatron_branch.attention.layout import AttentionLayout
from megatron_branch.attention.merge_executor import MERGE
from megatron_branch.attention.plan_sources import plan_from_layout
from megatron_branch.attention.reference import check_shapes
from megatron_branch.attention.repeat_backend import repeat_prefix_attention

EXECUTORS: dict[str, Executor] = {e.name: e for e in (MERGE, PACKED, REFERENCE, FLEX)}
"""THE executor registry: each runs on one rank, as the ring's per-block executor under CP, and in decode
(generation/kv_cache.py). A backend added here is found by name everywhere (resolve_backend reads it live)."""
BASELINES = ("repeat",)
"""One-rank benchmark baselines that are not executors (no lse, no ring)."""
BACKENDS: tuple[str, ...] = (*EXECUTORS, *BASELINES)


def default_backend() -> str:
    """The backend used when none is named: "merge", exact on every device (the fused kernels of
    attention/kernels.py are chosen by device and dtype inside it)."""
    return "merge"


def resolve_backend(name: str | None) -> str:
    """The name that runs: `name`, or the default for None; ValueError for an unknown name."""
    if name is None:
        return default_backend()
    if name not in EXECUTORS and name not in BASELINES:
        valid = sorted({*EXECUTORS, *BASELINES})
        raise ValueError(f"unknown attention backend {name!r}; valid: {', '.join(valid)}")
    return name


def backend_problem(
    name: str | None, *, cp_size: int = 1, training: bool = False, device: str = "cpu"
) -> str | None:
    """Why backend `name` cannot run a step with `cp_size` context-parallel ranks (training or scoring) on
    `device`, in one line; None when it can. The one home of these rules: every entry point asks here."""
    try:
        resolved = resolve_backend(name)
    except ValueError as e:
        return str(e)
    if resolved in BASELINES and cp_size > 1:
        return (
            f"attention backend {resolved!r} is a one-rank benchmark baseline (no ring executor): "
            f"use merge, packed, reference or flex with context parallelism ({cp_size} ranks)"
        )
    executor = EXECUTORS.get(resolved)
    if training and executor is not None and not executor.backward_on_cpu and device == "cpu":
        return f"attention backend {resolved!r} has no backward on CPU (torch refuses it): use merge, packed or reference"
    return None


def executor(name: str | None) -> Executor:
    """The executor named `name` (None: the default); ValueError for a baseline or an unknown name."""
    resolved = resolve_backend(name)
    if resolved not in EXECUTORS:
        raise ValueError(
            f"attention backend {resolved!r} is a one-rank baseline, not an executor of the plan"
        )
    return EXECUTORS[resolved]


def plan_executor(name: str | None) -> Executor:
    """The executor that runs a plan for backend `name` where a baseline has no way of its own (decode,
    generation/kv_cache.py): the named executor, or the default one for a one-rank baseline."""
    return executor(None if resolve_backend(name) in BASELINES else name)


def attention(
    q: torch.Tensor,
    k: torch.Tensor | Sequence[torch.Tensor],
    v: torch.Tensor | Sequence[torch.Tensor],
    layout: AttentionLayout,
    *,
    backend: str | None = None,
    scale: float | None = None,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Branch attention on one rank: q [sq,b,n,h], k/v [sk,b,g,h] or key blocks [sk_j,b,g,h] laid end to end (read
    in place) -> [sq,b,n*h], with the named backend (None: the default); `window`: a sliding window over path
    positions (attention/window.py), `sink` [n]: learned per-head sink logits (attention/merge.py `add_sink`)."""
    name = resolve_backend(backend)
    ks = [k] if isinstance(k, torch.Tensor) else list(k)
    vs = [v] if isinstance(v, torch.Tensor) else list(v)
    assert len(ks) == len(vs) and ks, "k and v need the same, non-zero number of blocks"
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if name in BASELINES:
        if window is not None or sink is not None:
            raise ValueError(
                f"attention backend {name!r} has no sliding window or sink: use merge, packed or reference"
            )
        k_all, v_all = (x[0] if len(x) == 1 else torch.cat(x) for x in (ks, vs))
        return repeat_prefix_attention(q, k_all, v_all, layout, scale)
    # shape-only stand-ins for the concatenated keys (meta device: nothing is allocated)
    k_all = torch.empty((sum(x.shape[0] for x in ks), *ks[0].shape[1:]), device="meta")
    check_shapes(q, k_all, k_all, layout)
    ex = EXECUTORS[name]
    ex.check_grad(q, [*ks, *vs])
    plan = plan_from_layout(layout, [x.shape[0] for x in ks], window=window)
    return PlanAttention.apply(q, plan, scale, ex, len(ks), sink, *ks, *vs)
