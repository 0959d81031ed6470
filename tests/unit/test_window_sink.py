"""Sliding windows and attention sinks (gpt-oss) in THE plan and every executor on one rank.

A tree's attention with a window W (path positions: a token sees the last W positions of its OWN root-to-leaf path)
and learned per-head sinks equals transformers' gpt_oss `eager_attention_forward` run per rollout with HF's own
sliding-window mask function, output and gradients (q, k, v, and the sinks) in float64 at 1e-9, float32 at 1e-5; on
replay chunks whose ancestors come as cached key blocks it equals a slow dense oracle (the layout's mask AND the
window over the tokens' position ids, the sink as an extra softmax column). The windows are smaller than the tree's
depth: some branches' windows reach into their ancestors, some do not reach them at all. The plan covers every
visible pair once, counts them exactly, and never reads a key block wholly outside every row's window. Planted
bugs (the sink counted once per key block, the sink's gradient dropped, the window ignored for branch tokens over
their ancestors) each fail.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_visibility import _coverage
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from megatron_branch.attention import executor as executor_mod
from megatron_branch.attention import plan as plan_mod
from megatron_branch.attention.dispatch import attention
from megatron_branch.attention.merge import add_sink
from megatron_branch.attention.plan_sources import plan_from_layout
from megatron_branch.data import PrefixTree
from megatron_branch.schedule.chunks import make_chunk
from megatron_branch.testing import random_tree_rollouts

N_HEADS, N_KV, HEAD = 4, 2, 8
WINDOWS = (1, 3, 6, None)  # the tree below is up to ~30 positions deep: 3 and 6 end inside ancestors
EXECUTORS = ("merge", "packed", "reference")


def _tree() -> PrefixTree:
    rs = random_tree_rollouts(groups=2, prompt_len=6, branches=3, levels=3, seg_len=(1, 6), seed=1)
    return PrefixTree.build(rs, vocab_size=37)


def _rows(tree: PrefixTree, seg: int) -> torch.Tensor:
    s = tree.segments[seg]
    return torch.arange(s.offset, s.offset + s.length)


def _positions(tree: PrefixTree) -> torch.Tensor:
    """[N] path position of every packed tree token."""
    pos = torch.zeros(sum(s.length for s in tree.segments), dtype=torch.long)
    for s in tree.segments:
        pos[s.offset : s.offset + s.length] = torch.arange(s.start_position, s.start_position + s.length)
    return pos


def _tensors(n_tokens: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = dict(q=(n_tokens, 1, N_HEADS, HEAD), k=(n_tokens, 1, N_KV, HEAD), v=(n_tokens, 1, N_KV, HEAD))
    out = {name: torch.randn(shape, generator=gen, dtype=torch.float64) for name, shape in shapes.items()}
    out["sink"] = torch.randn(N_HEADS, generator=gen, dtype=torch.float64)
    return {name: x.to(dtype).requires_grad_() for name, x in out.items()}


def _hf_per_rollout(tree: PrefixTree, t: dict[str, torch.Tensor], window: int | None):  # noqa: ANN202
    """[(packed indices [T], HF eager output [T, n*h])] per rollout: transformers' gpt_oss attention, unchanged."""
    module = SimpleNamespace(num_key_value_groups=N_HEADS // N_KV, sinks=t["sink"], training=False)
    mask_fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    out = []
    for i in range(len(tree.rollouts)):
        idx = tree.rollout_indices(i)
        ar = torch.arange(len(idx))
        allowed = mask_fn(ar.new_zeros(()), ar.new_zeros(()), ar[:, None], ar[None, :])  # [T, T]
        additive = torch.zeros(allowed.shape, dtype=t["q"].dtype).masked_fill(~allowed, float("-inf"))
        q, k, v = (t[x][idx].permute(1, 2, 0, 3) for x in "qkv")  # [1, heads, T, h]
        o, _ = eager_attention_forward(module, q, k, v, additive[None, None], HEAD**-0.5)  # [1, T, n, h]
        out.append((idx, o[0].reshape(len(idx), N_HEADS * HEAD)))
    return out


def _tree_vs_hf(tree: PrefixTree, t: dict[str, torch.Tensor], window: int | None, backend: str):  # noqa: ANN202
    """(max |diff| of outputs, per-tensor (tree grad, HF grad)) for the whole tree packed in one chunk."""
    chunk = make_chunk(tree, [s.id for s in tree.segments], targets="all")
    rows = chunk.token_index
    got = attention(
        t["q"][rows], t["k"][rows], t["v"][rows], chunk.layout, backend=backend, window=window, sink=t["sink"]
    )[:, 0]  # [N, n*h]
    hf = _hf_per_rollout(tree, t, window)
    gen = torch.Generator().manual_seed(5)
    douts = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) for _, o in hf]
    tree_dout = torch.zeros_like(got)  # a shared row receives the sum of every rollout's gradient
    for (idx, _), d in zip(hf, douts):
        tree_dout.index_add_(0, torch.searchsorted(rows, idx), d)
    err = max((got[torch.searchsorted(rows, idx)] - o).abs().max().item() for idx, o in hf)
    names = ("q", "k", "v", "sink")
    mine = torch.autograd.grad(got, [t[x] for x in names], tree_dout)
    want = torch.autograd.grad([o for _, o in hf], [t[x] for x in names], douts)
    return err, list(zip(names, mine, want))


