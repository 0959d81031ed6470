"""Backend choice for branch attention: one name -> one implementation, all with the same signature.

SHAPE LEGEND (Megatron sequence-first):
    s  sequence (sq queries, sk keys)   b batch   n query heads   g query groups (kv heads)   h head dim
    q [sq, b, n, h]    k, v [sk, b, g, h]    out [sq, b, n * h]

Backends:
    reference  plain masked softmax (the float64 oracle)
    merge      fused two-part attention + lse merge with the per-part backward (default on CPU and CUDA)
    packed     one SDPA with the dense tree mask
    flex       FlexAttention with a BlockMask (forward-only on CPU; the GPU path for general trees)
    repeat     the ancestors' K/V repeated per segment + masked SDPA (PrefixGrouper's method: a benchmark baseline)
The default is "merge" on every device; tests override it with `use_backend`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from megatron_branch.attention.flex import flex_attention_forward
from megatron_branch.attention.layout import AttentionLayout
from megatron_branch.attention.merge_backend import merge_attention
from megatron_branch.attention.packed_backend import packed_attention
from megatron_branch.attention.reference import reference_attention
from megatron_branch.attention.repeat_backend import repeat_prefix_attention

AttentionFn = Callable[..., torch.Tensor]

BACKENDS: dict[str, AttentionFn] = {
    "reference": reference_attention,
    "merge": merge_attention,
    "packed": packed_attention,
    "flex": flex_attention_forward,
    "repeat": repeat_prefix_attention,
}

_override: str | None = None  # set by set_default_backend / use_backend


def _check_name(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; valid: {', '.join(sorted(BACKENDS))}")
    return name


def default_backend(device: torch.device | str) -> str:
    """The backend used when none is named: an override if set, else "merge" (exact on every device; the fused
    kernels of attention/kernels.py, chosen by device and dtype, do the heavy lifting)."""
    return _override if _override is not None else "merge"


def set_default_backend(name: str | None) -> None:
    """Override the default backend for every device (None removes the override)."""
    global _override
    _override = None if name is None else _check_name(name)


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Temporarily override the default backend (tests)."""
    global _override
    previous = _override
    _override = _check_name(name)
    try:
        yield
    finally:
        _override = previous


# backends that take key BLOCKS as they are (no concatenated copy); the others get one tensor
_TAKES_BLOCKS = {"merge"}


def attention(
    q: torch.Tensor,
    k: torch.Tensor | Sequence[torch.Tensor],
    v: torch.Tensor | Sequence[torch.Tensor],
    layout: AttentionLayout,
    *,
    backend: str | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Branch attention: q [sq, b, n, h], k/v [sk, b, g, h] (or key blocks [sk_j, b, g, h] laid end to end)
    -> [sq, b, n*h] with the named or default backend."""
    name = _check_name(backend) if backend is not None else default_backend(q.device)
    if not isinstance(k, torch.Tensor) and name not in _TAKES_BLOCKS:
        k, v = torch.cat(list(k)), torch.cat(list(v))
    return BACKENDS[name](q, k, v, layout, scale=scale)
