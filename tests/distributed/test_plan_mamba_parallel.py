"""The planner's Mamba-2 hybrid terms (plan/mamba.py) against the activation meter under TP2 + SP, on every rank: a
tiny Nemotron 3 with every block kind (Mamba-2 heads and groups, attention heads and the experts split over TP), and
the fork state each rank's cache registers (its share of the SSM heads and conv channels).

python tests/distributed/launch.py 2 -k plan_mamba
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