@pytest.mark.parametrize("backend", EXECUTORS)
def test_tree_equals_hf_gpt_oss_eager_per_rollout(backend: str) -> None:
    tree = _tree()
    for window in WINDOWS:
        t = _tensors(sum(s.length for s in tree.segments), torch.float64)
        err, grads = _tree_vs_hf(tree, t, window, backend)
        assert err < 1e-12, (window, err)
        for name, mine, want in grads:
            torch.testing.assert_close(mine, want, rtol=1e-9, atol=1e-9, msg=f"{name} W={window}")


def test_float32_equals_hf_at_1e_5() -> None:
    tree = _tree()
    t = _tensors(sum(s.length for s in tree.segments), torch.float32)
    err, grads = _tree_vs_hf(tree, t, 3, "merge")
    assert err < 1e-5
    for name, mine, want in grads:
        torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-5, msg=name)


def _replay_chunks(tree: PrefixTree):  # noqa: ANN202
    """(chunk, its ancestors' segment ids = its cached key blocks) for every segment with children."""
    for s in tree.segments:
        if s.children:
            ext = s.ancestors + (s.id,)
            yield make_chunk(tree, list(s.children), external=ext, targets="all"), ext


def _oracle(t, pos, qrows, krows, layout, window):  # noqa: ANN001, ANN202
    """Slow dense oracle: the layout's mask AND the window over position ids; the sink an extra column."""
    mask = layout.dense_mask()
    if window is not None:
        mask = mask & ((pos[qrows][:, None] - pos[krows][None, :]) < window)
    r = N_HEADS // N_KV
    q = t["q"][qrows].permute(1, 2, 0, 3)  # [1, n, sq, h]
    k, v = (t[x][krows].repeat_interleave(r, dim=2).permute(1, 2, 0, 3) for x in "kv")  # [1, n, sk, h]
    s = (q @ k.transpose(-1, -2) * HEAD**-0.5).masked_fill(~mask, float("-inf"))
    s = torch.cat([s, t["sink"].view(1, N_HEADS, 1, 1).expand(1, N_HEADS, len(qrows), 1)], -1)
    return (torch.softmax(s, -1)[..., :-1] @ v).permute(2, 0, 1, 3).reshape(len(qrows), 1, N_HEADS * HEAD)


@pytest.mark.parametrize("backend", EXECUTORS)
def test_replay_chunks_over_cached_blocks_equal_the_oracle(backend: str) -> None:
    tree = _tree()
    pos = _positions(tree)
    t = _tensors(len(pos), torch.float64, seed=2)
    names = ("q", "k", "v", "sink")
    for window in WINDOWS[:3]:
        for chunk, ext in _replay_chunks(tree):
            qrows = chunk.token_index
            blocks = [_rows(tree, a) for a in ext] + [
                qrows
            ]  # cached ancestors, then the chunk: read in place
            want = _oracle(t, pos, qrows, torch.cat(blocks), chunk.layout, window)
            ks, vs = [t["k"][b] for b in blocks], [t["v"][b] for b in blocks]
            got = attention(
                t["q"][qrows], ks, vs, chunk.layout, backend=backend, window=window, sink=t["sink"]
            )
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
            dout = torch.randn(got.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
            mine = torch.autograd.grad(got, [t[x] for x in names], dout)
            theirs = torch.autograd.grad(want, [t[x] for x in names], dout)
            for name, a, b in zip(names, mine, theirs):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=f"{name} W={window}")


