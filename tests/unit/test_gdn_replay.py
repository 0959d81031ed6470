"""Branch replay through a hybrid model's gated delta net: every tree segment continues from its parent's recurrent
state and conv tail (models/gdn.py BranchGatedDeltaNet, models/gdn_tree.py), packed and replay against naive and HF.

Precision: megatron's torch_chunk_gated_delta_rule computes in float32 whatever the model dtype, in chunks of 64
positions that start at each segment's first token in a tree schedule and at the rollout's first token in naive:
the same math in a different float32 rounding. Measured on `rollouts()` (tree vs naive, worst parameter, relative):
float32 replay 4.1e-6, packed 5.6e-6 (naive vs HF: 3.9e-6); float64 replay = packed 8.1e-7 (vs HF 1.5e-6); the
unshared baselines, chunked as naive, are float64-exact (<= 1e-15). Logprobs: float32 <= 2.4e-6, float64 1.2e-7.
Tested at BOUND = 1e-5 for both dtypes, as tests/unit/test_hybrid_models.py tests naive against HF.
"""

from __future__ import annotations

import pytest
import torch
from gdn_helpers import plant_start_bug, rollouts
from test_hybrid_models import megatron_of

from megatron_branch.checkpoint import mcore_to_hf_state
from megatron_branch.checkpoint.tp import gather_full_grads
from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.models.gdn_tree import (
    GDN_STATE,
    GDNDims,
    Rows,
    conv_with_tail,
    delta_rule_segments,
)
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule, score_rollouts
from megatron_branch.schedule.prefix_cache import PrefixCache
from megatron_branch.testing import exact_hf_norms, hf_policy_gradient, tiny_hf_config, tiny_hf_model

BOUND = 1e-5
LAYERS = ("linear_attention", "full_attention", "linear_attention")  # GDN -> attention -> GDN


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def hybrid(dtype: torch.dtype, seed: int = 5):  # noqa: ANN201
    cfg = tiny_hf_config("qwen3_5", num_layers=3, ffn=48, layer_types=LAYERS)
    return exact_hf_norms(tiny_hf_model(cfg, seed=seed, dtype=dtype))


def step(model: torch.nn.Module, arch, schedule: str, rs: list[Rollout], **kw):  # noqa: ANN001, ANN201
    tree = PrefixTree.build(rs, vocab_size=arch.vocab_size)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rs], tree.num_response_tokens_logical())
    model.zero_grad(set_to_none=True)
    opts = ScheduleOptions(vocab_size=arch.vocab_size, keep_logprobs=True, **{"chunk_tokens": None, **kw})
    res = run_schedule(schedule, model, tree, obj, opts)
    return res, mcore_to_hf_state(gather_full_grads(model, None), arch)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert got.keys() == want.keys()
    return max((rel(got[n], w), n) for n, w in want.items())


@pytest.fixture(scope="module")
def fp32():  # noqa: ANN201
    hf = hybrid(torch.float32)
    arch, model = megatron_of(hf, torch.float32)
    rs = rollouts()
    tree = PrefixTree.build(rs, vocab_size=arch.vocab_size)
    assert tree.max_depth >= 3 and any(s.length < 3 for s in tree.segments)
    return hf, arch, model, rs, step(model, arch, "naive", rs)


# --- the segment kernel -------------------------------------------------------------------------------------------------
def test_conv_tail_is_the_last_inputs_along_the_path() -> None:
    g = torch.Generator().manual_seed(0)
    x, tail = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 3, generator=g)
    conv = torch.nn.Conv1d(3, 3, 4, groups=3, padding=3, bias=True)  # megatron's GatedDeltaNet.conv1d
    w = (conv.weight, conv.bias)
    out, new = conv_with_tail(x, tail, torch.tensor([5, 1]), w, roots=False)
    full = torch.cat([tail, x], -1)
    torch.testing.assert_close(new[0], x[0, :, 2:5], rtol=0, atol=0)
    torch.testing.assert_close(
        new[1], full[1, :, 1:4], rtol=0, atol=0
    )  # 1 input: 2 of the parent's tail kept
    # the conv over the path's inputs: every output sees the K-1 inputs before it
    with torch.no_grad():
        want = torch.nn.functional.conv1d(full, conv.weight, conv.bias, groups=3)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
        # a root: megatron's own call, bit for bit
        root, _ = conv_with_tail(x, torch.zeros_like(tail), torch.tensor([5, 5]), w, roots=True)
        assert torch.equal(root, conv(x)[..., :5])


def test_padded_siblings_equal_each_alone() -> None:
    """Right padding with beta = g = 0 leaves each row's state and tail exactly as that row alone would."""
    from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

    from megatron_branch.compat.gdn import l2norm

    dims = GDNDims(qk=8, v=16, heads_k=1, heads_v=2, dk=8, dv=8, kernel=4)
    g0 = torch.Generator().manual_seed(1)
    s, cd = 80, 32
    qkv, beta = torch.randn(s, cd, generator=g0), torch.rand(s, 2, generator=g0)
    g = -torch.rand(s, 2, generator=g0)
    conv = torch.nn.Conv1d(cd, cd, 4, groups=cd, padding=3)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(cd, 1, 4, generator=g0))
        conv.bias.copy_(torch.randn(cd, generator=g0))
    spans = [(0, 1), (1, 3), (3, 73), (73, 80)]
    start = (torch.randn(4, 2, 8, 8, generator=g0) * 0.1, torch.randn(4, cd, 3, generator=g0))
    kw = dict(
        dims=dims, conv=(conv.weight, conv.bias), roots=False, act=torch.nn.functional.silu, l2norm=l2norm
    )
    out, (S, tail) = delta_rule_segments(
        qkv, g, beta, Rows.of(spans, qkv.device), start, rule=torch_chunk_gated_delta_rule, **kw
    )
    for j, sp in enumerate(spans):
        one = (start[0][j : j + 1], start[1][j : j + 1])
        o1, (S1, t1) = delta_rule_segments(
            qkv, g, beta, Rows.of([sp], qkv.device), one, rule=torch_chunk_gated_delta_rule, **kw
        )
        n = sp[1] - sp[0]
        torch.testing.assert_close(out[j, :n], o1[0], rtol=0, atol=2e-6)
        torch.testing.assert_close(S[j], S1[0], rtol=0, atol=2e-6)
        torch.testing.assert_close(tail[j], t1[0], rtol=0, atol=0)


