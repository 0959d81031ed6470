"""The `grad` command on a Qwen3-MoE folder (single process): the stable contract against HF (float64 1e-9 per
parameter, every schedule), the MoE flags (router losses, routing replay from the JSONL field), and the refusals:
token dropping under packed/replay, MoE flags on a dense model, expert parallelism the launch cannot hold, all one
line with exit status 2 (the installed command, once, as a user runs it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_branch.cli import main
from megatron_branch.data import Rollout, write_rollouts_jsonl
from megatron_branch.testing import (
    exact_hf_norms,
    exact_hf_routers,
    hf_policy_gradient,
    random_tree_rollouts,
    tiny_hf_config,
    tiny_hf_model,
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("moe_grad")
    tiny_hf_model(tiny_hf_config("qwen3_moe", moe={"mlp_only_layers": [0]}), seed=3).save_pretrained(d / "hf")
    tiny_hf_model(tiny_hf_config("qwen3"), seed=3).save_pretrained(d / "dense")
    write_rollouts_jsonl(
        d / "r.jsonl", random_tree_rollouts(groups=2, prompt_len=6, branches=3, levels=2, seed=5)
    )
    return d


def grad(d: Path, capsys: pytest.CaptureFixture[str], *extra: str, hf: str = "hf", rollouts: str = "r.jsonl",
         out: str = "g.safetensors") -> tuple[int, dict, str]:  # fmt: skip
    argv = [
        "grad",
        "--hf",
        str(d / hf),
        "--rollouts",
        str(d / rollouts),
        "--out",
        str(d / out),
        "--overwrite",
    ]
    rc = main([*argv, *extra])
    cap = capsys.readouterr()
    lines = [ln for ln in cap.out.strip().splitlines() if ln.strip()]
    return rc, (json.loads(lines[-1]) if rc == 0 else {}), cap.err.strip()


def test_grad_matches_hf_float64_every_schedule(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM

    from megatron_branch.data import read_rollouts_jsonl
    from megatron_branch.testing import hf_experts_kwargs

    cfg_hf = AutoModelForCausalLM.from_pretrained(workdir / "hf", dtype=torch.float64, attn_implementation="sdpa",
                                                  experts_implementation="eager")  # fmt: skip
    assert hf_experts_kwargs(cfg_hf.config)
    _, want = hf_policy_gradient(
        exact_hf_routers(exact_hf_norms(cfg_hf)), read_rollouts_jsonl(workdir / "r.jsonl")
    )
    for schedule in ("naive", "packed", "replay"):
        rc, summary, err = grad(workdir, capsys, "--schedule", schedule, "--dtype", "float64")
        assert rc == 0, err
        got = load_file(workdir / "g.safetensors")
        assert got.keys() == want.keys()
        worst = max(((got[n] - w).norm() / w.norm()).item() for n, w in want.items())
        assert worst <= 1e-9, (schedule, worst)
        counts = summary["metrics"]["moe/tokens_per_expert/logical/layer_1"]  # layer 0 is dense
        assert len(counts) == 4 and sum(counts) == 2 * summary["positions_logical"]


def test_router_losses_and_routing_replay_flags(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The losses move the gradient and report megatron's names; replay reads routed_experts from the file (here
    every token routed to experts 0 and 1: a routing the model would not choose)."""
    from megatron_branch.data import read_rollouts_jsonl

    rc, plain, err = grad(
        workdir, capsys, "--schedule", "packed", "--dtype", "float64", out="plain.safetensors"
    )
    assert rc == 0, err
    losses = ["--moe-aux-loss-coeff", "0.1", "--moe-z-loss-coeff", "0.01"]
    rc, summary, err = grad(
        workdir, capsys, "--schedule", "replay", "--dtype", "float64", *losses, out="aux.safetensors"
    )
    assert rc == 0, err
    assert summary["metrics"]["load_balancing_loss"] > 0 and summary["metrics"]["z_loss"] > 0
    a, b = load_file(workdir / "plain.safetensors"), load_file(workdir / "aux.safetensors")
    assert max(((a[n] - b[n]).norm() / a[n].norm()).item() for n in a) > 1e-6
    rollouts = read_rollouts_jsonl(workdir / "r.jsonl")
    forced = [Rollout(prompt=r.prompt, response=r.response, advantage=r.advantage,
                      routed_experts=torch.tensor([[[0, 1]]] * len(r.sequence))) for r in rollouts]  # fmt: skip
    write_rollouts_jsonl(workdir / "forced.jsonl", forced)
    runs = {}
    for schedule in ("naive", "replay"):
        rc, summary, err = grad(workdir, capsys, "--schedule", schedule, "--dtype", "float64", "--routing-replay",
                                rollouts="forced.jsonl", out=f"forced_{schedule}.safetensors")  # fmt: skip
        assert rc == 0, err
        runs[schedule] = load_file(workdir / f"forced_{schedule}.safetensors")
        assert summary["metrics"]["moe/tokens_per_expert/computed/layer_1"][2:] == [0.0, 0.0]
    assert max(((runs["naive"][n] - g).norm() / g.norm()).item() for n, g in runs["replay"].items()) <= 1e-9
    rc, _, err = grad(workdir, capsys, "--routing-replay")  # r.jsonl has no records
    assert rc == 2 and "--routing-replay: missing field 'routed_experts'" in err and "\n" not in err