def test_flex_forward_with_window_and_sink() -> None:
    """flex is forward-only on CPU (torch refuses its backward): its windowed mask and the sink, under no_grad."""
    tree = _tree()
    pos = _positions(tree)
    t = {x: y.detach() for x, y in _tensors(len(pos), torch.float64, seed=4).items()}
    for chunk, ext in list(_replay_chunks(tree))[1:2]:
        qrows = chunk.token_index
        blocks = [_rows(tree, a) for a in ext] + [qrows]
        want = _oracle(t, pos, qrows, torch.cat(blocks), chunk.layout, 3)
        ks, vs = [t["k"][b] for b in blocks], [t["v"][b] for b in blocks]
        got = attention(t["q"][qrows], ks, vs, chunk.layout, backend="flex", window=3, sink=t["sink"])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_repeat_baseline_refuses_windows_and_sinks() -> None:
    chunk = make_chunk(_tree(), [0])
    x = torch.zeros(chunk.layout.num_queries, 1, N_KV, HEAD)
    for kw in (dict(window=3), dict(sink=torch.zeros(N_KV))):
        with pytest.raises(ValueError, match="no sliding window or sink"):
            attention(x, x, x, chunk.layout, backend="repeat", **kw)


def test_windowed_plan_covers_once_counts_exactly_and_skips_blocks() -> None:
    tree = _tree()
    pos = _positions(tree)
    skipped = reached = 0
    for window in WINDOWS[:3]:
        for chunk, ext in _replay_chunks(tree):
            blocks = [_rows(tree, a) for a in ext] + [chunk.token_index]
            sizes = [len(b) for b in blocks]
            plan = plan_from_layout(chunk.layout, sizes, window=window)
            krows, qrows = torch.cat(blocks), chunk.token_index
            mask = chunk.layout.dense_mask() & ((pos[qrows][:, None] - pos[krows][None, :]) < window)
            assert torch.equal(_coverage(plan, plan.num_queries, plan.num_keys), mask.long()), (window, ext)
            assert plan.visible_pairs == int(mask.sum())
            read = {p.block for g in plan.full for p in g.pieces} | {r.block for r in plan.causal}
            read |= {b.block for b in plan.bands}
            for j, cols in enumerate(torch.split(mask, sizes, dim=1)):
                if not cols.any():  # a cached ancestor wholly outside every row's window: never read
                    assert j not in read
                    skipped += 1
                else:
                    reached += j < len(ext)
            # the band tiles compute at most 2W - 1 keys per row (the window's edge)
            assert all(b.cols <= b.rows + window - 1 for b in plan.bands)
    assert skipped > 10 and reached > 10, (skipped, reached)  # both cases occur in this tree


def test_windowed_plan_over_blocks_cut_through_segments() -> None:
    """Key blocks cut anywhere (a segment's own keys in two blocks: runs with offsets > 0) still cover once."""
    tree = _tree()
    chunk = make_chunk(tree, [s.id for s in tree.segments], targets="all")
    rows, pos = chunk.token_index, _positions(tree)
    gen = torch.Generator().manual_seed(7)
    for window in (2, 5):
        for _ in range(4):
            cuts = sorted({int(x) for x in torch.randint(1, len(rows), (5,), generator=gen)})
            sizes = [b - a for a, b in zip([0, *cuts], [*cuts, len(rows)])]
            plan = plan_from_layout(chunk.layout, sizes, window=window)
            mask = chunk.layout.dense_mask() & ((pos[rows][:, None] - pos[rows][None, :]) < window)
            assert torch.equal(_coverage(plan, plan.num_queries, plan.num_keys), mask.long()), (window, sizes)


# --- planted bugs: each breaks the comparison with HF -------------------------------------------------------------
def _sink_per_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sink merged once per key block (here: twice) instead of once per row."""
    monkeypatch.setattr(executor_mod, "add_sink", lambda o, lse, s: add_sink(*add_sink(o, lse, s), s))


def _sink_grad_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(executor_mod, "sink_grad", lambda dout, out, lse, sink: torch.zeros_like(sink))


def _window_ignored_over_ancestors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A branch token sees its ancestors in full whatever the window (d >= n: an ancestor key run)."""
    real = plan_mod.split_rows
    monkeypatch.setattr(plan_mod, "split_rows", lambda m, n, d, w: (m, m) if d >= n else real(m, n, d, w))


@pytest.mark.parametrize("plant", [_sink_per_block, _sink_grad_dropped, _window_ignored_over_ancestors])
def test_planted_bugs_fail(plant, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    tree = _tree()
    plant(monkeypatch)
    t = _tensors(sum(s.length for s in tree.segments), torch.float64)
    err, grads = _tree_vs_hf(tree, t, 3, "merge")
    worst = max(err, *((a - b).abs().max().item() for _, a, b in grads))
    assert worst > 1e-3, worst
