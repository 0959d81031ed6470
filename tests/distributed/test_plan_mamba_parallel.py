"""The planner's Mamba-2 hybrid terms (plan/mamba.py) against the activation meter under TP2 + SP, on every rank: a
tiny Nemotron 3 with every block kind (Mamba-2 heads and groups, attention heads and the experts split over TP), and
the fork state each rank's cache registers (its share of the SSM heads and conv channels); under CP2 (the head
exchange) the same, and the exchange's bytes against its own count; at world 4 under TP2 x CP2 + SP.

python tests/distributed/launch.py 2 -k plan_mamba
python tests/distributed/launch.py 4 -k plan_mamba
"""

from __future__ import annotations

import pytest
import torch

from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.plan import Layout, RolloutShape
from megatron_branch.plan import mamba as plan_mamba
from megatron_branch.plan.activations import Dims, layer_kv_bytes
from megatron_branch.plan.measure import measure_step
from megatron_branch.plan.memory import local_rows, step_peak
from megatron_branch.testing import tiny_hf_config

VOCAB = 37
TOL = 0.05  # as tests/unit/test_plan_mamba.py
PATTERN = "M*-MEM"


@pytest.mark.world(2)
@pytest.mark.parametrize("layers", [False, True], ids=["keep", "recompute_layers"])
def test_mamba_hybrid_bytes_match_the_meter_tp2_sp(layers: bool) -> None:
    groups = initialize_parallel(ParallelConfig(tp=2, sequence_parallel=True))
    a = ModelArch.from_hf_config(tiny_hf_config("nemotron_h", num_layers=6, ffn=48, layer_types=PATTERN))
    torch.manual_seed(0)
    model = build_model(a, dtype=torch.float32, tp=2, sequence_parallel=True)
    shape = RolloutShape(prompt_length=64, responses=4, response_length=12, shared_response_length=2)
    got = measure_step(model, shape, vocab=VOCAB, branch_micro_batch=4, recompute=layers, recompute_layers=layers,
                       groups=groups)  # fmt: skip
    layout = Layout(tp=2)
    pk = step_peak(a, shape, layout, act_bytes=4, branch_micro_batch=4, segment_recompute=layers,
                   layer_recompute=layers)  # fmt: skip
    assert pk.saved == pytest.approx(got.saved_peak, rel=TOL), (pk, got)
    dm = Dims.of(a, layout, 4)
    rows = local_rows(shape.root_length, 1, layout)
    state = PATTERN.count("M") * plan_mamba.mamba_state_bytes(dm)
    assert got.cached_kv == layer_kv_bytes(dm, rows) + state  # this rank's K/V and its heads' fork state


_MAMBA_BLOCK = plan_mamba.mamba_block


def _all_heads(arch: ModelArch, *, tp: int = 1, cp: int = 1) -> tuple[int, int]:
    """Planted: a rank's Mamba block priced as all its TP rank's heads and groups, whatever the CP size."""
    return _MAMBA_BLOCK(arch, tp=tp)