# --- schedules against naive and HF -------------------------------------------------------------------------------------
def test_replay_equals_naive_on_a_small_tree() -> None:
    """The edit loop's check (the full trees below are slow): a fork at depth 2 and a 1-token segment."""
    arch, model = megatron_of(hybrid(torch.float32, seed=2), torch.float32)
    p = [3, 14, 15, 9, 2]
    rs = [
        Rollout(prompt=p, response=[6, 5, 3], advantage=1.0),
        Rollout(prompt=p, response=[6, 5, 8, 1], advantage=-0.5),
        Rollout(prompt=p, response=[7], advantage=0.4),
    ]
    base, naive = step(model, arch, "naive", rs)
    res, grads = step(model, arch, "replay", rs)
    assert res.loss == pytest.approx(base.loss, rel=BOUND) and worst(grads, naive)[0] <= BOUND


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,kw",
    [
        ("replay", {}),
        ("packed", {}),
        ("replay", {"branch_micro_batch": 1}),
        ("replay", {"recompute": True, "recompute_layers": True}),
        ("replay", {"chunk_tokens": 12}),
        ("packed-nosharing", {}),
        ("naive-fused", {}),
    ],
    ids=[
        "replay",
        "packed",
        "replay-mb1",
        "replay-recompute",
        "replay-chunk-tokens",
        "packed-nosharing",
        "naive-fused",
    ],  # fmt: skip
)
def test_tree_schedules_equal_naive_fp32(fp32, schedule: str, kw: dict) -> None:  # noqa: ANN001
    _, arch, model, rs, (base, naive) = fp32
    res, grads = step(model, arch, schedule, rs, **kw)
    assert res.loss == pytest.approx(base.loss, rel=BOUND)
    assert worst(grads, naive)[0] <= BOUND
    torch.testing.assert_close(res.target_logprobs, base.target_logprobs, rtol=0, atol=5e-6, equal_nan=True)
    if schedule == "replay" and not kw:
        assert res.positions_computed < base.positions_computed  # the prefixes ran once


@pytest.mark.slow
def test_replay_and_naive_match_hf_per_parameter(fp32) -> None:  # noqa: ANN001
    hf, arch, model, rs, (base, naive) = fp32
    hf_loss, want = hf_policy_gradient(hf, rs)
    res, grads = step(model, arch, "replay", rs)
    assert worst(naive, want)[0] <= BOUND and worst(grads, want)[0] <= BOUND
    assert res.loss == pytest.approx(hf_loss, rel=BOUND)


@pytest.mark.slow
def test_fp64_is_float32_exact() -> None:
    """The rule is float32 inside: float64 replay agrees with naive to its rounding (measured 1.2e-6)."""
    hf = hybrid(torch.float64)
    arch, model = megatron_of(hf, torch.float64)
    rs = rollouts()
    base, naive = step(model, arch, "naive", rs)
    res, grads = step(model, arch, "replay", rs)
    assert res.loss == pytest.approx(base.loss, rel=BOUND)
    assert worst(grads, naive)[0] <= BOUND
    _, want = hf_policy_gradient(hf, rs)
    assert worst(grads, want)[0] <= BOUND


@pytest.mark.slow
def test_scoring_equals_naive(fp32) -> None:  # noqa: ANN001
    _, arch, model, rs, _ = fp32
    tree = PrefixTree.build(rs, vocab_size=arch.vocab_size)
    opts = ScheduleOptions(vocab_size=arch.vocab_size, chunk_tokens=None)
    want = score_rollouts("naive", model, tree, opts)
    got = score_rollouts("replay", model, tree, opts)
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-6)


# --- planted bugs -------------------------------------------------------------------------------------------------------
def _forgetful_external(self: PrefixCache, path):  # noqa: ANN001, ANN202
    """A cache that forgets the gradient earlier siblings sent into the parent's GDN state (no accumulation)."""
    if path:
        for entry in self.entries[path[-1]].values():
            if entry.kind is GDN_STATE:
                for leaf in entry.trainable:
                    leaf.grad = None
    return _ORIGINAL_EXTERNAL(self, path)


_ORIGINAL_EXTERNAL = PrefixCache.external


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["zero_parent_state", "drop_parent_tail", "state_grad_not_accumulated"])
def test_planted_bugs_fail(fp32, bug: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    _, arch, model, rs, (_, naive) = fp32
    if bug == "state_grad_not_accumulated":
        monkeypatch.setattr(PrefixCache, "external", _forgetful_external)
    else:
        plant_start_bug(monkeypatch, bug)
    _, grads = step(model, arch, "replay", rs, branch_micro_batch=1)
    err, name = worst(grads, naive)
    assert err > 100 * BOUND, (bug, err, name)  # not a rounding-level difference
