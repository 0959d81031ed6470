"""The planner for gpt-oss (models/families/gpt_oss.py): its sinks and biases in the parameter count (a built
megatron model; the published 20.9B / 116.8B totals), the sliding layers' attention FLOPs counted over the window
only (against a brute-force count of the window's visible pairs, and the expected cut on the 20b preset at its
context limit), the layer matmuls exactly as torch's FlopCounterMode counts them (the saved bytes against the
activation meter in every recompute mode: test_plan_moe.py), and the `gpt-oss-20b` / `gpt-oss-120b` presets planned
at 131,072 positions per rollout.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megatron_branch.cli import main
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.plan import MODEL_PRESETS, Layout, RolloutShape
from megatron_branch.plan.flops import attention_flops, step_flops, windowed_pairs
from megatron_branch.plan.measure import measure_step
from megatron_branch.plan.model import parameter_count
from megatron_branch.testing import tiny_hf_config

SHAPE = RolloutShape(prompt_length=64, responses=6, response_length=12, shared_response_length=4)
TARGET = [
    "--prompt-length",
    "122880",
    "--responses",
    "16",
    "--response-length",
    "8192",
]  # 131,072 per rollout


@pytest.fixture(scope="module", autouse=True)
def _single_rank() -> None:
    initialize_parallel(ParallelConfig())


def tiny() -> tuple[ModelArch, torch.nn.Module]:
    """Layer 0 sliding (window 4), layer 1 full; 4 experts top-2, biases and sinks (testing.tiny_hf_config)."""
    arch = ModelArch.from_hf_config(tiny_hf_config("gpt_oss"))
    torch.manual_seed(0)
    return arch, build_model(arch, dtype=torch.float32)


def test_parameters_count_sinks_and_biases() -> None:
    arch, model = tiny()
    assert parameter_count(arch)["total"] == sum(p.numel() for p in model.parameters())
    for name, total, active in (("gpt-oss-20b", 20.9, 3.6), ("gpt-oss-120b", 116.8, 5.1)):
        pc = parameter_count(MODEL_PRESETS[name])
        # the model card's active count: the embedding table is a lookup, not counted
        act = pc["total"] - pc["experts"] + pc["active_experts"] - pc["embedding"]
        assert (round(pc["total"] / 1e9, 1), round(act / 1e9, 1)) == (total, active), name


def _brute_pairs(n: int, ancestors: int, window: int | None) -> int:
    p = torch.arange(ancestors, ancestors + n).unsqueeze(1)  # the queries' path positions
    j = torch.arange(ancestors + n).unsqueeze(0)  # every key on the path
    seen = (p - j >= 0) & ((p - j < window) if window is not None else True)
    return int(seen.sum())


def test_windowed_pairs_are_the_windows_visible_pairs() -> None:
    """A branch of n tokens after `ancestors` path positions: the window reaches into its ancestors (a < W), stops
    inside them, or not at all (n > W); and no window."""
    for n, ancestors, window in ((5, 0, 4), (3, 2, 4), (7, 9, 4), (1, 50, 4), (40, 3, 16), (6, 6, None)):
        assert windowed_pairs(n, ancestors, window) == _brute_pairs(n, ancestors, window), (
            n,
            ancestors,
            window,
        )


def test_windows_cut_the_attention_flops_by_the_expected_ratio() -> None:
    """gpt-oss-20b at its context limit: 12 sliding layers see W = 128 keys per row (fewer only in the first 127
    positions of the root), 12 full layers every causal key; against the same model without windows."""
    arch = MODEL_PRESETS["gpt-oss-20b"]
    full = dataclasses.replace(arch, sliding_window=None, window_layers=None)
    shape = RolloutShape(prompt_length=122880, responses=16, response_length=8192)
    R, L, G, W = shape.root_length, shape.leaf_length, shape.responses, 128
    full_pairs = R * (R + 1) // 2 + G * (L * R + L * (L + 1) // 2)
    window_pairs = W * (W + 1) // 2 + (R - W) * W + G * L * W
    want = (full_pairs + window_pairs) / (2 * full_pairs)
    got = step_flops(arch, shape, "replay").attention / step_flops(full, shape, "replay").attention
    assert got == pytest.approx(want, rel=1e-12) and 0.5 < got < 0.51
    naive = step_flops(arch, shape, "naive").attention / step_flops(full, shape, "naive").attention
    assert naive < 0.51  # naive's rollouts: the same cut per rollout
    # a planted bug: the window ignored for the branch tokens (they see all their ancestors) is far off
    leaky = R * (R + 1) // 2 - (R - W) * (R - W + 1) // 2 + G * (L * R + L * (L + 1) // 2)
    assert abs((full_pairs + leaky) / (2 * full_pairs) - got) > 0.05
    assert attention_flops(full, 10, 5) == attention_flops(arch, 10, 5) + 12 * 4 * 64 * 64 * (
        _brute_pairs(10, 5, None) - _brute_pairs(10, 5, W)
    )


@pytest.mark.parametrize("recompute", [False, True])
def test_dense_flops_exact(recompute: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer matmuls (biased: addmm) and the output rows exactly as torch's FlopCounterMode counts them in
    measure_step (by op: the attention's band tiles run as bmm, counted apart). The saved bytes under every recompute
    mode: test_plan_moe.py test_saved_bytes_match_the_meter_in_every_recompute_mode."""
    from torch.utils.flop_counter import FlopCounterMode

    ops: dict[str, int] = {}
    total = FlopCounterMode.get_total_flops

    def by_op(self: FlopCounterMode) -> int:
        ops.update({str(k): v for k, v in self.get_flop_counts()["Global"].items()})
        return total(self)

    arch, model = tiny()
    monkeypatch.setattr(FlopCounterMode, "get_total_flops", by_op)
    measure_step(model, SHAPE, vocab=37, branch_micro_batch=4, recompute=recompute, count_flops=True)
    fl = step_flops(arch, SHAPE, "replay", Layout(recompute="selective" if recompute else "none"))
    assert fl.dense + fl.logits == ops["aten.mm"] + ops["aten.addmm"], ops


