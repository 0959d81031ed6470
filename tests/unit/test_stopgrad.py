"""replay-stopgrad, the INEXACT comparison baseline (the prompt's K/V as constants): where its gradient differs
from naive training's, where it provably does not, and that the exact replay is untouched (float64).

Why the split holds: the children read the root's per-layer K/V, which depend only on the root's input to each
layer's K/V projection. So the last layer's attention output projection, its MLP, the final norm and the output
layer get at the root's positions only the root's own loss terms, in either schedule; every parameter below the
last layer's K/V projection loses the branches' share of the prompt's gradient.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_branch.data import PrefixTree
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule, score_rollouts
from megatron_branch.testing import random_tree_rollouts, tiny_branch_model

VOCAB = 37
SHARED = {  # explicit seeds
    "shared_prompt": dict(prompt_len=9, branches=4, levels=1, seed=101),
    "two_groups_two_levels": dict(groups=2, prompt_len=6, branches=3, levels=2, seed=404),
}
# untouched by the stop-gradient (see the module docstring); the 2-layer tiny model's last layer is 1
UNAFFECTED = (
    "decoder.layers.1.self_attention.linear_proj.",
    "decoder.layers.1.pre_mlp_layernorm.",
    "decoder.layers.1.mlp.",
    "decoder.final_layernorm.",
    "output_layer.",
)
AFFECTED = (
    "embedding.word_embeddings.weight",
    "decoder.layers.0.self_attention.linear_qkv.weight",
    "decoder.layers.0.mlp.linear_fc1.weight",
    "decoder.layers.0.mlp.linear_fc2.weight",
    "decoder.layers.1.self_attention.linear_qkv.weight",
)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    initialize_parallel(ParallelConfig())
    return tiny_branch_model(torch.float64, seed=0, vocab_size=VOCAB)


def grads(model: torch.nn.Module, rollouts: list, schedule: str, **kw: object) -> dict[str, torch.Tensor]:
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rollouts], tree.num_response_tokens_logical())
    model.zero_grad(set_to_none=True)
    run_schedule(
        schedule, model, tree, obj, ScheduleOptions(vocab_size=VOCAB, **{"chunk_tokens": None, **kw})
    )
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("tree_name", list(SHARED))
def test_stopgrad_differs_from_naive_where_the_prompt_is_shared(
    model: torch.nn.Module, tree_name: str
) -> None:
    rollouts = random_tree_rollouts(vocab_size=VOCAB, **SHARED[tree_name])
    naive = grads(model, rollouts, "naive")
    exact = grads(model, rollouts, "replay")
    stop = grads(model, rollouts, "replay-stopgrad")
    assert stop.keys() == naive.keys()
    for name in naive:
        assert rel(exact[name], naive[name]) <= 1e-9, f"exact replay moved: {name}"
        err = rel(stop[name], naive[name])
        if name.startswith(UNAFFECTED):
            assert err <= 1e-9, f"{name}: {err:.2e} (should be untouched by the stop-gradient)"
        elif name in AFFECTED:
            assert err > 1e-2, f"{name}: {err:.2e} (the stop-gradient should change it)"


def test_every_prompt_row_is_constant_however_the_trie_splits_the_prompts(model: torch.nn.Module) -> None:
    """Two groups whose prompts share a template: the trie's root is the template, the rest of each prompt an
    inner segment. The stop-gradient must hold ALL prompt rows constant, so the merged tree's gradient is the
    sum of each group's alone (same loss normalisation). A root-only stop-gradient fails this (planted check).

    The advantages below each first response token sum to zero, so the prompt's own loss term (the first response
    token, predicted from the prompt's last row) has zero gradient: that term back-propagates within its own
    segment's forward, so how the trie splits a prompt changes where it reaches (a documented limit)."""
    import random

    rng = random.Random(7)
    template = [rng.randrange(VOCAB) for _ in range(5)]
    both = []
    for g in range(2):
        group = random_tree_rollouts(vocab_size=VOCAB, prompt_len=4, branches=3, levels=2, seed=500 + g)
        mean = {f: sum(r.advantage for r in group if r.response[0] == f) / sum(r.response[0] == f for r in group)
                for f in {r.response[0] for r in group}}  # fmt: skip
        both.append([
            dataclasses.replace(r, prompt=tuple(template) + tuple(r.prompt), advantage=r.advantage - mean[r.response[0]])
            for r in group
        ])  # fmt: skip
    merged = both[0] + both[1]
    tree = PrefixTree.build(merged, vocab_size=VOCAB)
    assert tree.segments[tree.roots[0]].tokens == tuple(template) and len(tree.roots) == 1  # the split
    n = tree.num_response_tokens_logical()

    def run(rollouts: list, schedule: str) -> dict[str, torch.Tensor]:
        t = PrefixTree.build(rollouts, vocab_size=VOCAB)
        model.zero_grad(set_to_none=True)
        obj = PolicyGradientObjective.grpo([r.advantage for r in rollouts], n)
        run_schedule(schedule, model, t, obj, ScheduleOptions(vocab_size=VOCAB, chunk_tokens=None))
        return {k: p.grad.detach().clone() for k, p in model.named_parameters()}

    whole = run(merged, "replay-stopgrad")
    parts = [run(g, "replay-stopgrad") for g in both]
    for name in whole:
        assert rel(whole[name], parts[0][name] + parts[1][name]) <= 1e-9, name
    exact = run(merged, "replay")  # and the exact schedule differs from it on the trunk
    assert (
        rel(whole["decoder.layers.0.mlp.linear_fc1.weight"], exact["decoder.layers.0.mlp.linear_fc1.weight"])
        > 1e-2
    )