@pytest.mark.parametrize(
    "extra, words",
    [
        (
            ["--moe-expert-capacity-factor", "1.0", "--schedule", "packed"],
            "token dropping is not exact under sharing",
        ),
        (["--moe-expert-capacity-factor", "1.0", "--schedule", "replay"], "--schedule replay refuses it"),
        (["--ep", "2"], "--ep 2 must divide cp*dp = 1"),
        (["--ep", "3"], "expert parallel size 3 does not divide num_experts=4"),
        (["--moe-z-loss-coeff", "-1"], "z-loss-coeff must be a finite number >= 0"),
    ],
)
def test_refusals_are_one_line(
    workdir: Path, capsys: pytest.CaptureFixture[str], extra: list, words: str
) -> None:
    rc, _, err = grad(workdir, capsys, *extra, out="refused.safetensors")
    assert rc == 2 and words in err and "\n" not in err, err
    assert not (workdir / "refused.safetensors").exists()


def test_moe_flags_on_a_dense_model(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = grad(workdir, capsys, "--routing-replay", hf="dense", out="refused.safetensors")
    assert rc == 2 and "need a mixture-of-experts model (this one is dense" in err


def test_naive_runs_token_dropping(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = grad(
        workdir, capsys, "--schedule", "naive", "--moe-expert-capacity-factor", "0.5", out="drop.safetensors"
    )
    assert rc == 0, err


@pytest.mark.slow
def test_installed_command_exits_2_with_one_line(workdir: Path) -> None:
    """As a user runs it: `python -m megatron_branch grad ... --schedule replay --moe-expert-capacity-factor 1`."""
    argv = [sys.executable, "-m", "megatron_branch", "grad", "--hf", str(workdir / "hf"), "--rollouts",
            str(workdir / "r.jsonl"), "--out", str(workdir / "cli.safetensors"), "--moe-expert-capacity-factor", "1"]  # fmt: skip
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    err = p.stderr.strip()
    assert p.returncode == 2, err
    assert err.startswith("megatron-branch: error:") and "token dropping" in err and "\n" not in err, err
    assert "Traceback" not in p.stderr


def test_bench_runs_a_mixture_of_experts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`bench --experts N` (the `moe` preset's model kind): the same rollouts through the baseline and replay on
    megatron's MoELayer, FLOPs counting the top-k experts."""
    md = tmp_path / "moe.md"
    argv = ["bench", "--preset", "tiny", "--experts", "4", "--top-k", "2", "--rounds", "1", "--no-meter",
            "--variants", "naive-fused,replay", "--markdown", str(md)]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    text = md.read_text()
    assert "4 experts (top-2" in text and "| replay |" in text


def test_bench_moe_preset_counts_the_router_and_top_k_experts() -> None:
    """The `moe` preset's FLOPs per position: attention projections + the router (h x E) + k experts' SwiGLU, not
    all E experts nor a dense MLP (the planner's formula, itself checked against FlopCounterMode in
    test_plan_moe.py)."""
    from megatron_branch.bench.config import PRESETS
    from megatron_branch.bench.flops import per_position_flops

    arch = PRESETS["moe"]["model"]
    assert arch.family == "qwen3_moe" and (arch.num_experts, arch.moe_top_k, arch.moe_ffn_hidden_size) == (
        8,
        2,
        256,
    )
    h, d = 256, 64
    attention = 2 * h * (4 + 2 * 2) * d + 2 * 4 * d * h
    moe = 2 * h * 8 + 2 * (2 * 3 * h * 256)
    assert per_position_flops(arch) == 2 * (attention + moe)
