"""`schedule: auto` (plan/auto.py; issue 33 items 2 and 5): packed when its planned memory fits the budget and the
tree is at most one of replay's chunks, replay otherwise, and the JSON says which and why. The rule's table (with the
flip exactly at the chunk budget), packed's tree-based peak and tokens against the planner's, and `grad --schedule
auto` end to end (each pick, the gradient the picked schedule's, the CPU refusal)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_grad_command import grad, workdir  # noqa: F401  (the module's fixture)

from megatron_branch.data import PrefixTree
from megatron_branch.models import ModelArch
from megatron_branch.plan import Layout, RolloutShape
from megatron_branch.plan.auto import choose, decide, packed_peak_bytes, plan_tokens, share_peak
from megatron_branch.plan.measure import shape_rollouts
from megatron_branch.plan.memory import step_peak

GB = 10**9


@pytest.mark.parametrize(
    ("packed_gb", "problem", "tokens", "chunk_tokens", "picked", "says"),
    [
        (
            1,
            None,
            1000,
            4096,
            "packed",
            "are one chunk of 4096",
        ),  # fits, one chunk: replay would run packed's
        (
            2,
            None,
            4096,
            4096,
            "packed",
            "are one chunk",
        ),  # the budget itself fits; the chunk budget itself is one
        (
            1,
            None,
            4097,
            4096,
            "replay",
            "tree's 4097 tokens span more than one chunk of 4096",
        ),  # one token over
        (
            1,
            None,
            10**6,
            None,
            "packed",
            "fits the budget",
        ),  # chunks off: replay walks segments, memory alone
        (3, None, 1000, 4096, "replay", "does not fit"),
        (3, None, 10**6, None, "replay", "does not fit"),
        (
            1,
            "schedule.recompute=true is replay's",
            1000,
            4096,
            "replay",
            "packed cannot run this: schedule.rec",
        ),
    ],
)
def test_the_rule(packed_gb: int, problem: str | None, tokens: int, chunk_tokens: int | None, picked: str,
                  says: str) -> None:  # fmt: skip
    """THE rule's table (plan/auto.py): refused -> replay; does not fit -> replay; fits but the tree spans more
    than one chunk -> replay; else packed. A rule that ignored the tokens fails the 4097 row."""
    c = decide(packed_gb * GB, 2 * GB, problem, tokens=tokens, chunk_tokens=chunk_tokens)
    assert c.schedule == picked and says in c.reason, c.reason
    assert "\n" not in c.reason
    assert c.to_json() == {"picked": picked, "reason": c.reason, "packed_bytes": packed_gb * GB,
                           "budget_bytes": 2 * GB, "tokens": tokens, "chunk_tokens": chunk_tokens}  # fmt: skip
    if problem is None:
        assert choose(packed_gb * GB, 2 * GB, tokens=tokens, chunk_tokens=chunk_tokens) == c


def test_tokens_are_the_chunk_the_walk_would_run() -> None:
    """share_peak's tokens are the tree's computed positions, the count schedule/walk.py packed_groups compares with
    chunk_tokens (a tree of at most chunk_tokens is one group of its roots); micro-batches: the largest one's; the
    planner's count (plan_tokens) is the same on a regular shape, per DP rank."""
    from megatron_branch.schedule.walk import packed_groups

    arch = ModelArch(family="llama", vocab_size=64, hidden_size=32, num_layers=1, num_attention_heads=4,
                     num_query_groups=2, ffn_hidden_size=64, max_position_embeddings=512)  # fmt: skip
    shape = RolloutShape(
        prompt_length=20, responses=3, response_length=6, prompts=4, shared_response_length=2
    )
    rollouts = shape_rollouts(shape, 64, 0)
    tree = PrefixTree.build(rollouts, vocab_size=64)
    _, tokens = share_peak(arch, rollouts, Layout(), act_bytes=4, layer_recompute=False)
    assert tokens == tree.num_tokens == shape.positions_computed == plan_tokens(shape, Layout())
    assert len(list(packed_groups(tree, tree.roots, tokens))) == 1  # at the budget: one chunk, packed's
    assert len(list(packed_groups(tree, tree.roots, tokens - 1))) > 1  # one under: more than one
    _, half = share_peak(arch, rollouts, Layout(), act_bytes=4, layer_recompute=False, micro_batches=2)
    assert half == tokens // 2 == plan_tokens(shape, Layout(dp=2))


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
        assert auto["tokens"] == 71 and auto["chunk_tokens"] == 4096  # one chunk: memory alone decides here
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
    # a tree over one chunk (71 tokens, chunks of 64) picks replay although packed fits, and runs replay's step with
    # those chunks bit for bit (packed's gradient differs in its last bits: the comparison tells which one ran)
    runs = {}
    for schedule in ("replay", "auto", "packed"):
        rc, runs[schedule], _ = grad(workdir, capsys, "--schedule", schedule, "--memory-budget", "100",
                                     "--chunk-tokens", "64", "--dtype", "float64",
                                     out=f"chunks_{schedule}.safetensors")  # fmt: skip
        assert rc == 0
    summary, auto = runs["auto"], runs["auto"]["schedule_auto"]
    assert summary["schedule"] == auto["picked"] == "replay" and summary["chunk_tokens"] == 64
    assert (
        auto["tokens"] == 71 and auto["chunk_tokens"] == 64 and auto["packed_bytes"] <= auto["budget_bytes"]
    )
    assert "71 tokens span more than one chunk of 64" in auto["reason"]
    got, want, packed = (load_file(workdir / f"chunks_{s}.safetensors") for s in ("auto", "replay", "packed"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert any(not torch.equal(packed[k], want[k]) for k in want)


def test_grad_auto_on_cpu_needs_a_budget(workdir, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001, F811
    if torch.cuda.is_available():
        pytest.skip("on a GPU the budget is the free device memory")
    rc, _, err = grad(workdir, capsys, "--schedule", "auto", out="auto_refused.safetensors")
    assert rc == 2 and "--memory-budget" in err and "\n" not in err.strip()
    assert not (workdir / "auto_refused.safetensors").exists()


def _plan_json(capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[dict, str]:
    from megatron_branch.cli import main

    base = ["plan", "--prompt-length", "130048", "--responses", "16", "--response-length", "1024", "--gpus", "8",
            "--gpu", "h20", "--tp", "8", "--cp", "1", "--dp", "1", "--schedule", "auto", "--json"]  # fmt: skip
    rc = main([*base, *extra])  # a later flag in `extra` overrides base's
    out = capsys.readouterr().out
    d = json.loads(out.strip().splitlines()[-1])
    assert rc in (0, 1) and (rc == 0 or not d["fits"])  # 1 (where plan says so): the plan does not fit
    return d, out


def test_plan_auto_uses_the_same_rule(capsys: pytest.CaptureFixture[str]) -> None:
    """plan --schedule auto: 32B at the 2.1M target with full recompute fits packed (each layer keeps only its
    input), but one rank's tree (130,048 + 16 x 1,024 tokens) spans many of replay's default chunks: replay, and it
    says why; with chunks off (--chunk-tokens 0) the memory alone decides: packed there, replay where packed does
    not fit (segment recompute only: packed's activations); a tree of one chunk: packed."""
    d, out = _plan_json(capsys, "--model", "qwen2.5-32b", "--recompute", "full")
    auto = d["schedule_auto"]
    assert d["schedule"] == auto["picked"] == "replay" and d["chunk_tokens"] == auto["chunk_tokens"] == 4096
    assert auto["tokens"] == 130048 + 16 * 1024 and auto["packed_bytes"] <= auto["budget_bytes"] == 96 * 10**9
    assert "146432 tokens span more than one chunk of 4096" in auto["reason"]
    assert f"schedule auto: replay ({auto['reason']})" in out.splitlines()
    d, _ = _plan_json(capsys, "--model", "qwen2.5-32b", "--recompute", "full", "--chunk-tokens", "0")
    auto = d["schedule_auto"]
    assert d["schedule"] == auto["picked"] == "packed" and d["fits"] and auto["chunk_tokens"] is None
    assert auto["packed_bytes"] == d["memory_bytes_per_rank"]["total"] <= auto["budget_bytes"] == 96 * 10**9
    d, _ = _plan_json(capsys, "--model", "qwen2.5-32b", "--recompute", "selective", "--chunk-tokens", "0")
    auto = d["schedule_auto"]
    assert d["schedule"] == auto["picked"] == "replay" and "does not fit" in auto["reason"]
    assert auto["packed_bytes"] > auto["budget_bytes"]
    d, out = _plan_json(capsys, "--model", "qwen2.5-7b", "--prompt-length", "1000", "--response-length", "100",
                        "--responses", "2", "--tp", "1", "--gpus", "1")  # fmt: skip
    auto = d["schedule_auto"]
    assert d["schedule"] == auto["picked"] == "packed" and auto["tokens"] == 1200 <= auto["chunk_tokens"]
    assert "are one chunk of 4096" in auto["reason"] and f"schedule auto: packed ({auto['reason']})" in out
