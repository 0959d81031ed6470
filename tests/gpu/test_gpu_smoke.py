"""GPU checks; skipped cleanly on machines without CUDA (CI, developer CPUs)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu
def test_merge_backend_matches_reference_on_cuda() -> None:
    from megatron_branch.attention.dispatch import attention
    from megatron_branch.attention.layout import AttentionLayout, QuerySegment

    torch.manual_seed(0)
    dev = "cuda"
    q = torch.randn(12, 1, 4, 16, device=dev, dtype=torch.float32, requires_grad=True)
    k = torch.randn(12, 1, 2, 16, device=dev, dtype=torch.float32, requires_grad=True)
    v = torch.randn(12, 1, 2, 16, device=dev, dtype=torch.float32, requires_grad=True)
    layout = AttentionLayout(
        num_queries=12,
        num_keys=12,
        segments=(
            QuerySegment(q_start=0, q_end=5, ancestor_ranges=(), self_k_start=0),
            QuerySegment(q_start=5, q_end=12, ancestor_ranges=((0, 5),), self_k_start=5),
        ),
    )
    ref = attention(q, k, v, layout, backend="reference")
    out = attention(q, k, v, layout, backend="merge")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
