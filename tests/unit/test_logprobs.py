"""Vocab-parallel logprobs: against log_softmax and megatron's own vocab_parallel_cross_entropy (TP=1)."""

from __future__ import annotations

import pytest
import torch

from megatron_branch.losses.logprobs import reference_logprobs, vocab_parallel_logprobs


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_matches_log_softmax_forward_and_backward(dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    logits = (3 * torch.randn(9, 40, dtype=dtype)).requires_grad_()
    target = torch.randint(0, 37, (9,))
    w = torch.randn(9, dtype=dtype)
    got = vocab_parallel_logprobs(logits, target, vocab_size=37, chunk_rows=4)  # chunks of 4 rows
    (gg,) = torch.autograd.grad((got * w).sum(), logits)
    want = reference_logprobs(logits, target, vocab_size=37)
    (gw,) = torch.autograd.grad((want * w).sum(), logits)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(gg, gw, rtol=tol, atol=tol)
    assert got.dtype == dtype
    assert gg[:, 37:].abs().max() == 0  # padded vocabulary never gets gradient


def test_padding_rows_excluded_from_softmax() -> None:
    logits = torch.zeros(2, 8)
    logits[:, 6:] = 100.0  # huge padded logits must not matter
    lp = vocab_parallel_logprobs(logits, torch.tensor([0, 5]), vocab_size=6)
    torch.testing.assert_close(lp, torch.full((2,), -torch.log(torch.tensor(6.0))))


def test_agrees_with_megatron_cross_entropy_tp1() -> None:
    from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel

    initialize_parallel(ParallelConfig())
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    torch.manual_seed(1)
    logits = torch.randn(5, 1, 23)
    target = torch.randint(0, 23, (5, 1))
    ce = vocab_parallel_cross_entropy(logits.clone(), target)  # [5, 1]
    lp = vocab_parallel_logprobs(logits[:, 0], target[:, 0], vocab_size=23)
    torch.testing.assert_close(-ce[:, 0], lp, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("rows", [1, 4, 1024])
def test_fused_linear_logprobs_match_materialised_logits(dtype: torch.dtype, tol: float, rows: int) -> None:
    from megatron_branch.losses.fused_logprobs import fused_linear_logprobs

    torch.manual_seed(2)
    hidden = torch.randn(11, 8, dtype=dtype, requires_grad=True)
    weight = torch.randn(40, 8, dtype=dtype, requires_grad=True)  # 37 real + 3 padded rows
    target = torch.randint(0, 37, (11,))
    w = torch.randn(11, dtype=dtype)
    got = fused_linear_logprobs(hidden, weight, target, vocab_size=37, chunk_rows=rows)
    g_got = torch.autograd.grad((got * w).sum(), [hidden, weight])
    want = reference_logprobs(hidden @ weight.t(), target, vocab_size=37)
    g_want = torch.autograd.grad((want * w).sum(), [hidden, weight])
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert g_got[1][37:].abs().max() == 0  # padded vocabulary rows get no gradient


def test_fused_path_never_saves_full_logits() -> None:
    """Activation memory: the fused path keeps O(1) per row, the materialised one O(vocab) per row."""
    from megatron_branch.losses.fused_logprobs import fused_linear_logprobs
    from megatron_branch.memory import ActivationMeter

    hidden = torch.randn(64, 16, requires_grad=True)
    output_layer = torch.nn.Linear(16, 4096, bias=False)  # a parameter: the meter excludes it
    target = torch.randint(0, 4096, (64,))
    logits_bytes = 64 * 4096 * 4
    with ActivationMeter(output_layer) as fused:
        fused_linear_logprobs(hidden, output_layer.weight, target, vocab_size=4096, chunk_rows=16).sum()
    with ActivationMeter(output_layer) as plain:
        vocab_parallel_logprobs(output_layer(hidden), target, vocab_size=4096).sum()
    assert plain.peak_bytes >= logits_bytes  # the softmax of every row is saved
    assert fused.peak_bytes < logits_bytes / 50  # hidden rows, targets and one log-sum-exp per row


def _entropy_reference(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    logq = torch.log_softmax(logits[:, :vocab_size], dim=-1)
    return -(logq.exp() * logq).sum(dim=-1)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("rows", [1, 4, 1024])
def test_fused_entropy_matches_materialised_logits(dtype: torch.dtype, tol: float, rows: int) -> None:
    """logp and the full-vocabulary entropy from ONE projection pass per chunk, values and both gradients."""
    from megatron_branch.losses.fused_logprobs import fused_linear_logprobs_entropy

    torch.manual_seed(3)
    hidden = torch.randn(11, 8, dtype=dtype, requires_grad=True)
    weight = (torch.randn(40, 8, dtype=dtype) * 3).requires_grad_()  # 37 real + 3 padded; peaked softmax
    target = torch.randint(0, 37, (11,))
    w_lp, w_ent = torch.randn(11, dtype=dtype), torch.randn(11, dtype=dtype)
    lp, ent = fused_linear_logprobs_entropy(hidden, weight, target, vocab_size=37, chunk_rows=rows)
    g_got = torch.autograd.grad((lp * w_lp + ent * w_ent).sum(), [hidden, weight])
    logits = hidden @ weight.t()
    want_lp = reference_logprobs(logits, target, vocab_size=37)
    want_ent = _entropy_reference(logits, 37)
    g_want = torch.autograd.grad((want_lp * w_lp + want_ent * w_ent).sum(), [hidden, weight])
    torch.testing.assert_close(lp, want_lp, rtol=tol, atol=tol)
    torch.testing.assert_close(ent, want_ent, rtol=tol, atol=tol)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
