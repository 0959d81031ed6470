"""The planner for multi-latent attention (plan/mla.py): a tiny DeepSeek-V3's parameters (the built model's), its
matmul FLOPs against torch's FlopCounterMode (exact: every projection, the MoE block, the fused logprob and replay's
per-leaf-micro-batch decompression of the cached latent; the attention's math-kernel bmm's are not pair counts and
are left out), a step's saved bytes against the activation meter (replay with and without segment recompute, packed:
within 5%), the prefix cache term exactly the latent's bytes (a planner pricing per-head K/V misses it), and the
`deepseek-v3` / `kimi-k2` presets (their published sizes, multi-node plans at the 2.1M-position target with the
compact cache as its own term, `cached_latent`).

Per-layer recompute (`recompute full`) against the meter, with every other MoE family: test_plan_moe.py
test_saved_bytes_match_the_meter_in_every_recompute_mode.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_branch.cli import main
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.plan import MODEL_PRESETS, Layout, RolloutShape
from megatron_branch.plan import memory as plan_memory
from megatron_branch.plan.activations import layer_kv_bytes
from megatron_branch.plan.flops import step_flops
from megatron_branch.plan.measure import measure_step
from megatron_branch.plan.memory import step_peak
from megatron_branch.plan.model import parameter_count
from megatron_branch.testing import tiny_hf_config

# measured: replay 1.9% over the meter without recompute (the root's latent is also kv_up's saved input: counted in
# its graph and in the cache), 0.3% with segment recompute, packed 0.3%
TOL = 0.05
SHAPE = RolloutShape(prompt_length=64, responses=6, response_length=12, shared_response_length=4)
VOCAB = 37


@pytest.fixture(scope="module", autouse=True)
def _single_rank() -> None:
    initialize_parallel(ParallelConfig())


@pytest.fixture(scope="module")
def tiny() -> tuple[ModelArch, torch.nn.Module]:
    """MLA with distinct widths (4 heads, qk_nope 6, qk_rope 4, v 12, kv_lora 16, q_lora 24), layer 0 dense, then
    the DeepSeek MoE block (models/families/deepseek_v3.py TINY_MLA)."""
    arch = ModelArch.from_hf_config(tiny_hf_config("deepseek_v3", hidden_size=32, num_layers=3))
    torch.manual_seed(0)
    return arch, build_model(arch, dtype=torch.float32)


def _mm_flops(counter: FlopCounterMode) -> int:
    """FlopCounterMode's mm / addmm FLOPs (the projections and the logprob; not the attention's bmm)."""
    counts = counter.get_flop_counts()["Global"]
    return sum(v for op, v in counts.items() if str(op) in ("aten.mm", "aten.addmm"))


def test_parameters_and_matmul_flops_are_exact(
    tiny: tuple[ModelArch, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    arch, model = tiny
    monkeypatch.setattr(FlopCounterMode, "get_total_flops", _mm_flops)  # what measure_step reads
    assert parameter_count(arch)["total"] == sum(p.numel() for p in model.parameters())
    for schedule, recompute in (("replay", True), ("packed", False)):
        fl = step_flops(arch, SHAPE, schedule, Layout(recompute="selective" if recompute else "none"),
                        branch_micro_batch=4)  # fmt: skip
        got = measure_step(model, SHAPE, vocab=VOCAB, schedule=schedule, branch_micro_batch=4, recompute=recompute,
                           count_flops=True)  # fmt: skip
        assert fl.dense + fl.logits + fl.decompress == got.matmul_flops, schedule
        # replay's two leaf micro-batches each decompress the root's 68 latent rows in all 3 layers
        assert fl.decompress == (3 * 2 * 136 * 16 * 4 * (6 + 12) * 3 if schedule == "replay" else 0)


@pytest.mark.parametrize("schedule,recompute", [("replay", False), ("replay", True), ("packed", False)])
def test_saved_bytes_match_the_meter_and_the_cache_is_the_latent(
    tiny: tuple[ModelArch, torch.nn.Module], schedule: str, recompute: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    arch, model = tiny
    got = measure_step(
        model, SHAPE, vocab=VOCAB, schedule=schedule, branch_micro_batch=4, recompute=recompute
    )
    kw = dict(schedule=schedule, act_bytes=4, branch_micro_batch=4, segment_recompute=recompute,
              layer_recompute=False)  # fmt: skip
    pk = step_peak(arch, SHAPE, Layout(), **kw)
    assert pk.saved == pytest.approx(got.saved_peak, rel=TOL), (pk, got)
    if schedule != "replay":
        return
    latent = arch.num_layers * SHAPE.root_length * (arch.kv_lora_rank + arch.qk_rope_head_dim) * 4
    assert got.cached_kv == latent  # what replay's cache registered: c_kv + k_rope of the root's rows
    assert pk.kv_grads == latent and (pk.cached_kv == latent or recompute)
    # planted: a planner that prices the per-head K/V megatron's MLA forward would cache (4.4x the latent here)
    monkeypatch.setattr(plan_memory, "layer_cache_bytes", layer_kv_bytes)
    wrong = step_peak(arch, SHAPE, Layout(), **kw)
    assert wrong.cached_kv == (0 if recompute else latent * 88 // 20) != got.cached_at_peak or recompute


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    rc = main(["plan", *argv, "--json"])
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == (0 if d["fits"] else 1)
    return d


TARGET = ("--prompt-length", "122880", "--responses", "16", "--response-length", "8192")


def test_deepseek_v3_and_kimi_k2_presets_plan_the_target_on_many_nodes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Published sizes: DeepSeek-V3 671B total / 37B active (without its MTP layer), Kimi-K2 1.03T / 32.9B. Each
    prompt group is the 2.1M-position target (16 x 131072); 32 of them on 32 nodes of 8 x H200, a node per group
    (DP32, experts over EP32): the search keeps the ring out (CP1) because the cached prefix is the latent, 576 values
    per token and layer on every TP rank, visible as its own term."""
    for name, total, active in (("deepseek-v3", 671.0, 37.6), ("kimi-k2", 1026.4, 32.9)):
        pc = parameter_count(MODEL_PRESETS[name])
        assert round(pc["total"] / 1e9, 1) == total
        assert round((pc["total"] - pc["experts"] + pc["active_experts"]) / 1e9, 1) == active
    d = run_json(
        capsys, "--model", "deepseek-v3", *TARGET, "--prompts", "32", "--gpus", "256", "--gpu", "h200"
    )
    assert d["fits"] and d["shape"]["positions_logical"] == 32 * 2_097_152
    assert d["layout"]["cp"] == 1 and d["layout"]["dp"] == 32
    mem = d["memory_bytes_per_rank"]
    assert mem["cached_kv"] == 0 and mem["cached_latent"] == 61 * 122880 * (512 + 64) * 2
    assert any(n.startswith("MLA: the prefix cache holds the compressed latent") for n in d["notes"])
    # Kimi-K2 on the same nodes, the layout fixed; under CP the ring carries per-head K/V: priced as such
    fixed = ("--prompts", "32", "--gpus", "256", "--gpu", "h200", "--tp", "8", "--dp", "32", "--ep", "32")
    d = run_json(capsys, "--model", "kimi-k2", *TARGET, *fixed, "--cp", "1", "--recompute", "full")
    assert d["fits"] and d["memory_bytes_per_rank"]["cached_latent"] == 61 * 122880 * 576 * 2
    d = run_json(capsys, "--model", "kimi-k2", *TARGET, "--prompts", "16", "--gpus", "256", "--gpu", "h200",
                 "--tp", "8", "--cp", "2", "--dp", "16", "--ep", "32", "--recompute", "full")  # fmt: skip
    mem = d["memory_bytes_per_rank"]
    assert mem["cached_latent"] == 0 and mem["cached_kv"] == 61 * 61440 * 8 * (128 + 64 + 128) * 2
