"""Forward-only scoring and the entropy output of the logprob paths.

- fused and materialised entropy (values and gradients) against the slow reference, with a padded vocabulary;
- every schedule's forward-only logprobs are bit-identical to its own training forward's, and equal across
  schedules (float64 1e-12); entropies likewise;
- forward-only replay keeps only one path's K/V: its activation peak is flat in the number of branches.
"""

from __future__ import annotations

import random

import pytest
import torch

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.losses.fused_logprobs import fused_linear_logprobs_entropy
from megatron_branch.losses.logprobs import reference_entropy, reference_logprobs, vocab_parallel_entropy
from megatron_branch.memory import ActivationMeter
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule, score_rollouts
from megatron_branch.testing import random_tree_rollouts

VOCAB = 37


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def tiny_model(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    arch = ModelArch(
        family="llama",
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
    )
    model = build_model(arch, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)  # peaked distributions: entropies far from log V
    return model


@pytest.mark.parametrize("rows", [3, 64])
def test_fused_entropy_matches_reference_with_gradients(rows: int) -> None:
    g = torch.Generator().manual_seed(7)
    m, h, v_pad, v = 9, 6, 12, 10  # two padded vocabulary columns
    hidden = torch.randn(m, h, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(v_pad, h, dtype=torch.float64, generator=g, requires_grad=True)
    target = torch.randint(0, v, (m,), generator=g)
    a, b = torch.randn(m, dtype=torch.float64, generator=g), torch.randn(m, dtype=torch.float64, generator=g)

    lp, ent = fused_linear_logprobs_entropy(hidden, weight, target, vocab_size=v, chunk_rows=rows)
    dh, dw = torch.autograd.grad((a * lp + b * ent).sum(), (hidden, weight))
    logits = hidden @ weight.t()
    lp_ref, ent_ref = (
        reference_logprobs(logits, target, vocab_size=v),
        reference_entropy(logits, vocab_size=v),
    )
    dh_ref, dw_ref = torch.autograd.grad((a * lp_ref + b * ent_ref).sum(), (hidden, weight))
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-13)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-13)
    torch.testing.assert_close(dh, dh_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(dw, dw_ref, rtol=0, atol=1e-12)

    ent2 = vocab_parallel_entropy(hidden @ weight.t(), vocab_size=v)
    (dh2,) = torch.autograd.grad((b * ent2).sum(), hidden)
    (dh2_ref,) = torch.autograd.grad((b * reference_entropy(hidden @ weight.t(), vocab_size=v)).sum(), hidden)
    torch.testing.assert_close(ent2, ent_ref, rtol=0, atol=1e-13)
    torch.testing.assert_close(dh2, dh2_ref, rtol=0, atol=1e-12)


def _rollouts() -> list[Rollout]:
    rs = random_tree_rollouts(groups=2, prompt_len=6, branches=3, levels=2, seed=21)
    return rs + [Rollout(prompt=(), response=(4, 5, 6), advantage=0.3)]  # empty prompt: first token unscored


@pytest.mark.parametrize("schedule", ["naive", "packed", "replay"])
def test_forward_only_equals_training_forward(schedule: str) -> None:
    model = tiny_model(torch.float64)
    rollouts = _rollouts()
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    opts = ScheduleOptions(
        vocab_size=VOCAB, branch_micro_batch=2, keep_logprobs=True, keep_entropy=True, chunk_tokens=None
    )
    obj = PolicyGradientObjective.grpo([r.advantage for r in rollouts], tree.num_response_tokens_logical())
    model.zero_grad(set_to_none=True)
    trained = run_schedule(schedule, model, tree, obj, opts)
    grads = [p.grad.clone() for p in model.parameters()]
    scores = score_rollouts(schedule, model, tree, opts, entropy=True)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))  # scoring adds no gradient
    assert scores.entropy is not None
    for i in range(len(rollouts)):  # bit-identical to the same schedule's training forward
        assert torch.equal(
            scores.logprobs[i].nan_to_num(9.0), trained.rollout_logprobs(tree, i).nan_to_num(9.0)
        )
        assert torch.equal(
            scores.entropy[i].nan_to_num(9.0), trained.rollout_entropy(tree, i).nan_to_num(9.0)
        )
    assert torch.isnan(scores.logprobs[-1][0]) and not torch.isnan(scores.logprobs[-1][1:]).any()
    naive = score_rollouts("naive", model, tree, opts, entropy=True)
    for i in range(len(rollouts)):  # and equal to naive's
        torch.testing.assert_close(scores.logprobs[i], naive.logprobs[i], rtol=0, atol=1e-12, equal_nan=True)
        torch.testing.assert_close(scores.entropy[i], naive.entropy[i], rtol=0, atol=1e-12, equal_nan=True)


def test_forward_only_replay_memory_flat_in_branches() -> None:
    model = tiny_model(torch.float32)
    rng = random.Random(3)
    prompt = [rng.randrange(VOCAB) for _ in range(48)]
    peaks = []
    for g in (4, 16):
        rs = [Rollout(prompt=prompt, response=[i, 1, 2, 3], advantage=0.0) for i in range(g)]
        tree = PrefixTree.build(rs, vocab_size=VOCAB)
        with ActivationMeter(model) as meter:
            score_rollouts(
                "replay",
                model,
                tree,
                ScheduleOptions(vocab_size=VOCAB, branch_micro_batch=4, chunk_tokens=None),
            )
        assert meter.current_bytes == 0  # the path's K/V are dropped when its subtree is done
        peaks.append(meter.peak_bytes)
    assert peaks[0] == peaks[1] > 0  # one prompt's K/V, whatever the number of branches
