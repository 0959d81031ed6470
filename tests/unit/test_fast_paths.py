"""The fast paths, asserted on deterministic quantities: which rows reach the output projection, how many fused
kernel calls the merge plan makes, masks built once per layout, and the baselines' exactness (PrefixGrouper's
repeated-prefix backend, the unshared schedules)."""

from __future__ import annotations

import pytest
import torch

from megatron_branch.attention import AttentionLayout, reference_attention
from megatron_branch.attention.dispatch import attention
from megatron_branch.attention.layout import QuerySegment
from megatron_branch.attention.plan_sources import plan_from_layout
from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule
from megatron_branch.schedule import common as common_mod
from megatron_branch.testing import random_tree_rollouts

VOCAB = 23


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    initialize_parallel(ParallelConfig())
    arch = ModelArch(
        family="llama",
        vocab_size=VOCAB,
        hidden_size=16,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=32,
    )
    torch.manual_seed(0)
    m = build_model(arch, dtype=torch.float64)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return m


def rollouts() -> list[Rollout]:
    rs = random_tree_rollouts(vocab_size=VOCAB, prompt_len=11, branches=3, levels=2, seed=5)
    # a rollout whose PROMPT is another's prompt + response start: those tokens carry a loss for the other one only
    first = rs[0]
    rs.append(Rollout(prompt=first.prompt + first.response[:2], response=[1, 2, 3], advantage=0.7))
    return rs


def step(model: torch.nn.Module, rs: list[Rollout], schedule: str, **kw: object):  # noqa: ANN201
    tree = PrefixTree.build(rs, vocab_size=VOCAB)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rs], tree.num_response_tokens_logical())
    model.zero_grad(set_to_none=True)
    res = run_schedule(
        schedule,
        model,
        tree,
        obj,
        ScheduleOptions(vocab_size=VOCAB, keep_logprobs=True, **{"chunk_tokens": None, **kw}),
    )
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return tree, res, grads


