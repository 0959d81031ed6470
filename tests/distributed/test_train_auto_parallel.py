"""`schedule.name: auto` under DP2 without a budget (train/auto_schedule.py): the budget is the device's free memory
(here the host's available memory shared by the node's ranks), the smallest over the ranks, so both ranks pick the
same schedule each step; the run equals the run with the schedule it picked (bitwise)."""

from __future__ import annotations

import shutil

import torch
import torch.distributed as dist
from dist_helpers import shared_tmp
from test_train_loop import _agree, _cfg
from train_helpers import params, run_steps


def test_dp2_auto_without_a_budget_picks_alike_and_equals_the_pick() -> None:
    d = shared_tmp("train-auto-")
    try:
        auto, rows = run_steps(_cfg(d / "auto", "schedule.name=auto", "trainer.total_training_steps=2"))
        picked = auto.actor.auto.last.schedule
        _agree([(r["schedule/auto_packed"], r["schedule/auto_budget_gb"]) for r in rows])
        assert picked == "packed" and rows[-1]["schedule/auto_budget_gb"] > 0  # tiny: packed fits any host
        ref, _ = run_steps(_cfg(d / "ref", f"schedule.name={picked}", "trainer.total_training_steps=2"))
        a, b = params(auto), params(ref)
        assert all(torch.equal(a[k], b[k]) for k in a)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(d, ignore_errors=True)
