"""DeepSeek-V3 (deepseek_v3: multi-latent attention, models/mla.py, with the DeepSeek MoE) under tensor (+ sequence),
context and expert parallelism (the grad and convert commands, in-process on every rank), on glm4_moe's harness
(test_glm4_moe_parallel.py: the same tree, oracle and bounds).

    python tests/distributed/launch.py 2 -k deepseek     # TP2+SP, CP2, EP2 (across the two DP replicas), CP2xEP2

The gradient against Hugging Face's, per parameter: float64 at the float32-sigmoid bound 1e-6, float32 at 1e-5.
Conversion: HF -> dist checkpoint at TP2 / EP2 -> HF, bit-exact (MLA's latent projections and norms included).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_glm4_moe_parallel import (
    LAYOUTS,
    TOL,
    _grad,
    _worst,
    check_round_trips_at_tp_and_ep,
    sigmoid_router_setup,
)


@pytest.fixture(scope="module")
def ds_setup() -> tuple[Path, dict[str, torch.Tensor]]:
    return sigmoid_router_setup("deepseek_v3")


@pytest.mark.world(2)
def test_deepseek_grad_matches_hf_under_every_layout(ds_setup) -> None:
    d, ref = ds_setup
    assert any(".self_attn.kv_b_proj." in n for n in ref)
    for name in ("tp2sp", "cp2", "ep2", "cp2ep2"):  # tp2sp: k_rope's partial gradients summed (models/mla.py)
        for schedule, dtype in (("replay", "float64"), ("packed", "float32")):
            grads = _grad(d, f"ds_{name}_{schedule}_{dtype}", schedule, "--dtype", dtype, *LAYOUTS[name])
            err = _worst(grads, ref)
            assert err[0] <= TOL[dtype], (name, schedule, dtype, err)


@pytest.mark.world(2)
def test_deepseek_conversion_round_trips_bit_exact_at_tp_and_ep(ds_setup) -> None:
    from megatron_branch.checkpoint.hf_io import HFTensorReader

    d, _ = ds_setup
    assert any(k.endswith("kv_a_proj_with_mqa.weight") for k in HFTensorReader(d / "hf").keys())
    check_round_trips_at_tp_and_ep(d, "ds")


@pytest.mark.world(2)
@pytest.mark.parametrize("kind", ["tp2_sp", "cp2"])
def test_planner_prices_mla_under_tp2_sp_and_cp2(kind: str) -> None:
    """The planner (plan/mla.py) against the activation meter on every rank: under TP2+SP the latent cache is
    whole on each rank (the down projection is replicated: 3 layers x 68 root rows x (16 + 4) values), under CP2
    the ring's per-head K/V (3 layers x this rank's 34 zigzag rows x 4 heads x (6 + 4 + 12)); the step's saved
    bytes within 5% (segment recompute)."""
    from megatron_branch.models import ModelArch, build_model
    from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
    from megatron_branch.plan import Layout, RolloutShape
    from megatron_branch.plan.measure import measure_step
    from megatron_branch.plan.memory import step_peak
    from megatron_branch.testing import tiny_hf_config

    cfg = ParallelConfig(cp=2) if kind == "cp2" else ParallelConfig(tp=2, sequence_parallel=True)
    groups = initialize_parallel(cfg)
    a = ModelArch.from_hf_config(tiny_hf_config("deepseek_v3", hidden_size=32, num_layers=3))
    torch.manual_seed(0)
    model = build_model(a, dtype=torch.float32, tp=groups.tp_size, sequence_parallel=groups.sequence_parallel)
    shape = RolloutShape(prompt_length=64, responses=6, response_length=12, shared_response_length=4)
    got = measure_step(model, shape, vocab=37, branch_micro_batch=3, recompute=True, groups=groups)
    layout = Layout(cp=2) if kind == "cp2" else Layout(tp=2)
    pk = step_peak(
        a, shape, layout, act_bytes=4, branch_micro_batch=3, segment_recompute=True, layer_recompute=False
    )
    per_row = (16 + 4) if kind == "tp2_sp" else 4 * (6 + 4 + 12)
    rows = 68 if kind == "tp2_sp" else 34
    assert got.cached_kv == 3 * rows * per_row * 4, (kind, got)
    print(f"{kind}: planned / measured {pk.saved / got.saved_peak:.3f}")
    assert pk.saved == pytest.approx(got.saved_peak, rel=0.05), (kind, pk, got)