@pytest.mark.parametrize("schedule", ["packed", "replay", "naive-fused", "packed-nosharing"])
def test_only_response_rows_reach_the_output_projection(
    model: torch.nn.Module, schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[torch.Tensor] = []  # target token ids of every row that reached the projection

    def spy(hidden, weight, target, **kw):  # noqa: ANN001, ANN202
        assert hidden.shape[0] == target.shape[0]
        seen.append(target.clone())
        return real(hidden, weight, target, **kw)

    real = common_mod.fused_linear_logprobs_entropy
    monkeypatch.setattr(
        common_mod, "fused_linear_logprobs_entropy", spy
    )  # every schedule projects in common.row_logprobs
    rs = rollouts()
    tree, _, _ = step(model, rs, schedule, branch_micro_batch=2)
    rows = int(sum(t.numel() for t in seen))
    if schedule in ("packed", "replay"):
        # one row per distinct token that is in some rollout's response (each has a predecessor here)
        want = int((tree.response_counts() > 0).sum())
    else:  # one row per response token of each rollout
        want = sum(len(r.response) for r in rs)
    assert rows == want
    # and never a prompt-only row: a long shared prompt sends none of its P rows through the vocabulary
    assert (
        rows < tree.positions_computed if schedule in ("packed", "replay") else rows < tree.positions_logical
    )


@pytest.mark.parametrize("schedule", ["naive-fused", "packed-nosharing", "packed", "replay"])
def test_schedules_match_naive_float64(model: torch.nn.Module, schedule: str) -> None:
    rs = rollouts()
    _, base, base_grads = step(model, rs, "naive")
    kw = {"backend": "repeat"} if schedule == "packed" else {}
    _, res, grads = step(model, rs, schedule, **kw)
    assert res.loss == pytest.approx(base.loss, rel=1e-10)
    torch.testing.assert_close(res.target_logprobs, base.target_logprobs, rtol=0, atol=1e-12, equal_nan=True)
    for name, g in base_grads.items():
        assert (grads[name] - g).norm() <= 1e-9 * g.norm().clamp_min(1e-12), name


def layout_with_runs() -> AttentionLayout:
    """prefix 6 | 3 siblings of 4 | 2 siblings of 3 (own keys after the prefix) | an unrelated causal segment."""
    segs = [QuerySegment(q_start=0, q_end=6, self_k_start=0)]
    start = 6
    for n in (4, 4, 4, 3, 3):
        segs.append(
            QuerySegment(q_start=start, q_end=start + n, ancestor_ranges=((0, 6),), self_k_start=start)
        )
        start += n
    segs.append(QuerySegment(q_start=start, q_end=start + 5, self_k_start=start))
    return AttentionLayout(num_queries=start + 5, num_keys=start + 5, segments=tuple(segs))


def merge_attention(q, k, v, layout, scale=None):  # noqa: ANN001, ANN201
    return attention(q, k, v, layout, backend="merge", scale=scale)


def test_merge_plan_batches_equal_length_siblings() -> None:
    layout = layout_with_runs()
    plan = plan_from_layout(layout)
    # causal: the prefix and the unrelated segment (not adjacent: 2 calls); full: one call over the prefix for all
    # 5 siblings; one batched causal call for the 3 of length 4 and one for the 2 of length 3
    assert plan.kernel_calls == 2 + 1 + 2
    assert len(plan.full) == 1 and plan.full[0].num_rows == 18 and len(plan.full[0].pieces) == 1
    assert [(r.size, r.count) for r in plan.causal] == [(6, 1), (4, 3), (3, 2), (5, 1)]
    # unshared packing of G equal-length rollouts: ONE causal call
    flat = AttentionLayout(
        num_queries=40,
        num_keys=40,
        segments=tuple(QuerySegment(q_start=i, q_end=i + 5, self_k_start=i) for i in range(0, 40, 5)),
    )
    assert plan_from_layout(flat).kernel_calls == 1
    # replay: cached prefix block + chunk block, the prefix range read from the first block
    leaf = AttentionLayout(
        num_queries=8,
        num_keys=14,
        segments=(
            QuerySegment(q_start=0, q_end=4, ancestor_ranges=((0, 6),), self_k_start=6),
            QuerySegment(q_start=4, q_end=8, ancestor_ranges=((0, 6),), self_k_start=10),
        ),
    )
    assert plan_from_layout(leaf, [6, 8]).kernel_calls == 2


@pytest.mark.parametrize("backend", ["merge", "repeat"])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (4, 1)])
def test_backend_matches_reference_float64(backend: str, heads: tuple[int, int]) -> None:
    layout = layout_with_runs()
    n, g = heads
    gen = torch.Generator().manual_seed(3)
    s = layout.num_queries
    q = torch.randn(s, 1, n, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(s, 1, g, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(s, 1, g, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = reference_attention(q, k, v, layout, 0.3)
    out = attention(q, k, v, layout, backend=backend, scale=0.3)
    dout = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    got = torch.autograd.grad(out, (q, k, v), dout)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_masks_and_plans_built_once_per_layout() -> None:
    layout = layout_with_runs()
    assert layout.dense_mask() is layout.dense_mask()  # every layer of a chunk reuses the first layer's mask
    q = torch.randn(layout.num_queries, 1, 2, 4, dtype=torch.float64)
    merge_attention(q, q, q, layout)
    plans = [key for key in layout._derived if key[0] == "plan"]
    merge_attention(q, q, q, layout)
    assert plans == [key for key in layout._derived if key[0] == "plan"] and len(plans) == 1
    # equality and hashing ignore what was derived
    assert layout == layout_with_runs() and hash(layout) == hash(layout_with_runs())


def test_flex_metadata_mask_equals_dense_mask() -> None:
    """The flex executor's per-token metadata (no [sq, sk] tensor) gives exactly the layout's visibility."""
    from megatron_branch.attention.flex import _mask_mod, visibility_metadata
    from megatron_branch.schedule.chunks import make_chunk

    tree = PrefixTree.build(rollouts())
    leaf = next(s for s in tree.segments if not s.children and s.depth == 2)
    layouts = [
        layout_with_runs(),
        make_chunk(tree, range(len(tree.segments))).layout,  # the packed tree
        make_chunk(tree, [leaf.id], external=leaf.ancestors, pad_to_multiple=4).layout,  # replay: cached keys
    ]
    for layout in layouts:
        mod = _mask_mod(visibility_metadata(plan_from_layout(layout), "cpu"))
        qi = torch.arange(layout.num_queries)[:, None]
        ki = torch.arange(layout.num_keys)[None, :]
        assert torch.equal(mod(0, 0, qi, ki), layout.dense_mask())
