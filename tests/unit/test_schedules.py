"""Exactness of the schedules: packed and replay against naive per-rollout training AND against Hugging Face.

float64: <= 1e-9 relative per parameter gradient (megatron-core computes in float64 end to end here; RoPE angles
are float32 in both megatron and HF, identically). float32: <= 1e-5 relative.
"""

from __future__ import annotations

import pytest
import torch

from megatron_branch.checkpoint.param_map import hf_to_mcore_state, mcore_to_hf_state
from megatron_branch.checkpoint.tp import gather_full_grads, load_full_state
from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule
from megatron_branch.schedule import replay as replay_mod
from megatron_branch.testing import (
    exact_hf_norms,
    hf_policy_gradient,
    random_tree_rollouts,
    tiny_hf_config,
    tiny_hf_model,
)

TOL = {torch.float64: 1e-9, torch.float32: 1e-5}


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def make_pair(family: str, tie: bool, dtype: torch.dtype, seed: int = 0):  # noqa: ANN201
    cfg = tiny_hf_config(family, tie=tie)
    hf = exact_hf_norms(tiny_hf_model(cfg, seed=seed, dtype=dtype))
    arch = ModelArch.from_hf_config(cfg)
    model = build_model(arch, dtype=dtype)
    state = hf_to_mcore_state(hf.state_dict(), arch, padded_vocab=arch.padded_vocab_size(1))
    load_full_state(model, state, None)
    return hf, model, arch


def run(model, arch, rollouts, schedule, **kw):  # noqa: ANN001, ANN201
    """One step; replay walks segment by segment unless `chunk_tokens` is given (its default chunks would run these
    tiny trees as one packed chunk, and the walk would go untested)."""
    tree = PrefixTree.build(rollouts, vocab_size=arch.vocab_size)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rollouts], tree.num_response_tokens_logical())
    model.zero_grad(set_to_none=True)
    opts = ScheduleOptions(vocab_size=arch.vocab_size, keep_logprobs=True, **{"chunk_tokens": None, **kw})
    res = run_schedule(schedule, model, tree, obj, opts)
    grads = mcore_to_hf_state(gather_full_grads(model, None), arch)
    return tree, res, grads