@pytest.mark.world(2)
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_mamba_hybrid_under_cp2_matches_the_meter_and_the_exchange_count(mode: str) -> None:
    """Under CP2 each rank runs one group's block of the Mamba heads (2 of 4) over whole segments (the head exchange,
    models/mamba_heads.py): the planner's saved bytes within 5% of the meter on every rank, the cache's bytes
    exactly (this rank's K/V rows and ITS heads' fork state: half the heads and conv channels), and the exchange's
    forward bytes exactly against its own count (RingStats), the way back in float32: a bf16 model too, where a
    formula at the activations' 2 bytes both ways would be short; the step-time term sends as much again backward."""
    from megatron_branch.parallel.ring import RingStats
    from megatron_branch.plan.costs import _chunk_rows, _mamba_exchange_bytes_per_rank

    groups = initialize_parallel(ParallelConfig(cp=2))
    a = ModelArch.from_hf_config(tiny_hf_config("nemotron_h", num_layers=6, ffn=48, layer_types=PATTERN))
    shape = RolloutShape(prompt_length=64, responses=4, response_length=12, shared_response_length=2)
    layout, recompute, layers = Layout(cp=2, recompute=mode), mode != "none", mode == "full"
    M = PATTERN.count("M")
    chunks = _chunk_rows(shape, layout, "replay")  # the root, each leaf, the recomputed root
    c_in, c_out, _ = plan_mamba.mamba_exchange_widths(a, tp=1, cp=2)
    for dtype, e in ((torch.float32, 4), (torch.bfloat16, 2)) if not recompute else ((torch.float32, 4),):
        torch.manual_seed(0)
        model = build_model(a, dtype=dtype)
        stats = RingStats()
        got = measure_step(model, shape, vocab=VOCAB, branch_micro_batch=4, recompute=recompute,
                           recompute_layers=layers, groups=groups, ring_stats=stats)  # fmt: skip
        sent = [plan_mamba.mamba_exchange_bytes(a, r, tp=1, cp=2, e=e) for r in chunks]
        # every chunk's forward (a recomputed root twice), and under layer checkpoints every forward with a backward
        # once more (the rebuild); the backward sends what the forward with a graph sent
        backward = M * (sum(sent) - (sent[0] if recompute else 0))
        assert stats.exchange_bytes == M * sum(sent) + (backward if layers else 0) > 0, (dtype, stats)
        if e == 2:  # planted: both ways at the activations' 2 bytes would be short of the count
            assert stats.exchange_bytes > M * sum(r * (c_in + c_out) * 2 for r in chunks)
            continue
        assert (
            _mamba_exchange_bytes_per_rank(a, shape, layout, "replay", e=e) == stats.exchange_bytes + backward
        )
        # measured on both ranks: 0.05%, 2.3% and 3.2% under the meter (none, selective, full)
        pk = step_peak(a, shape, layout, act_bytes=4, branch_micro_batch=4)
        assert pk.saved == pytest.approx(got.saved_peak, rel=TOL), (pk, got)
        dm = Dims.of(a, layout, 4)
        state = M * plan_mamba.mamba_state_bytes(dm)
        assert 2 * state == M * plan_mamba.mamba_state_bytes(Dims.of(a, Layout(), 4))  # half the heads
        rows = local_rows(shape.root_length, 1, layout)
        assert got.cached_kv == layer_kv_bytes(dm, rows) + state
        if mode == "none":  # planted: every M layer priced with all its heads over whole segments: 53% over
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(plan_mamba, "mamba_block", _all_heads)
                assert (
                    step_peak(a, shape, layout, act_bytes=4, branch_micro_batch=4).saved
                    > 1.2 * got.saved_peak
                )


@pytest.mark.world(4)
@pytest.mark.parametrize("mode", ["none", "full"])
def test_mamba_hybrid_under_tp2_cp2_sp_matches_the_meter_and_the_exchange_count(mode: str) -> None:
    """TP2 x CP2 + SP: a TP rank's 2 heads in 1 group, one head per CP rank (the group's B / C shared with the other
    CP rank): the planner's saved bytes within 5% of the meter on every rank (measured 3.7% and 0.6% over), the
    cache's bytes exactly, the exchange's bytes exactly against its own count."""
    from megatron_branch.parallel.ring import RingStats
    from megatron_branch.plan.costs import _chunk_rows

    groups = initialize_parallel(ParallelConfig(tp=2, cp=2, sequence_parallel=True))
    a = ModelArch.from_hf_config(tiny_hf_config("nemotron_h", num_layers=6, ffn=48, layer_types=PATTERN))
    shape = RolloutShape(prompt_length=64, responses=4, response_length=12, shared_response_length=2)
    layout, full = Layout(tp=2, cp=2, recompute=mode), mode == "full"
    torch.manual_seed(0)
    model = build_model(a, dtype=torch.float32, tp=2, sequence_parallel=True)
    stats = RingStats()
    got = measure_step(model, shape, vocab=VOCAB, branch_micro_batch=4, recompute=full, recompute_layers=full,
                       groups=groups, ring_stats=stats)  # fmt: skip
    M = PATTERN.count("M")
    sent = [
        plan_mamba.mamba_exchange_bytes(a, r, tp=2, cp=2, e=4) for r in _chunk_rows(shape, layout, "replay")
    ]
    rebuilt = (
        M * (sum(sent) - sent[0]) if full else 0
    )  # layer checkpoints rerun every forward that has a backward
    assert stats.exchange_bytes == M * sum(sent) + rebuilt > 0, stats
    pk = step_peak(a, shape, layout, act_bytes=4, branch_micro_batch=4)
    assert pk.saved == pytest.approx(got.saved_peak, rel=TOL), (pk, got)
    dm = Dims.of(a, layout, 4)
    rows = local_rows(shape.root_length, 1, layout)
    assert got.cached_kv == layer_kv_bytes(dm, rows) + M * plan_mamba.mamba_state_bytes(dm)
