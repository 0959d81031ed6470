"""`schedule: auto` (plan/auto.py; issue 33 item 2): packed when its planned memory fits the budget, replay
otherwise, and the JSON says which and why. The rule against its two sides, packed's tree-based peak against the
planner's packed terms, and `grad --schedule auto` end to end (both picks, the gradient unchanged, the CPU refusal)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_grad_command import grad, workdir  # noqa: F401  (the module's fixture)

from megatron_branch.data import PrefixTree
from megatron_branch.models import ModelArch
from megatron_branch.plan import Layout, RolloutShape
from megatron_branch.plan.auto import choose, packed_peak_bytes
from megatron_branch.plan.measure import shape_rollouts
from megatron_branch.plan.memory import step_peak


def test_the_rule() -> None:
    small, large = choose(10**9, 2 * 10**9), choose(3 * 10**9, 2 * 10**9)
    assert small.schedule == "packed" and "fits" in small.reason
    assert large.schedule == "replay" and "does not fit" in large.reason
    assert choose(2 * 10**9, 2 * 10**9).schedule == "packed"  # the budget itself fits


@pytest.mark.parametrize("recompute_layers", [False, True])
def test_packed_peak_from_the_tree_is_the_planners(recompute_layers: bool) -> None:
    """On a regular shape the tree-based peak equals the planner's packed terms (plan/memory.py) exactly."""
    arch = ModelArch(family="qwen2", vocab_size=64, hidden_size=64, num_layers=2, num_attention_heads=4,
                     num_query_groups=2, head_dim=16, ffn_hidden_size=128, qkv_bias=True,
                     max_position_embeddings=4096)  # fmt: skip
    shape = RolloutShape(prompt_length=100, responses=6, response_length=12, prompts=3)
    tree = PrefixTree.build(shape_rollouts(shape, 64, 0), vocab_size=64)
    got = packed_peak_bytes(arch, tree, Layout(), act_bytes=4, layer_recompute=recompute_layers)
    pk = step_peak(arch, shape, Layout(), schedule="packed", act_bytes=4, layer_recompute=recompute_layers)
    assert got == pk.saved + pk.ring_buffers + pk.logits + pk.dispatcher


@pytest.mark.slow
def test_grad_auto_picks_and_says_why(workdir, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001, F811
    rc, _, _ = grad(workdir, capsys, "--schedule", "replay", "--dtype", "float64", out="auto_ref.safetensors")
    assert rc == 0
    want = load_file(workdir / "auto_ref.safetensors")
    for budget, picked in (("1e-6", "replay"), ("100", "packed")):
        rc, summary, _ = grad(workdir, capsys, "--schedule", "auto", "--memory-budget", budget, "--dtype", "float64",
                              out="auto.safetensors")  # fmt: skip
        assert rc == 0 and summary["schedule"] == picked == summary["schedule_auto"]["picked"]
        auto = summary["schedule_auto"]
        assert auto["budget_bytes"] == int(float(budget) * 1e9) and auto["packed_bytes"] > 0
        assert ("does not fit" in auto["reason"]) == (picked == "replay")
        # auto's replay runs with replay's default chunks
        assert summary["chunk_tokens"] == (4096 if picked == "replay" else None)
        got = load_file(workdir / "auto.safetensors")
        for name, g in want.items():
            assert ((got[name] - g).norm() / g.norm()).item() <= 1e-9, (budget, name)
    # packed refuses segment recompute: auto says so and runs replay
    rc, summary, _ = grad(workdir, capsys, "--schedule", "auto", "--memory-budget", "100", "--recompute",
                          out="auto.safetensors")  # fmt: skip
    assert rc == 0 and summary["schedule"] == "replay"
    assert summary["schedule_auto"]["reason"].startswith("packed cannot run this")
    # replay's chunk budget is replay's own setting, not a reason to pick replay
    rc, summary, _ = grad(workdir, capsys, "--schedule", "auto", "--memory-budget", "100", "--chunk-tokens", "64",
                          out="auto.safetensors")  # fmt: skip
    assert rc == 0 and summary["schedule"] == "packed" and summary["chunk_tokens"] is None


def test_grad_auto_on_cpu_needs_a_budget(workdir, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001, F811
    if torch.cuda.is_available():
        pytest.skip("on a GPU the budget is the free device memory")
    rc, _, err = grad(workdir, capsys, "--schedule", "auto", out="auto_refused.safetensors")
    assert rc == 2 and "--memory-budget" in err and "\n" not in err.strip()
    assert not (workdir / "auto_refused.safetensors").exists()


def _plan_json(capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    from megatron_branch.cli import main

    base = ["plan", "--prompt-length", "130048", "--responses", "16", "--response-length", "1024", "--gpus", "8",
            "--gpu", "h20", "--tp", "8", "--cp", "1", "--dp", "1", "--schedule", "auto", "--json"]  # fmt: skip
    rc = main([*base, *extra])
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc in (0, 1) and (rc == 0 or not d["fits"])  # 1 (where plan says so): the plan does not fit
    return d


def test_plan_auto_uses_the_same_rule(capsys: pytest.CaptureFixture[str]) -> None:
    """plan --schedule auto: the packed plan when it fits the device (32B at the 2.1M target with full recompute:
    each layer keeps only its input), replay when it does not (segment recompute only: packed's activations)."""
    d = _plan_json(capsys, "--model", "qwen2.5-32b", "--recompute", "full")
    auto = d["schedule_auto"]
    assert d["schedule"] == auto["picked"] == "packed" and d["fits"]
    assert auto["packed_bytes"] == d["memory_bytes_per_rank"]["total"] <= auto["budget_bytes"] == 96 * 10**9
    d = _plan_json(capsys, "--model", "qwen2.5-32b", "--recompute", "selective")
    auto = d["schedule_auto"]
    assert d["schedule"] == auto["picked"] == "replay" and "does not fit" in auto["reason"]
    assert auto["packed_bytes"] > auto["budget_bytes"]
