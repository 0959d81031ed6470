"""Every attention backend vs the reference on tree layouts, forward and backward; the shared-prefix identity."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_branch.attention import (
    BACKENDS,
    AttentionLayout,
    QuerySegment,
    attention,
    default_backend,
    merge_attention,
    packed_attention,
    reference_attention,
    set_default_backend,
    use_backend,
)

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1.0)).item()


def tree_layout(lengths: list[int], parents: list[int], external: int = 0) -> AttentionLayout:
    """Nodes packed in order; node i sees every ancestor's keys in full and itself causally.

    parents[i] < i, or -1 for a root; with external > 0 every root also sees keys [0, external) (cached ancestors),
    and the chunk's own keys start at `external` (keys = [cached ancestor keys | chunk keys]).
    """
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    segs = []
    for i, n in enumerate(lengths):
        ranges, p = [], parents[i]
        while p >= 0:
            ranges.append((external + starts[p], external + starts[p] + lengths[p]))
            p = parents[p]
        if external:
            ranges.append((0, external))
        segs.append(
            QuerySegment(
                q_start=starts[i],
                q_end=starts[i] + n,
                ancestor_ranges=tuple(sorted(ranges)),
                self_k_start=external + starts[i],
            )
        )
    return AttentionLayout(num_queries=sum(lengths), num_keys=external + sum(lengths), segments=tuple(segs))


LAYOUTS = {
    "causal": AttentionLayout.causal(13),
    "prefix+siblings": AttentionLayout.shared_prefix(13, [7, 1, 5]),
    "two-level": tree_layout([5, 4, 3, 1, 7, 2], [-1, 0, 1, 1, 0, 4]),
    "forest+padding": tree_layout([3, 4, 1, 1], [-1, 0, -1, -1]),
    # chunk whose ancestors are EXTERNAL cached keys, Sk > Sq, multi-range ancestors
    "external": tree_layout([6, 3, 4], [-1, 0, -1], external=11),
}
SHAPES = {"mha": (2, 2), "gqa": (4, 2)}  # (n query heads, g kv heads)


def make_inputs(
    layout: AttentionLayout, n: int, g: int, dtype: torch.dtype, seed: int = 0
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    b, h = 2, 8
    sq, sk = layout.num_queries, layout.num_keys
    shapes = [(sq, b, n, h), (sk, b, g, h), (sk, b, g, h)]
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in shapes]


def naive_loop_attention(q, k, v, layout, scale):
    """An independent oracle for the reference: explicit per-row softmax, kv head j // (n // g)."""
    sq, b, n, h = q.shape
    g = k.shape[2]
    mask = layout.dense_mask()
    out = torch.zeros(sq, b, n, h, dtype=q.dtype)
    for i in range(sq):
        keys = mask[i].nonzero().flatten()
        for j in range(n):
            kk, vv = k[keys, :, j // (n // g)], v[keys, :, j // (n // g)]  # [visible, b, h]
            w = torch.softmax((kk * q[i, :, j]).sum(-1) * scale, dim=0)  # [visible, b]
            out[i, :, j] = (w.unsqueeze(-1) * vv).sum(0)
    return out.reshape(sq, b, n * h)


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("heads", list(SHAPES))
def test_reference_matches_naive_loop(layout_name: str, heads: str) -> None:
    layout = LAYOUTS[layout_name]
    q, k, v = make_inputs(layout, *SHAPES[heads], torch.float64)
    with torch.no_grad():
        assert (
            rel_err(reference_attention(q, k, v, layout), naive_loop_attention(q, k, v, layout, 1 / 8**0.5))
            < 1e-12
        )


@pytest.mark.parametrize("backend", ["merge", "packed", "reference"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("heads", list(SHAPES))
def test_backend_forward_backward_vs_reference(
    backend: str, dtype: torch.dtype, layout_name: str, heads: str
) -> None:
    layout = LAYOUTS[layout_name]
    q, k, v = make_inputs(layout, *SHAPES[heads], dtype, seed=1)
    # the oracle runs in float64 whatever the tested dtype
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(q64, k64, v64, layout)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout)
    out = attention(q, k, v, layout, backend=backend)
    assert out.shape == ref.shape and out.dtype == dtype
    grads = torch.autograd.grad(out, (q, k, v), dout.to(dtype))
    assert rel_err(out, ref) < TOL[dtype]
    for got, want in zip(grads, ref_grads):
        assert got.shape == want.shape and got.dtype == dtype
        assert rel_err(got, want) < TOL[dtype]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_flex_forward_vs_reference(dtype: torch.dtype, layout_name: str) -> None:
    layout = LAYOUTS[layout_name]
    q, k, v = make_inputs(layout, *SHAPES["gqa"], dtype, seed=3)
    with torch.no_grad():
        ref = reference_attention(q.double(), k.double(), v.double(), layout)
        out = attention(q, k, v, layout, backend="flex")
    assert rel_err(out, ref) < TOL[dtype]


def test_flex_refuses_grad_on_cpu() -> None:
    layout = LAYOUTS["prefix+siblings"]
    q, k, v = make_inputs(layout, 2, 2, torch.float32)
    with pytest.raises(RuntimeError, match="no backward on CPU"):
        attention(q, k, v, layout, backend="flex")


# ---------------------------------------------------------------------------------------------------------------
# the tree identity: packed branches with a shared prefix == G independent causal passes, prefix grads SUMMED
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("packed_fn", [merge_attention, packed_attention], ids=["merge", "packed"])
def test_shared_prefix_equals_independent_passes_and_prefix_grads_sum(packed_fn) -> None:
    p, lens, b, n, g, h = 10, [6, 3, 7], 2, 4, 2, 8
    layout = AttentionLayout.shared_prefix(p, lens)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (
        torch.randn(layout.num_queries, b, heads, h, generator=gen, dtype=torch.float64)
        for heads in (n, g, g)
    )
    douts = [torch.randn(p + s, b, n * h, generator=gen, dtype=torch.float64) for s in lens]
    starts = [p + sum(lens[:i]) for i in range(len(lens))]

    # G independent causal passes over [prefix | branch_i]; the prefix rows' upstream grad is only applied once
    copies = []
    for i, (st_, s) in enumerate(zip(starts, lens)):
        rows = torch.cat([torch.arange(p), torch.arange(st_, st_ + s)])
        qi, ki, vi = (t[rows].clone().requires_grad_() for t in (q, k, v))
        out = reference_attention(qi, ki, vi, AttentionLayout.causal(p + s))
        dout = douts[i].clone()
        if i > 0:
            dout[:p] = 0  # the prefix's own queries appear once in the packed pass
        grads = torch.autograd.grad(out, (qi, ki, vi), dout)
        copies.append((out.detach(), grads))

    qp, kp, vp = (t.clone().requires_grad_() for t in (q, k, v))
    packed = packed_fn(qp, kp, vp, layout)
    dout_packed = torch.cat([douts[0][:p]] + [d[p:] for d in douts])
    dq, dk, dv = torch.autograd.grad(packed, (qp, kp, vp), dout_packed)

    for (out_i, (dq_i, dk_i, dv_i)), st_, s in zip(copies, starts, lens):
        assert rel_err(packed[st_ : st_ + s], out_i[p:]) < 1e-12  # branch outputs identical
        assert rel_err(dq[st_ : st_ + s], dq_i[p:]) < 1e-12
        assert rel_err(dk[st_ : st_ + s], dk_i[p:]) < 1e-12
        assert rel_err(dv[st_ : st_ + s], dv_i[p:]) < 1e-12
    assert rel_err(packed[:p], copies[0][0][:p]) < 1e-12
    for which, full in ((0, dq), (1, dk), (2, dv)):
        summed = sum(c[1][which][:p] for c in copies)
        assert rel_err(full[:p], summed) < 1e-12  # prefix gradient == SUM over the G copies
        if which == 0:
            continue  # the prefix's dq comes from its own rows only (applied in copy 0); dK/dV are the shared ones
        # planted bug: drop one branch's contribution -> must be clearly detected
        dropped = sum(c[1][which][:p] for c in copies[:-1])
        assert (full[:p] - dropped).abs().max() / full[:p].abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# random trees (property test), layout validation, dispatch
# ---------------------------------------------------------------------------------------------------------------


@st.composite
def random_tree(draw):
    count = draw(st.integers(1, 6))
    lengths = [draw(st.integers(1, 6)) for _ in range(count)]
    parents = [draw(st.integers(-1, i - 1)) for i in range(count)]
    external = draw(st.sampled_from([0, 0, 3]))
    return tree_layout(lengths, parents, external)


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(layout=random_tree(), seed=st.integers(0, 1000))
def test_merge_backend_random_trees(layout: AttentionLayout, seed: int) -> None:
    q, k, v = make_inputs(layout, 4, 2, torch.float64, seed=seed)
    ref = reference_attention(q, k, v, layout)
    dout = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    out = merge_attention(q, k, v, layout)
    assert rel_err(out, ref) < 1e-10
    for got, want in zip(torch.autograd.grad(out, (q, k, v), dout), ref_grads):
        assert rel_err(got, want) < 1e-10


def test_dense_mask_of_shared_prefix() -> None:
    m = AttentionLayout.shared_prefix(2, [2, 1]).dense_mask()
    want = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 1]],
        dtype=torch.bool,
    )
    assert torch.equal(m, want)


