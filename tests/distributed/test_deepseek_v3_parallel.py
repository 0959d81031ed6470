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