def test_presets_plan_at_the_context_limit(capsys: pytest.CaptureFixture[str]) -> None:
    """gpt-oss-20b fits 8 x H20; gpt-oss-120b needs two nodes (16 x H100 80GB). TP stays 1 by default (biased
    experts need expert TP 1 at TP > 1: `--etp 1`, tests/unit/test_plan_moe.py test_plan_etp_flag); a fixed --tp 2
    alone is refused in one line."""
    for model, gpus, gpu in (("gpt-oss-20b", "8", "h20"), ("gpt-oss-120b", "16", "h100")):
        argv = ["plan", "--model", model, *TARGET, "--gpus", gpus, "--gpu", gpu, "--json"]
        assert main(argv) == 0, model
        p = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert p["fits"] and p["layout"]["tp"] == 1, (model, p["layout"])
        assert p["shape"]["positions_logical"] == 2_097_152
        assert p["flops"]["naive"] > 4 * p["flops"]["replay"]
    assert main(["plan", "--model", "gpt-oss-20b", *TARGET, "--gpus", "8", "--gpu", "h20", "--tp", "2"]) == 2


def test_a_config_json_plans_like_the_preset(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    """transformers' GptOssConfig defaults (gpt-oss-120b's shape, YaRN) as a config.json: read with the same sizes
    as the `gpt-oss-120b` preset, and planned."""
    import transformers

    cfg = transformers.GptOssConfig(architectures=["GptOssForCausalLM"]).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    argv = [
        "plan",
        "--model",
        str(tmp_path / "config.json"),
        *TARGET,
        "--gpus",
        "16",
        "--gpu",
        "h100",
        "--json",
    ]
    assert main(argv) == 0
    p = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["plan", "--model", "gpt-oss-120b", *argv[3:]]) == 0
    q = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert p["flops"] == q["flops"] and p["memory_bytes_per_rank"] == q["memory_bytes_per_rank"]