def test_stopgrad_recompute_is_the_same_stopgrad(model: torch.nn.Module) -> None:
    rollouts = random_tree_rollouts(vocab_size=VOCAB, **SHARED["two_groups_two_levels"])
    a = grads(model, rollouts, "replay-stopgrad")
    b = grads(model, rollouts, "replay-stopgrad", recompute=True, branch_micro_batch=2)
    for name in a:
        assert rel(b[name], a[name]) <= 1e-9, name


def test_without_sharing_stopgrad_is_exact(model: torch.nn.Module) -> None:
    """One rollout per prompt: no root has children, nothing is cut, the gradient is naive's."""
    rollouts = random_tree_rollouts(vocab_size=VOCAB, groups=3, branches=1, seed=5)
    naive = grads(model, rollouts, "naive")
    stop = grads(model, rollouts, "replay-stopgrad")
    for name in naive:
        assert rel(stop[name], naive[name]) <= 1e-9, name


def test_stopgrad_scoring_is_replay_bit_for_bit(model: torch.nn.Module) -> None:
    rollouts = random_tree_rollouts(vocab_size=VOCAB, **SHARED["two_groups_two_levels"])
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    opts = ScheduleOptions(vocab_size=VOCAB, chunk_tokens=None)
    a = score_rollouts("replay", model, tree, opts)
    b = score_rollouts("replay-stopgrad", model, tree, opts)
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert torch.equal(x.nan_to_num(0.0), y.nan_to_num(0.0))
    assert b.result.schedule == "replay-stopgrad"


def test_train_config_accepts_the_variant() -> None:
    """`megatron-branch train demo.yaml schedule.name=replay-stopgrad` validates (the loop runs the registry)."""
    from pathlib import Path

    from megatron_branch.schedule import SCHEDULES
    from megatron_branch.train.config_io import load_config

    demo = Path(__file__).resolve().parents[2] / "examples" / "configs" / "demo.yaml"
    cfg = load_config(str(demo), ["schedule.name=replay-stopgrad"])
    assert cfg.schedule.name == "replay-stopgrad" and cfg.schedule.name in SCHEDULES
