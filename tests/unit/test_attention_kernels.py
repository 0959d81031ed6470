"""Kernels and the lse merge: forward vs SDPA, explicit backward vs autograd, and the CPU flash-op lse TRAP."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_branch.attention import (
    AttentionLayout,
    attention,
    fused_attention_backward,
    fused_attention_forward,
    lse_merge,
    math_attention_backward,
    math_attention_forward,
    merge_parts,
    reference_attention,
)

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (floored at 1 so tiny references do not blow it up)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1.0)).item()


def qkv(b: int, n: int, sq: int, sk: int, h: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(b, n, sq, h), (b, n, sk, h), (b, n, sk, h)]
    return [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]  # [b, n, s, h] SDPA layout


def sdpa_ref(q, k, v, mask, scale):
    """Differentiable reference out and lse in the SDPA layout."""
    s = q @ k.transpose(-1, -2) * scale  # [b, n, sq, sk]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


# ---------------------------------------------------------------------------------------------------------------
# lse_merge
# ---------------------------------------------------------------------------------------------------------------


def test_lse_merge_of_two_key_halves_is_full_attention() -> None:
    q, k, v = qkv(2, 3, 9, 17, 8, torch.float64)
    scale = 0.3
    ref, ref_lse = sdpa_ref(q, k, v, None, scale)
    parts = [
        math_attention_forward(q, k[:, :, sl], v[:, :, sl], None, scale) for sl in (slice(0, 6), slice(6, 17))
    ]
    out, lse = lse_merge(None, None, *parts[0])
    out, lse = lse_merge(out, lse, *parts[1])
    assert rel_err(out, ref) < 1e-12 and rel_err(lse, ref_lse) < 1e-12
    out3, lse3 = merge_parts(
        [
            math_attention_forward(q, k[:, :, a:b], v[:, :, a:b], None, scale)
            for a, b in ((0, 1), (1, 10), (10, 17))
        ]
    )
    assert rel_err(out3, ref) < 1e-12 and rel_err(lse3, ref_lse) < 1e-12


def test_lse_merge_empty_rows_give_no_nan() -> None:
    q, k, v = qkv(1, 2, 4, 6, 4, torch.float32)
    # part 1: row 0 sees nothing, part 2: row 1 sees nothing; row 2 sees nothing anywhere
    m1 = torch.ones(4, 3, dtype=torch.bool)
    m1[0] = False
    m1[2] = False
    m2 = torch.ones(4, 3, dtype=torch.bool)
    m2[1] = False
    m2[2] = False
    p1 = math_attention_forward(q, k[:, :, :3], v[:, :, :3], m1, 1.0)
    p2 = math_attention_forward(q, k[:, :, 3:], v[:, :, 3:], m2, 1.0)
    assert torch.isneginf(p1[1][..., 0]).all() and (p1[0][:, :, 0] == 0).all()
    out, lse = merge_parts([p1, p2])
    assert not out.isnan().any() and not lse.isnan().any()
    full = torch.cat([m1, m2], dim=1)
    ref, ref_lse = sdpa_ref(q, k, v, full, 1.0)
    keep = torch.tensor([True, True, False, True])
    assert rel_err(out[:, :, keep], ref[:, :, keep]) < 1e-5
    assert rel_err(lse[:, :, keep], ref_lse[:, :, keep]) < 1e-5
    assert (out[:, :, 2] == 0).all() and torch.isneginf(lse[:, :, 2]).all()
    # the merge is differentiable without NaN gradients even through -inf rows
    o1 = p1[0].clone().requires_grad_()
    o, _ = lse_merge(o1, p1[1], *p2)
    o.sum().backward()
    assert not o1.grad.isnan().any()


# ---------------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("masked", [False, True])
def test_math_kernel_forward_backward(dtype: torch.dtype, masked: bool) -> None:
    q, k, v = qkv(2, 3, 7, 13, 8, dtype, seed=1)
    scale = 1 / math.sqrt(8)
    mask = torch.rand(7, 13, generator=torch.Generator().manual_seed(2)) < 0.6 if masked else None
    if mask is not None:
        mask[:, 0] = True  # no empty rows here (they have no gradient to compare)
    out, lse = math_attention_forward(q, k, v, mask, scale)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    assert rel_err(out, ref) < TOL[dtype]
    assert lse.dtype == dtype
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = sdpa_ref(qr, kr, vr, mask, scale)
    assert rel_err(lse, ref_lse) < TOL[dtype]
    dout = torch.randn_like(out)
    ref_grads = torch.autograd.grad(ref_out, (qr, kr, vr), dout)
    grads = math_attention_backward(dout, q, k, v, out, lse, mask, scale)
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal,sq,sk", [(True, 13, 13), (False, 7, 13), (False, 1, 5), (True, 1, 1)])
def test_flash_kernel_forward_backward(dtype: torch.dtype, causal: bool, sq: int, sk: int) -> None:
    q, k, v = qkv(2, 3, sq, sk, 8, dtype, seed=3)
    scale = 0.25
    mask = torch.ones(sq, sk, dtype=torch.bool).tril() if causal else None
    out, lse = fused_attention_forward(q, k, v, causal, scale)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = sdpa_ref(qr, kr, vr, mask, scale)
    assert rel_err(out, ref_out) < TOL[dtype] and rel_err(lse, ref_lse) < TOL[dtype]
    dout = torch.randn_like(out)
    ref_grads = torch.autograd.grad(ref_out, (qr, kr, vr), dout)
    grads = fused_attention_backward(dout, q, k, v, out, lse, causal, scale)
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("kernel", ["math", "flash"])
def test_per_part_backward_with_merged_out_lse_is_exact(kernel: str) -> None:
    """ring-flash-attention trick: each part's backward run with the MERGED out/lse; dq summed, dk/dv per part."""
    n = 11
    q, k, v = qkv(2, 2, n, 2 * n, 8, torch.float64, seed=4)  # keys = [ancestors (n) | own (n)]
    scale = 0.3
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    full_mask = torch.cat([torch.ones(n, n, dtype=torch.bool), causal], dim=1)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, _ = sdpa_ref(qr, kr, vr, full_mask, scale)
    dout = torch.randn_like(ref_out)
    ref_grads = torch.autograd.grad(ref_out, (qr, kr, vr), dout)

    ka, kb, va, vb = k[:, :, :n], k[:, :, n:], v[:, :, :n], v[:, :, n:]
    if kernel == "flash":
        fwd = [
            fused_attention_forward(q, ka, va, False, scale),
            fused_attention_forward(q, kb, vb, True, scale),
        ]
    else:
        fwd = [
            math_attention_forward(q, ka, va, None, scale),
            math_attention_forward(q, kb, vb, causal, scale),
        ]
    out, lse = merge_parts(fwd)
    assert rel_err(out, ref_out) < 1e-12
    if kernel == "flash":
        ga = fused_attention_backward(dout, q, ka, va, out, lse, False, scale)
        gb = fused_attention_backward(dout, q, kb, vb, out, lse, True, scale)
    else:
        ga = math_attention_backward(dout, q, ka, va, out, lse, None, scale)
        gb = math_attention_backward(dout, q, kb, vb, out, lse, causal, scale)
    assert rel_err(ga[0] + gb[0], ref_grads[0]) < 1e-10
    assert rel_err(torch.cat([ga[1], gb[1]], 2), ref_grads[1]) < 1e-10
    assert rel_err(torch.cat([ga[2], gb[2]], 2), ref_grads[2]) < 1e-10


