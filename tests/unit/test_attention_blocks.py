"""The merge backend takes key BLOCKS in place (replay's cached leaves): same result and per-block gradients as
one concatenated key tensor, and no copy of a block is saved for backward."""

from __future__ import annotations

import torch

from megatron_branch.attention.dispatch import attention
from megatron_branch.attention.layout import AttentionLayout, QuerySegment


def _case() -> tuple[AttentionLayout, list[int]]:
    # keys: root (5) | child (3) | chunk: two sibling leaves (4 and 2) that see root + child, plus 1 padding row
    layout = AttentionLayout(
        num_queries=7,
        num_keys=15,
        segments=(
            QuerySegment(q_start=0, q_end=4, ancestor_ranges=((0, 8),), self_k_start=8),
            QuerySegment(q_start=4, q_end=6, ancestor_ranges=((0, 8),), self_k_start=12),
            QuerySegment(q_start=6, q_end=7, ancestor_ranges=(), self_k_start=14),
        ),
    )
    return layout, [5, 3, 7]


def test_blocks_equal_concatenated_keys_fp64() -> None:
    layout, sizes = _case()
    torch.manual_seed(0)
    q = torch.randn(7, 1, 4, 8, dtype=torch.float64, requires_grad=True)
    ks = [torch.randn(s, 1, 2, 8, dtype=torch.float64, requires_grad=True) for s in sizes]
    vs = [torch.randn(s, 1, 2, 8, dtype=torch.float64, requires_grad=True) for s in sizes]
    w = torch.randn(7, 1, 32, dtype=torch.float64)

    out = attention(q, ks, vs, layout, backend="merge")
    grads = torch.autograd.grad((out * w).sum(), [q, *ks, *vs])
    ref = attention(q, torch.cat(ks), torch.cat(vs), layout, backend="reference")
    ref_grads = torch.autograd.grad((ref * w).sum(), [q, *ks, *vs])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    # the padding row sees nothing of the ancestors: their gradient comes from the two leaves only
    assert grads[1].abs().sum() > 0 and grads[2].abs().sum() > 0


def test_blocks_are_saved_in_place() -> None:
    layout, sizes = _case()
    q = torch.randn(7, 1, 4, 8, requires_grad=True)
    ks = [torch.randn(s, 1, 2, 8, requires_grad=True) for s in sizes]
    vs = [torch.randn(s, 1, 2, 8, requires_grad=True) for s in sizes]
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        attention(q, ks, vs, layout, backend="merge")
    ptrs = {t.untyped_storage().data_ptr() for t in saved}
    for t in (*ks, *vs):  # each block is saved as itself, not as part of a concatenated copy
        assert t.untyped_storage().data_ptr() in ptrs
    assert sum(t.numel() for t in saved if t.shape[-1] == 8 and t.dim() == 4) == q.numel() + 2 * sum(
        k.numel() for k in ks
    )
