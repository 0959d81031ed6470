"""Tensor/sequence/data parallel with branches: same loss and gradients as the single-rank naive schedule.

Each test first computes the reference on every rank alone (TP=1, naive, megatron's own attention), then the same
logical batch under the layout, with gradients finalised (SP norm all-reduce over TP, sum over DP) and gathered to
full tensors under HF names.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_branch.checkpoint.param_map import hf_to_mcore_state, mcore_to_hf_state
from megatron_branch.checkpoint.tp import gather_full_grads, load_full_state
from megatron_branch.data import PrefixTree
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.data import assign_groups
from megatron_branch.parallel.grads import finalize_grads
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule
from megatron_branch.testing import random_tree_rollouts, tiny_hf_config, tiny_hf_model


def step(hf, rollouts, pcfg: ParallelConfig, schedule: str, dtype: torch.dtype):  # noqa: ANN001, ANN201
    groups = initialize_parallel(pcfg)
    arch = ModelArch.from_hf_config(hf.config)
    model = build_model(arch, dtype=dtype, tp=groups.tp_size, sequence_parallel=groups.sequence_parallel)
    load_full_state(
        model,
        hf_to_mcore_state(hf.state_dict(), arch, padded_vocab=arch.padded_vocab_size(pcfg.tp)),
        groups.tp,
    )
    full = PrefixTree.build(rollouts, vocab_size=arch.vocab_size)
    mine = assign_groups(full, groups.dp_size)[dist.get_rank(groups.dp)]
    tree = PrefixTree.build([rollouts[i] for i in mine], vocab_size=arch.vocab_size)
    obj = PolicyGradientObjective.grpo(
        [rollouts[i].advantage for i in mine], full.num_response_tokens_logical()
    )
    opts = ScheduleOptions(groups=groups, vocab_size=arch.vocab_size, branch_micro_batch=2, chunk_tokens=None)
    res = run_schedule(schedule, model, tree, obj, opts)
    finalize_grads(
        model, tp_group=groups.tp, dp_cp_group=groups.dp_cp, sequence_parallel=groups.sequence_parallel
    )
    loss = torch.tensor([res.loss], dtype=torch.float64)
    dist.all_reduce(loss, group=groups.dp)
    return float(loss), mcore_to_hf_state(gather_full_grads(model, groups.tp), arch)


def check(layouts: list[tuple[ParallelConfig, str]], dtype: torch.dtype, tol: float, vocab: int = 37) -> None:
    hf = tiny_hf_model(tiny_hf_config("qwen2", vocab_size=vocab, heads=4, kv_heads=2), seed=1, dtype=dtype)
    rollouts = random_tree_rollouts(groups=4, prompt_len=7, branches=3, levels=2, seg_len=(1, 4), seed=5)
    ref_loss, ref = step(hf, rollouts, ParallelConfig(), "naive", dtype)
    for pcfg, schedule in layouts:
        loss, grads = step(hf, rollouts, pcfg, schedule, dtype)
        assert loss == pytest.approx(ref_loss, rel=tol), (pcfg, schedule)
        for name in ref:
            err = ((grads[name] - ref[name]).norm() / ref[name].norm()).item()
            assert err <= tol, f"{pcfg} {schedule} {name}: relative error {err:.2e}"


@pytest.mark.world(2)
def test_tp2_sp_and_dp2_match_naive_float32() -> None:
    check(
        [
            (ParallelConfig(tp=2, sequence_parallel=True), "naive"),
            (ParallelConfig(tp=2, sequence_parallel=True), "packed"),
            (ParallelConfig(tp=2, sequence_parallel=True), "replay"),
            (ParallelConfig(tp=2), "replay"),
            (ParallelConfig(), "replay"),  # world 2, tp 1: DP2
        ],
        torch.float32,
        1e-5,
    )


@pytest.mark.world(2)
def test_tp2_sp_replay_float64() -> None:
    check([(ParallelConfig(tp=2, sequence_parallel=True), "replay")], torch.float64, 1e-9)


@pytest.mark.world(4)
def test_tp4_sp_and_tp2_dp2_match_naive_float32() -> None:
    check(
        [
            (ParallelConfig(tp=4, sequence_parallel=True), "replay"),
            (ParallelConfig(tp=4, sequence_parallel=True), "packed"),
            (ParallelConfig(tp=2), "replay"),  # TP2 x DP2
            (ParallelConfig(tp=2, sequence_parallel=True), "packed"),  # TP2+SP x DP2
        ],
        torch.float32,
        1e-5,
        vocab=38,  # not divisible by 4: vocabulary padding under TP4
    )


@pytest.mark.world(2, 4)
def test_vocab_parallel_logprobs_when_whole_slices_are_padding() -> None:
    """Vocabulary 5 padded to 16 * tp: every rank but the first holds padding only (megatron pads to 128 * tp)."""
    from megatron_branch.losses.logprobs import reference_logprobs, vocab_parallel_logprobs

    groups = initialize_parallel(ParallelConfig(tp=dist.get_world_size()))
    tp, rank = groups.tp_size, dist.get_rank(groups.tp)
    torch.manual_seed(0)  # the same full logits on every rank
    full = (3 * torch.randn(6, 16 * tp, dtype=torch.float64)).requires_grad_()
    target = torch.randint(0, 5, (6,))
    w = torch.randn(6, dtype=torch.float64)
    local = full.detach()[:, 16 * rank : 16 * (rank + 1)].clone().requires_grad_()
    lp = vocab_parallel_logprobs(local, target, vocab_size=5, tp_group=groups.tp)
    (lp * w).sum().backward()
    want = reference_logprobs(full, target, vocab_size=5)
    (want * w).sum().backward()
    torch.testing.assert_close(lp, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(local.grad, full.grad[:, 16 * rank : 16 * (rank + 1)], rtol=1e-12, atol=1e-12)


@pytest.mark.world(2, 4)
def test_fused_entropy_rescales_each_slice_to_the_global_max() -> None:
    """One pass per chunk: every TP slice has its own row max (one slice's logits shifted far above the others),
    partial sums are rescaled to the global max; logp, entropy and both gradients match the full vocabulary."""
    from megatron_branch.losses.fused_logprobs import fused_linear_logprobs_entropy
    from megatron_branch.losses.logprobs import reference_logprobs

    groups = initialize_parallel(ParallelConfig(tp=dist.get_world_size()))
    tp, rank = groups.tp_size, dist.get_rank(groups.tp)
    torch.manual_seed(1)  # the same full tensors on every rank
    vocab = 16 * tp - 3  # the last slice has 3 padding columns
    hidden = torch.randn(7, 8, dtype=torch.float64)
    hidden[:, 0] = 1.0
    weight = torch.randn(16 * tp, 8, dtype=torch.float64)
    weight[16:32, 0] += 30.0  # slice 1 dominates every row: other slices' sums are rescaled by ~e^-30
    hidden.requires_grad_(), weight.requires_grad_()
    target = torch.randint(0, vocab, (7,))
    w_lp, w_ent = torch.randn(7, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    local_w = weight.detach()[16 * rank : 16 * (rank + 1)].clone().requires_grad_()
    local_h = hidden.detach().clone().requires_grad_()
    lp, ent = fused_linear_logprobs_entropy(local_h, local_w, target, vocab_size=vocab, tp_group=groups.tp,
                                            chunk_rows=3)  # fmt: skip
    (lp * w_lp + ent * w_ent).sum().backward()
    dist.all_reduce(local_h.grad, group=groups.tp)  # = copy_to_tensor_model_parallel_region backward
    logits = hidden @ weight.t()
    logq = torch.log_softmax(logits[:, :vocab], dim=-1)
    want_lp, want_ent = reference_logprobs(logits, target, vocab_size=vocab), -(logq.exp() * logq).sum(-1)
    (want_lp * w_lp + want_ent * w_ent).sum().backward()
    torch.testing.assert_close(lp, want_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, want_ent, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(local_h.grad, hidden.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(local_w.grad, weight.grad[16 * rank : 16 * (rank + 1)], rtol=1e-10, atol=1e-12)


@pytest.mark.world(2, 4)
def test_fused_linear_logprobs_when_whole_slices_are_padding() -> None:
    from megatron_branch.losses.fused_logprobs import fused_linear_logprobs
    from megatron_branch.losses.logprobs import reference_logprobs

    groups = initialize_parallel(ParallelConfig(tp=dist.get_world_size()))
    tp, rank = groups.tp_size, dist.get_rank(groups.tp)
    torch.manual_seed(0)  # the same full tensors on every rank
    hidden = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(16 * tp, 8, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 5, (6,))
    w = torch.randn(6, dtype=torch.float64)
    local_w = weight.detach()[16 * rank : 16 * (rank + 1)].clone().requires_grad_()
    local_h = hidden.detach().clone().requires_grad_()
    lp = fused_linear_logprobs(local_h, local_w, target, vocab_size=5, tp_group=groups.tp, chunk_rows=4)
    (lp * w).sum().backward()
    dist.all_reduce(
        local_h.grad, group=groups.tp
    )  # what copy_to_tensor_model_parallel_region does in backward
    want = reference_logprobs(hidden @ weight.t(), target, vocab_size=5)
    (want * w).sum().backward()
    torch.testing.assert_close(lp, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(local_h.grad, hidden.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(local_w.grad, weight.grad[16 * rank : 16 * (rank + 1)], rtol=1e-12, atol=1e-12)