def assert_grads_close(got: dict, want: dict, tol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        err = (
            (got[name].double() - want[name].double()).norm() / want[name].double().norm().clamp_min(1e-30)
        ).item()
        assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"


TREES = {  # explicit seeds: a failure reproduces in any process (hash() of a string changes with each one)
    "shared_prompt": dict(prompt_len=9, branches=4, levels=1, seed=101),
    "two_levels": dict(prompt_len=7, branches=3, levels=2, seed=202),
    "three_levels": dict(prompt_len=5, branches=2, levels=3, seg_len=(2, 4), seed=303),
    "three_groups": dict(groups=3, prompt_len=6, branches=3, levels=2, seed=404),
}
MODELS = {"llama_gqa": ("llama", False), "qwen2_bias": ("qwen2", False), "llama_tied": ("llama", True)}


@pytest.mark.slow
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("tree_name", list(TREES))
def test_float64_parity_with_naive_and_hf(model_name: str, tree_name: str) -> None:
    family, tie = MODELS[model_name]
    hf, model, arch = make_pair(family, tie, torch.float64)
    rollouts = random_tree_rollouts(**TREES[tree_name])
    hf_loss, hf_grads = hf_policy_gradient(hf, rollouts)
    tree, naive, naive_grads = run(model, arch, rollouts, "naive")
    assert tree.positions_computed < tree.positions_logical
    assert_grads_close(naive_grads, hf_grads, 1e-9)
    assert naive.loss == pytest.approx(hf_loss, rel=1e-10)
    for schedule, kw in [
        ("packed", {}),
        ("replay", {}),
        ("replay", {"recompute": True, "branch_micro_batch": 2}),
        ("replay", {"chunk_tokens": 10}),  # chunks (on by default) of small subtrees against cached ancestors
    ]:
        _, res, grads = run(model, arch, rollouts, schedule, **kw)
        assert res.positions_computed == tree.positions_computed
        assert res.loss == pytest.approx(naive.loss, rel=1e-10, abs=1e-14)
        assert_grads_close(grads, naive_grads, 1e-9)
        assert_grads_close(grads, hf_grads, 1e-9)
        torch.testing.assert_close(
            res.target_logprobs, naive.target_logprobs, rtol=0, atol=1e-11, equal_nan=True
        )


@pytest.mark.parametrize("schedule", ["packed", "replay"])
@pytest.mark.parametrize("backend", ["merge", "packed", "reference"])
def test_float32_parity_every_backend(schedule: str, backend: str) -> None:
    _, model, arch = make_pair("qwen2", False, torch.float32, seed=3)
    rollouts = random_tree_rollouts(seed=11, prompt_len=13, branches=3, levels=2, seg_len=(1, 7))
    _, _, naive_grads = run(model, arch, rollouts, "naive")
    _, _, grads = run(model, arch, rollouts, schedule, backend=backend)
    assert_grads_close(grads, naive_grads, TOL[torch.float32])


def test_positions_computed_one_prompt_g_responses() -> None:
    _, model, arch = make_pair("llama", False, torch.float32)
    P, G, S = 11, 6, 4
    prompt = list(range(1, P + 1))
    rollouts = [
        Rollout(prompt=prompt, response=[20 + g] + [g % 5] * (S - 1), advantage=1.0) for g in range(G)
    ]
    tree, res, _ = run(model, arch, rollouts, "replay")
    assert res.positions_computed == tree.positions_computed == P + G * S
    assert res.positions_logical == G * (P + S)


def _perturb_outside(rollouts: list[Rollout], keep: int, vocab: int) -> list[Rollout]:
    """Change every token that is not on rollout `keep`'s path, keeping the tree's shape."""
    tree = PrefixTree.build(rollouts)
    on_path = set(tree.rollout_segments(keep))
    for shift in range(1, vocab):
        out = []
        for j, r in enumerate(rollouts):
            seq = []
            for s in tree.rollout_segments(j):
                toks = tree.segments[s].tokens
                seq += list(toks) if s in on_path else [(t + shift) % vocab for t in toks]
            out.append(
                Rollout(prompt=seq[: len(r.prompt)], response=seq[len(r.prompt) :], advantage=r.advantage)
            )
        if len(PrefixTree.build(out).segments) == len(tree.segments):
            return out
    raise AssertionError("no shape-preserving perturbation")


@pytest.mark.parametrize("schedule", ["packed", "replay"])
def test_isolation_logprobs_bit_identical(schedule: str) -> None:
    _, model, arch = make_pair("llama", False, torch.float32, seed=5)
    rollouts = random_tree_rollouts(seed=4, prompt_len=8, branches=3, levels=2)
    keep = 2
    other = _perturb_outside(rollouts, keep, arch.vocab_size)
    assert other[keep] == rollouts[keep] and other != rollouts
    t1, r1, _ = run(model, arch, rollouts, schedule)
    t2, r2, _ = run(model, arch, other, schedule)
    a, b = r1.rollout_logprobs(t1, keep), r2.rollout_logprobs(t2, keep)
    assert torch.equal(a, b)
    changed = [j for j in range(len(rollouts)) if j != keep]
    assert any(not torch.equal(r1.rollout_logprobs(t1, j), r2.rollout_logprobs(t2, j)) for j in changed)


def test_planted_bug_dropping_one_branch_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drop the first branch's contribution to its parent's dK/dV: the parity check must fail."""

    class DropFirstBranch(replay_mod._Replay):
        dropped = False

        def run_leaves(self, leaves):  # noqa: ANN001, ANN202
            super().run_leaves(leaves)
            if not self.dropped:  # right after the first leaf micro-batch's backward
                self.dropped = True
                for entry in self.cache.entries[self.path[-1]].values():  # schedule/prefix_cache.py
                    for leaf in entry.trainable:  # the parent's K/V leaves
                        leaf.grad = None

    _, model, arch = make_pair("llama", False, torch.float64)
    rollouts = random_tree_rollouts(seed=8, prompt_len=9, branches=4, levels=1)
    _, _, naive_grads = run(model, arch, rollouts, "naive")
    _, _, good = run(model, arch, rollouts, "replay", branch_micro_batch=1)
    assert_grads_close(good, naive_grads, 1e-9)
    monkeypatch.setattr(replay_mod, "_Replay", DropFirstBranch)
    _, _, bad = run(model, arch, rollouts, "replay", branch_micro_batch=1)
    with pytest.raises(AssertionError, match="relative error"):
        assert_grads_close(bad, naive_grads, 1e-9)
    with pytest.raises(AssertionError, match="relative error"):
        assert_grads_close(bad, naive_grads, 1e-3)  # not a rounding-level difference


@pytest.mark.parametrize("schedule", ["packed", "replay"])
def test_materialised_logits_path_matches_fused(schedule: str) -> None:
    """fused_logprobs=False (megatron's output layer, then logprobs) gives the same step as the fused default."""
    _, model, arch = make_pair(
        "llama", True, torch.float64, seed=7
    )  # tied: the output weight is the embedding
    rollouts = random_tree_rollouts(seed=12, prompt_len=8, branches=3, levels=2)
    _, fused, fused_grads = run(model, arch, rollouts, schedule, logprob_chunk_rows=3)
    _, plain, plain_grads = run(model, arch, rollouts, schedule, fused_logprobs=False)
    assert fused.loss == pytest.approx(plain.loss, rel=1e-12)
    torch.testing.assert_close(
        fused.target_logprobs, plain.target_logprobs, rtol=0, atol=1e-12, equal_nan=True
    )
    assert_grads_close(fused_grads, plain_grads, 1e-10)
