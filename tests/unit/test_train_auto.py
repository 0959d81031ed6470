"""`schedule.name: auto` in `train` (train/auto_schedule.py; issue 33 item 2): packed when its planned activation
peak fits `schedule.memory_budget_gb` and the update's tree is at most one chunk of `schedule.chunk_tokens`, replay
otherwise (plan/auto.py's rule, the one `grad --schedule auto` uses);
the pick and why in the metrics and the run's JSON; a run with auto equals the run with the schedule it picked
(same tokens, rewards and parameters, float64); what packed refuses makes every pick replay."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_train_loop import _cfg, _max_rel, _params, _run, task  # noqa: F401 (task: fixture)
from train_helpers import TINY_ARCH

from megatron_branch.errors import UserError
from megatron_branch.plan import Layout
from megatron_branch.plan.auto import share_peak
from megatron_branch.testing import random_tree_rollouts
from megatron_branch.train.auto_schedule import AutoSchedule
from megatron_branch.train.config_io import load_config


def _picker(
    budget_gb: float | None, problem: str | None = None, micro: int = 1, chunk_tokens: int | None = 4096
) -> AutoSchedule:
    from megatron_branch.models import ModelArch

    arch = ModelArch(family="qwen2", vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
                     num_query_groups=2, ffn_hidden_size=64, max_position_embeddings=256)  # fmt: skip
    return AutoSchedule(arch=arch, layout=Layout(), act_bytes=4, layer_recompute=False, micro_batches=micro,
                        budget_gb=budget_gb, problem=problem, chunk_tokens=chunk_tokens, is_main=False)  # fmt: skip


def test_the_pick_at_a_budget_that_fits_packed_and_at_one_that_does_not() -> None:
    batch = random_tree_rollouts(groups=2, branches=2, seed=3)
    peak, tokens = share_peak(_picker(1).arch, batch, Layout(), act_bytes=4, layer_recompute=False)
    assert peak > 0 and tokens == 31
    fits = _picker(peak / 1e9).pick([batch], None)  # the budget itself fits
    assert fits.schedule == "packed" and fits.packed_bytes == peak and "fits" in fits.reason
    short = _picker(peak * 0.99 / 1e9).pick([batch], None)
    assert short.schedule == "replay" and "does not fit" in short.reason
    # the largest update decides, and micro-batches shrink what one chunk holds
    big = random_tree_rollouts(groups=4, branches=3, seed=4)
    assert _picker(peak / 1e9).pick([batch, big], None).schedule == "replay"
    assert _picker(1, micro=2).pick([big], None).packed_bytes < _picker(1).pick([big], None).packed_bytes
    # the update's tree over one chunk picks replay (the flip exactly at the chunk budget); chunks off: packed
    spans = _picker(100, chunk_tokens=tokens - 1).pick([batch], None)
    assert (
        spans.schedule == "replay"
        and f"{tokens} tokens span more than one chunk of {tokens - 1}" in spans.reason
    )
    assert _picker(100, chunk_tokens=tokens).pick([batch], None).schedule == "packed"
    assert _picker(100, chunk_tokens=None).pick([batch, big], None).schedule == "packed"
    # the largest update's tree decides, and a micro-batch is its own tree
    _, big_tokens = share_peak(_picker(1).arch, big, Layout(), act_bytes=4, layer_recompute=False)
    assert _picker(100, chunk_tokens=big_tokens - 1).pick([batch, big], None).schedule == "replay"
    assert _picker(100, micro=2, chunk_tokens=big_tokens - 1).pick([big], None).schedule == "packed"
    refused = _picker(100, problem="schedule.recompute=true is replay's").pick([batch], None)
    assert refused.schedule == "replay" and refused.reason.startswith("packed cannot run this")
    p = _picker(100)
    p.pick([batch], None)
    assert p.metrics() == {"schedule/auto_packed": 1.0, "schedule/auto_packed_gb": peak / 1e9,
                           "schedule/auto_budget_gb": 100.0, "schedule/auto_tokens": float(tokens)}  # fmt: skip


@pytest.mark.slow
def test_train_with_auto_is_train_with_the_schedule_it_picked(task: Path, tmp_path: Path) -> None:  # noqa: F811
    """Each pick's run is the picked schedule's bit for bit: packed (fits, one chunk), replay where packed does not
    fit, and replay where it fits but each update's tree spans more than one chunk of 8 tokens."""
    runs = {}
    chunks = "schedule.chunk_tokens=8"
    for name, extra in (
        ("packed", ("schedule.name=packed",)),
        ("replay", ("schedule.name=replay", chunks)),
        ("auto-fits", ("schedule.name=auto", "schedule.memory_budget_gb=100")),
        ("auto-short", ("schedule.name=auto", "schedule.memory_budget_gb=1e-9", chunks)),
        ("auto-chunks", ("schedule.name=auto", "schedule.memory_budget_gb=100", chunks)),
    ):
        cfg = _cfg(task, tmp_path / name, "model.dtype=float64", "trainer.total_training_steps=3", *extra)
        runs[name] = _run(cfg)
    for auto, picked, why in (
        ("auto-fits", "packed", "one chunk of 4096"),
        ("auto-short", "replay", "does not fit"),
        ("auto-chunks", "replay", "span more than one chunk of 8"),
    ):
        tr, rows = runs[auto]
        ref, ref_rows = runs[picked]
        assert [r["schedule/auto_packed"] for r in rows] == [float(picked == "packed")] * 3, auto
        assert tr.actor.plan.schedule == picked and tr.actor.auto.last.schedule == picked
        assert why in tr.actor.auto.last.reason, (auto, tr.actor.auto.last.reason)
        for x, y in zip(ref_rows, rows, strict=True):
            assert x["_tokens"] == y["_tokens"] and x["_rewards"] == y["_rewards"], (auto, x["step"])
        assert _max_rel(_params(ref), _params(tr)) == 0.0, auto  # the same schedule ran: bitwise
        assert tr._auto_summary()["schedule_auto"]["picked"] == picked
        # auto's replay runs with the run's chunks (the final JSON says with which budget)
        assert tr._auto_summary()["chunk_tokens"] == (8 if picked == "replay" else None)
    # the planted check: packed and chunked replay differ in their last bits, so the bitwise checks tell which ran;
    # and the picks agree with each other as every exact schedule does
    assert 0.0 < _max_rel(_params(runs["packed"][0]), _params(runs["replay"][0])) < 1e-9
    assert _max_rel(_params(runs["auto-fits"][0]), _params(runs["auto-chunks"][0])) < 1e-9


def test_auto_config(tmp_path: Path) -> None:
    base = [TINY_ARCH, "data.task=needles", f"trainer.default_local_dir={tmp_path}"]
    cfg = load_config(None, [*base, "schedule.name=auto", "schedule.memory_budget_gb=2.5"])
    assert cfg.schedule.name == "auto" and cfg.schedule.memory_budget_gb == 2.5
    with pytest.raises(UserError, match="memory_budget_gb must be positive"):
        load_config(None, [*base, "schedule.name=auto", "schedule.memory_budget_gb=0"])
    demo = Path(__file__).resolve().parents[2] / "examples" / "configs" / "demo.yaml"
    assert load_config(demo, [f"trainer.default_local_dir={tmp_path}"]).schedule.name == "auto"
