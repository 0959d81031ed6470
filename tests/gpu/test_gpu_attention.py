"""GPU checks of the attention kernels, backends, bf16/fp16 schedules and the bench (skipped without CUDA).

Tolerance discipline of flash-attention's tests/test_flash_attn.py: in bf16/fp16 a fast path may not be bit-close to
anything, so its error against a float64 reference must be at most 2x the error of a plain PyTorch implementation
(reference_attention / the naive schedule) in the SAME dtype, for the output and for every gradient.
UNTESTED here so far (no GPU was lent while writing them): examples/bench_gpu.sh runs them first.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_branch.attention import AttentionLayout, reference_attention
from megatron_branch.attention.dispatch import attention
from megatron_branch.attention.kernels import fused_kernel_name
from megatron_branch.attention.layout import QuerySegment
from megatron_branch.attention.plan_sources import plan_from_layout

pytestmark = pytest.mark.gpu
DEV = "cuda"
HALF = [torch.bfloat16, torch.float16]


def layouts() -> dict[str, AttentionLayout]:
    sib = AttentionLayout.shared_prefix(96, [40, 40, 40, 24, 17])  # equal-length runs and odd lengths
    forest = AttentionLayout(
        num_queries=80,
        num_keys=80,
        segments=(
            QuerySegment(q_start=0, q_end=30, self_k_start=0),
            QuerySegment(q_start=30, q_end=50, ancestor_ranges=((0, 30),), self_k_start=30),
            QuerySegment(q_start=50, q_end=65, ancestor_ranges=((0, 30), (30, 50)), self_k_start=50),
            QuerySegment(q_start=65, q_end=80, self_k_start=65),
        ),
    )
    return {"siblings": sib, "forest": forest}


def inputs(layout: AttentionLayout, n: int = 8, g: int = 2, h: int = 64, seed: int = 0):  # noqa: ANN201
    gen = torch.Generator(device=DEV).manual_seed(seed)
    shapes = [(layout.num_queries, 1, n, h), (layout.num_keys, 1, g, h), (layout.num_keys, 1, g, h)]
    return [torch.randn(s, generator=gen, device=DEV, dtype=torch.float64) for s in shapes]


def errors(fn, q, k, v, layout, dout, dtype):  # noqa: ANN001, ANN201
    """Max abs error of (out, dq, dk, dv) of fn in `dtype` against the float64 reference."""
    leaves64 = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*leaves64, layout)
    want = [ref, *torch.autograd.grad(ref, leaves64, dout)]
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, layout)
    got = [out, *torch.autograd.grad(out, leaves, dout.to(dtype))]
    return [(a.double() - b).abs().max().item() for a, b in zip(got, want)]


def test_fused_kernel_on_cuda_is_a_flash_kernel() -> None:
    q = torch.zeros(1, 2, 8, 64, device=DEV, dtype=torch.bfloat16)
    assert fused_kernel_name(q) in ("cuda-flash", "flash-attn")
    assert fused_kernel_name(q.float()) == "math"


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("backend", ["merge", "flex"])  # not "repeat": a baseline whose bf16 prefix dK/dV sum
# the G repeated copies in bf16 (autograd's expand backward), measured up to ~3x PyTorch's error on CPU
@pytest.mark.parametrize("name", ["siblings", "forest"])
def test_backend_error_at_most_twice_pytorch_in_same_dtype(
    backend: str, name: str, dtype: torch.dtype
) -> None:
    layout = layouts()[name]
    q, k, v = inputs(layout)
    gen = torch.Generator(device=DEV).manual_seed(7)
    dout = torch.randn(layout.num_queries, 1, 8 * 64, generator=gen, device=DEV, dtype=torch.float64)
    ours = errors(lambda *a: attention(*a, backend=backend), q, k, v, layout, dout, dtype)
    plain = errors(reference_attention, q, k, v, layout, dout, dtype)
    for what, a, b in zip(("out", "dq", "dk", "dv"), ours, plain):
        assert a <= 2 * b + 1e-5, f"{backend} {what}: error {a:.3e} > 2 x PyTorch's {b:.3e}"


def plain_window_sink(q, k, v, sink, layout, window):  # noqa: ANN001, ANN201
    """Plain PyTorch in the input dtype (reference_attention's einsums) with the window's mask and the sink as an
    extra softmax column (transformers' gpt_oss eager attention): the same-dtype baseline."""
    sq, b, n, h = q.shape
    g = k.shape[2]
    qg = q.reshape(sq, b, g, n // g, h)
    s = torch.einsum("qbgrh,kbgh->bgrqk", qg, k) * h**-0.5  # [b, g, r, sq, sk]
    s = s.masked_fill(~plan_from_layout(layout, window=window).dense_mask(q.device), float("-inf"))
    col = sink.reshape(1, g, n // g, 1, 1).expand(b, g, n // g, sq, 1)
    p = torch.softmax(torch.cat([s, col], -1), dim=-1)[..., :-1]
    return torch.einsum("bgrqk,kbgh->qbgrh", p, v).reshape(sq, b, n * h)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("backend", ["merge", "flex"])
def test_window_and_sink_error_at_most_twice_pytorch(backend: str, dtype: torch.dtype) -> None:
    """gpt-oss's sliding window (17 positions: it ends inside the forest's ancestors) and learned sinks, with the
    discipline above: the float64 truth is the reference executor with the same window and sink
    (tests/unit/test_window_sink.py holds that to transformers' gpt_oss eager attention)."""
    layout = layouts()["forest"]
    q, k, v = inputs(layout, seed=2)
    gen = torch.Generator(device=DEV).manual_seed(9)
    sink = torch.randn(8, generator=gen, device=DEV, dtype=torch.float64)
    dout = torch.randn(layout.num_queries, 1, 8 * 64, generator=gen, device=DEV, dtype=torch.float64)

    def run(fn, dt: torch.dtype) -> list[torch.Tensor]:  # noqa: ANN001
        leaves = [t.to(dt).requires_grad_() for t in (q, k, v, sink)]
        out = fn(*leaves)
        return [x.double() for x in (out, *torch.autograd.grad(out, leaves, dout.to(dt)))]

    def executor(name: str):  # noqa: ANN202
        return lambda q, k, v, s: attention(q, k, v, layout, backend=name, window=17, sink=s)

    truth = run(executor("reference"), torch.float64)
    ours, plain = (
        [(a - b).abs().max().item() for a, b in zip(run(fn, dtype), truth)]
        for fn in (executor(backend), lambda *a: plain_window_sink(*a, layout, 17))
    )
    for what, a, b in zip(("out", "dq", "dk", "dv", "dsink"), ours, plain):
        assert a <= 2 * b + 1e-5, f"{backend} {what}: error {a:.3e} > 2 x PyTorch's {b:.3e}"


@pytest.mark.parametrize("dtype", HALF)
def test_merge_over_key_blocks_in_half(dtype: torch.dtype) -> None:
    """Replay's call: cached ancestor blocks + the chunk's own K/V, read in place."""
    layout = AttentionLayout(
        num_queries=48,
        num_keys=48 + 96,
        segments=(
            QuerySegment(q_start=0, q_end=24, ancestor_ranges=((0, 96),), self_k_start=96),
            QuerySegment(q_start=24, q_end=48, ancestor_ranges=((0, 96),), self_k_start=120),
        ),
    )
    q, k, v = inputs(layout, seed=1)
    gen = torch.Generator(device=DEV).manual_seed(8)
    dout = torch.randn(48, 1, 8 * 64, generator=gen, device=DEV, dtype=torch.float64)

    def blocks(q, k, v, layout):  # noqa: ANN001, ANN202
        return attention(q, [k[:40], k[40:96], k[96:]], [v[:40], v[40:96], v[96:]], layout, backend="merge")

    ours = errors(blocks, q, k, v, layout, dout, dtype)
    plain = errors(reference_attention, q, k, v, layout, dout, dtype)
    for what, a, b in zip(("out", "dq", "dk", "dv"), ours, plain):
        assert a <= 2 * b + 1e-5, f"{what}: error {a:.3e} > 2 x PyTorch's {b:.3e}"


def test_flex_backward_on_cuda_float32() -> None:
    layout = layouts()["forest"]
    q, k, v = (t.float().requires_grad_() for t in inputs(layout, seed=2))
    out = attention(q, k, v, layout, backend="flex")
    ref = reference_attention(q, k, v, layout)
    gen = torch.Generator(device=DEV).manual_seed(9)
    dout = torch.randn(ref.shape, generator=gen, device=DEV, dtype=ref.dtype)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("schedule", ["replay", "packed", "naive-fused"])
def test_bf16_schedule_error_at_most_twice_naive_bf16(schedule: str) -> None:
    """Whole model: a schedule's bf16 gradients vs float64 naive, at most 2x the error of naive in bf16."""
    from megatron_branch.data import PrefixTree
    from megatron_branch.losses import PolicyGradientObjective
    from megatron_branch.models import ModelArch, build_model
    from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
    from megatron_branch.schedule import ScheduleOptions, run_schedule
    from megatron_branch.testing import random_tree_rollouts

    initialize_parallel(ParallelConfig())
    arch = ModelArch(
        family="llama", vocab_size=97, hidden_size=128, num_layers=2, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=256,
    )  # fmt: skip
    torch.manual_seed(0)
    m64 = build_model(arch, dtype=torch.float64).to(DEV)
    m16 = build_model(arch, dtype=torch.bfloat16).to(DEV)
    with torch.no_grad():
        for a, b in zip(m16.parameters(), m64.parameters()):
            a.copy_(b)
    rs = random_tree_rollouts(vocab_size=97, prompt_len=200, branches=4, levels=2, seg_len=(8, 24), seed=3)
    tree = PrefixTree.build(rs, vocab_size=97)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rs], tree.num_response_tokens_logical())

    def grads(model, name):  # noqa: ANN001, ANN202
        model.zero_grad(set_to_none=True)
        run_schedule(name, model, tree, obj, ScheduleOptions(vocab_size=97, chunk_tokens=None))
        return [p.grad.double() for p in model.parameters()]

    ref = grads(m64, "naive")
    plain = grads(m16, "naive")
    ours = grads(m16, schedule)
    for i, (r, p, o) in enumerate(zip(ref, plain, ours)):
        e_ours, e_plain = (o - r).norm().item(), (p - r).norm().item()
        assert e_ours <= 2 * e_plain + 1e-6 * r.norm().item(), f"param {i}: {e_ours:.3e} > 2 x {e_plain:.3e}"


def test_bench_runs_on_cuda_in_bf16(tmp_path) -> None:  # noqa: ANN001
    from megatron_branch.cli import main

    out = tmp_path / "b.json"
    rc = main(["bench", "--preset", "tiny", "--device", "cuda", "--dtype", "bfloat16", "--rounds", "1",
               "--peak-tflops", "989", "--json", str(out)])  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert all(r["cuda_peak_mb"] > 0 and r["mfu"] is not None for r in rows)