# ---------------------------------------------------------------------------------------------------------------
# THE TRAP: autograd through the CPU flash op's lse is silently wrong
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_trap_autograd_through_cpu_flash_lse_is_wrong_but_merge_backend_is_exact(dtype: torch.dtype) -> None:
    p, s, b, n, h = 9, 6, 2, 2, 8
    layout = AttentionLayout.shared_prefix(p, [s, s])
    total = layout.num_queries
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(total, b, n, h, generator=gen, dtype=dtype, requires_grad=True) for _ in range(3))
    scale = 1 / math.sqrt(h)
    ref = reference_attention(q, k, v, layout, scale)
    dout = torch.randn_like(ref)
    ref_dq, ref_dk, ref_dv = torch.autograd.grad(ref, (q, k, v), dout)

    # the tempting "simplification": autograd through the op's out AND lse with a differentiable lse_merge
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, h]
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    outs = [op(qb[:, :, :p], kb[:, :, :p], vb[:, :, :p], 0.0, True, scale=scale)[0]]
    for start in (p, p + s):
        qs = qb[:, :, start : start + s]
        a = op(qs, kb[:, :, :p], vb[:, :, :p], 0.0, False, scale=scale)
        c = op(qs, kb[:, :, start : start + s], vb[:, :, start : start + s], 0.0, True, scale=scale)
        outs.append(lse_merge(a[0], a[1], c[0], c[1])[0].to(dtype))
    naive = torch.cat(outs, dim=2).permute(2, 0, 1, 3).reshape(total, b, n * h)
    assert rel_err(naive, ref) < TOL[dtype]  # the forward is right...
    naive_dq, naive_dk, _ = torch.autograd.grad(naive, (q, k, v), dout)
    assert rel_err(naive_dq, ref_dq) > 1e-2  # ...but dq is silently wrong (the op's lse carries no gradient)
    assert rel_err(naive_dk, ref_dk) > 1e-2

    # merge_attention's explicit per-part backward with the merged out/lse is exact
    out = attention(q, k, v, layout, backend="merge", scale=scale)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert rel_err(out, ref) < TOL[dtype]
    assert rel_err(dq, ref_dq) < TOL[dtype]
    assert rel_err(dk, ref_dk) < TOL[dtype]
    assert rel_err(dv, ref_dv) < TOL[dtype]