@pytest.mark.parametrize(
    "segments,sq,sk,match",
    [
        ([QuerySegment(q_start=0, q_end=2, self_k_start=0)], 3, 3, "cover"),
        (
            [
                QuerySegment(q_start=0, q_end=2, self_k_start=0),
                QuerySegment(q_start=1, q_end=3, self_k_start=1),
            ],
            3,
            3,
            "overlaps",
        ),
        ([QuerySegment(q_start=1, q_end=3, self_k_start=1)], 3, 3, "gap"),
        ([QuerySegment(q_start=0, q_end=3, self_k_start=1)], 3, 3, "outside"),
        ([QuerySegment(q_start=0, q_end=2, ancestor_ranges=((2, 5),), self_k_start=0)], 2, 4, "outside"),
        ([QuerySegment(q_start=0, q_end=2, ancestor_ranges=((1, 2),), self_k_start=0)], 2, 4, "own keys"),
    ],
)
def test_layout_validation(segments, sq: int, sk: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AttentionLayout(num_queries=sq, num_keys=sk, segments=tuple(segments))


def test_dispatch_defaults_and_overrides() -> None:
    assert set(BACKENDS) == {"reference", "merge", "packed", "flex", "repeat"}
    assert default_backend("cpu") == "merge" and default_backend(torch.device("cpu")) == "merge"
    with use_backend("packed"):
        assert default_backend("cpu") == "packed"
        with use_backend("reference"):
            assert default_backend("cpu") == "reference"
        assert default_backend("cpu") == "packed"
    assert default_backend("cpu") == "merge"
    set_default_backend("reference")
    try:
        assert default_backend("cpu") == "reference"
    finally:
        set_default_backend(None)
    with pytest.raises(ValueError, match="flex, merge, packed, reference, repeat"):
        attention(*make_inputs(LAYOUTS["causal"], 2, 2, torch.float32), LAYOUTS["causal"], backend="nope")
    with pytest.raises(ValueError, match="valid"):
        set_default_backend("nope")


def test_scale_argument_is_used() -> None:
    layout = LAYOUTS["prefix+siblings"]
    q, k, v = make_inputs(layout, 2, 2, torch.float64)
    with torch.no_grad():
        ref = reference_attention(q, k, v, layout, scale=0.05)
        assert rel_err(merge_attention(q, k, v, layout, scale=0.05), ref) < 1e-12
        assert rel_err(merge_attention(q, k, v, layout), ref) > 1e-3
        assert math.isclose(rel_err(packed_attention(q, k, v, layout, scale=0.05), ref), 0.0, abs_tol=1e-12)
