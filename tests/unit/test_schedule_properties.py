"""Property test: on random rollout sets that share at random depths (duplicates, strict prefixes, empty prompts,
forests, one-token segments), packed, replay and the unshared baselines (naive-fused, packed-nosharing) give naive's
loss, logprobs and gradients in float64."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule
from megatron_branch.testing import rollout_set_strategy

VOCAB = 7


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    initialize_parallel(ParallelConfig())
    arch = ModelArch(
        family="qwen2",
        vocab_size=VOCAB,
        hidden_size=16,
        num_layers=2,
        num_attention_heads=2,
        num_query_groups=1,
        ffn_hidden_size=32,
        qkv_bias=True,
    )
    torch.manual_seed(0)
    m = build_model(arch, dtype=torch.float64)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))  # away from init symmetry: every gradient is non-trivial
    return m


def step(model: torch.nn.Module, rollouts: list[Rollout], schedule: str, **kw: object):  # noqa: ANN201
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    T = tree.num_response_tokens_logical()
    objective = PolicyGradientObjective.grpo([r.advantage for r in rollouts], T)
    model.zero_grad(set_to_none=True)
    res = run_schedule(
        schedule,
        model,
        tree,
        objective,
        ScheduleOptions(vocab_size=VOCAB, keep_logprobs=True, **{"chunk_tokens": None, **kw}),
    )
    grads = {
        n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()
    }
    return res, grads


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(rollouts=rollout_set_strategy(vocab=VOCAB), micro=st.integers(1, 3), recompute=st.booleans())
def test_replay_and_packed_equal_naive(
    model: torch.nn.Module, rollouts: list[Rollout], micro: int, recompute: bool
) -> None:
    base, base_grads = step(model, rollouts, "naive")
    for schedule, kw in (
        ("packed", {}),
        ("replay", {"branch_micro_batch": micro, "recompute": recompute}),
        ("naive-fused", {}),
        ("packed-nosharing", {}),
    ):
        res, grads = step(model, rollouts, schedule, **kw)
        assert res.loss == pytest.approx(base.loss, rel=1e-10, abs=1e-13)
        torch.testing.assert_close(
            res.target_logprobs, base.target_logprobs, rtol=0, atol=1e-12, equal_nan=True
        )
        for name, g in base_grads.items():
            scale = g.norm().item()
            assert (grads[name] - g).norm().item() <= 1e-9 * max(scale, 1e-12), name
