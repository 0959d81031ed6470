"""The planner's memory terms one by one against the activation meter's split at its peak (issue 19 item 5).

The meter attributes every counted storage to what holds it (memory.KINDS): autograd (the planner's
`activations`), the prefix cache (`cached_kv`) and the cache's gradient accumulators (`kv_grads`). The shape is a
32B TP8 rank's head layout scaled down (5 query heads and 1 KV group per rank, as Qwen2.5-32B at TP8), with a
shared prompt and 16 leaves, in the three recompute modes the planner searches. Bound: 5% per term (measured here
at <= 0.2%). The TP2 + SP and CP2 versions run under torchrun: tests/distributed/test_plan_parallel.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.plan import Layout, RolloutShape
from megatron_branch.plan.measure import measure_step, per_term
from megatron_branch.plan.memory import Peak, step_peak
from megatron_branch.schedule.prefix_cache import PrefixCache

TOL = 0.05
VOCAB = 64
SHAPE = RolloutShape(prompt_length=512, responses=16, response_length=16)
MODES = {"none": (False, False), "selective": (True, False), "full": (True, True)}


@pytest.fixture(scope="module", autouse=True)
def _single_rank() -> None:
    initialize_parallel(ParallelConfig())


def rank_arch(tp: int = 1) -> ModelArch:
    """Per rank: 5 query heads, 1 KV group (Qwen2.5-32B's 40 / 8 at TP8), narrow width."""
    return ModelArch(family="qwen2", vocab_size=VOCAB, hidden_size=160, num_layers=1, num_attention_heads=5 * tp,
                     num_query_groups=tp, head_dim=16, ffn_hidden_size=64 * tp, qkv_bias=True,
                     max_position_embeddings=4096)  # fmt: skip


def check_terms(measured: object, planned: Peak, tol: float = TOL) -> None:
    assert measured.saved_peak == sum(  # type: ignore[attr-defined]
        (measured.activations, measured.cached_at_peak, measured.kv_grads)  # type: ignore[attr-defined]
    ), "the meter's split must sum to its peak"
    for term, (got, want) in per_term(measured, planned).items():
        assert want == pytest.approx(got, rel=tol), (term, got, want)


@pytest.mark.parametrize(
    "mode", [pytest.param(m, marks=pytest.mark.slow) if m != "full" else m for m in MODES]
)
def test_each_term_matches_the_meter(mode: str) -> None:
    seg, lay = MODES[mode]
    arch = rank_arch()
    torch.manual_seed(0)
    model = build_model(arch)
    got = measure_step(model, SHAPE, vocab=VOCAB, branch_micro_batch=8, recompute=seg, recompute_layers=lay)
    want = step_peak(arch, SHAPE, Layout(), act_bytes=4, branch_micro_batch=8, segment_recompute=seg,
                     layer_recompute=lay)  # fmt: skip
    check_terms(got, want)


def test_planted_term_errors_are_caught() -> None:
    """The per-term check can fail: the old full-recompute formula (a rebuilt layer's input counted beside the
    kept input) and the recomputed root's captured K/V put under activations both break a term by > 5%."""
    arch = rank_arch()
    torch.manual_seed(0)
    model = build_model(arch)
    got = measure_step(model, SHAPE, vocab=VOCAB, branch_micro_batch=8, recompute=True, recompute_layers=True)
    want = step_peak(arch, SHAPE, Layout(), act_bytes=4, branch_micro_batch=8, segment_recompute=True,
                     layer_recompute=True)  # fmt: skip
    double_input = dataclasses.replace(want, activations=want.activations + SHAPE.prompt_length * 160 * 4)
    moved_kv = dataclasses.replace(want, activations=want.activations + want.cached_kv // 2,
                                   cached_kv=want.cached_kv // 2)  # fmt: skip
    for planted in (double_input, moved_kv):
        with pytest.raises(AssertionError):
            check_terms(got, planted)


def test_bf16_cache_and_its_fp32_sums_match_the_planner() -> None:
    """bf16: the cached K/V in bf16 and their dK/dV sums in fp32 (schedule/prefix_cache.py WideSum), exactly as the
    planner counts them (kv_grads = twice the K/V bytes). The activations are not compared here: torch's CPU
    rms_norm saves fp32 copies for bf16 input where the planner counts a fused norm (docs/scaling.md)."""
    arch = rank_arch()
    torch.manual_seed(0)
    model = build_model(arch, dtype=torch.bfloat16)
    got = measure_step(model, SHAPE, vocab=VOCAB, branch_micro_batch=8, recompute=True, recompute_layers=True)
    want = step_peak(arch, SHAPE, Layout(), act_bytes=2, branch_micro_batch=8, segment_recompute=True,
                     layer_recompute=True)  # fmt: skip
    kv = 2 * SHAPE.prompt_length * arch.num_query_groups * arch.head_dim * 2  # K and V of the root, bf16
    assert got.kv_grads == want.kv_grads == 2 * kv  # fp32 sums
    assert got.cached_at_peak == want.cached_kv


def test_one_copy_of_the_prefix_cache_at_the_roots_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 33 item 3: under recompute full the root's cache entry is released before its forward runs again, so
    at the root's backward its K/V are held once (the recomputed ones), as the planner's cached_kv says. Planted:
    a cache that keeps the entry beside the recomputed K/V (a `release` that frees nothing) holds them twice."""
    arch = rank_arch()
    kv = 2 * SHAPE.prompt_length * arch.num_query_groups * arch.head_dim * 4  # K and V of the root, float32
    want = step_peak(arch, SHAPE, Layout(), act_bytes=4, branch_micro_batch=8, segment_recompute=True,
                     layer_recompute=True)  # fmt: skip
    assert want.cached_kv == kv

    def measure() -> int:
        torch.manual_seed(0)
        model = build_model(arch)
        got = measure_step(
            model, SHAPE, vocab=VOCAB, branch_micro_batch=8, recompute=True, recompute_layers=True
        )
        return got.cached_at_peak

    assert measure() == kv
    monkeypatch.setattr(PrefixCache, "release", lambda self, seg_id: None)
    assert measure() == 2 * kv
