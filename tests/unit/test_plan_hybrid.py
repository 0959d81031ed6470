"""The planner's family and layer-kind terms against this machine: parameters against the built models, a gated
delta net layer's FLOPs against torch's FlopCounterMode (exact), its saved bytes against the activation meter,
whole steps of Qwen3 (replay) and the hybrid (one sequence per rollout) against the meter, and the presets."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_branch.cli import main
from megatron_branch.memory import ActivationMeter
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.plan import MODEL_PRESETS, Layout, RolloutShape
from megatron_branch.plan.activations import (
    Dims,
    kv_grad_bytes,
    layer_kv_bytes,
    linear_state_bytes,
    linear_state_grad_bytes,
)
from megatron_branch.plan.flops import step_flops
from megatron_branch.plan.layers import gdn_mixer_flops, gdn_mixer_saved_bytes
from megatron_branch.plan.measure import measure_step
from megatron_branch.plan.memory import step_peak
from megatron_branch.plan.model import parameter_count
from megatron_branch.testing import tiny_hf_config, tiny_hf_model

VOCAB = 37
TOL = 0.04  # as tests/unit/test_plan.py: the step's saved-bytes model against the meter


@pytest.fixture(scope="module", autouse=True)
def _single_rank() -> None:
    initialize_parallel(ParallelConfig())


def _arch(family: str, **kw: object) -> ModelArch:
    return ModelArch.from_hf_config(tiny_hf_config(family, **kw))


@pytest.mark.parametrize(
    "family,kw",
    [("qwen3", {"tie": False}), ("qwen3", {"tie": True}), ("qwen3_5", {"num_layers": 4}), ("qwen2", {})],
)
def test_parameter_count_is_the_models(family: str, kw: dict) -> None:
    cfg = tiny_hf_config(family, **kw)
    arch = ModelArch.from_hf_config(cfg)
    pc = parameter_count(arch)
    assert pc["total"] == sum(p.numel() for p in build_model(arch).parameters())  # vocab 37 unpadded at TP1
    hf = tiny_hf_model(cfg)
    assert pc["total"] == sum(p.numel() for p in hf.parameters())
    replicated = {
        n for n, p in build_model(arch).named_parameters() if not getattr(p, "tensor_model_parallel", False)
    }
    assert pc["replicated"] == sum(
        p.numel() for n, p in build_model(arch).named_parameters() if n in replicated
    )


def _gdn(dtype: torch.dtype = torch.float32):  # noqa: ANN202
    arch = _arch("qwen3_5", num_layers=1, layer_types=["linear_attention"])
    return arch, build_model(arch, dtype=dtype).decoder.layers[0].self_attention


@pytest.mark.parametrize("n", [10, 64, 150])
def test_gdn_layer_flops_are_exact(n: int) -> None:
    arch, gdn = _gdn()
    x = torch.randn(n, 1, arch.hidden_size, requires_grad=True)
    with FlopCounterMode(display=False) as fwd:
        out, _ = gdn(x, None)
    with FlopCounterMode(display=False) as bwd:
        out.square().sum().backward()
    proj = 2 * n * arch.hidden_size * (sum(arch.gdn_in_proj_sections()) + arch.linear_v_dim)
    want_fwd, want_bwd = gdn_mixer_flops(arch, n)
    assert fwd.get_total_flops() == proj + want_fwd
    conv_bwd = bwd.get_flop_counts()["Global"].pop(torch.ops.aten.convolution_backward, 0)
    conv_fwd = fwd.get_flop_counts()["Global"][torch.ops.aten.convolution]
    # FlopCounterMode charges the depthwise convolution's backward as a dense one: compare the rest exactly
    assert bwd.get_total_flops() - conv_bwd == 2 * proj + want_bwd - 2 * conv_fwd
    assert conv_fwd == 2 * (2 * arch.linear_qk_dim + arch.linear_v_dim) * arch.linear_conv_kernel_dim * (
        n + 3
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [10, 64, 150])
def test_gdn_layer_saved_bytes_match_the_meter(n: int, dtype: torch.dtype) -> None:
    arch, gdn = _gdn(dtype)
    x = torch.randn(n, 1, arch.hidden_size, dtype=dtype, requires_grad=True)
    with ActivationMeter(gdn) as meter:
        out, _ = gdn(x, None)
        got = meter.current_bytes - n * arch.hidden_size * dtype.itemsize  # in_proj's input: a layer term
        out.sum().backward()
    want = gdn_mixer_saved_bytes(arch, n, e=dtype.itemsize, kernel="torch")
    assert want == pytest.approx(got, rel=0.02), (want, got)
    # the torch path's triangular solve dominates: fla's kernel saves far less (its source; not measured here)
    assert gdn_mixer_saved_bytes(arch, n, e=dtype.itemsize, kernel="fla") < want / 3


def test_planted_gdn_term_error_is_caught() -> None:
    """The comparison can fail: the GDN layer counted as an attention layer (K/V, no mixer) is far off."""
    arch, gdn = _gdn()
    x = torch.randn(150, 1, arch.hidden_size, requires_grad=True)
    with ActivationMeter(gdn) as meter:
        out, _ = gdn(x, None)
        got = meter.current_bytes
        out.sum().backward()
    as_attention = gdn_mixer_saved_bytes(arch, 150, e=4, kernel="fla")
    assert abs(as_attention - got) > 0.5 * got


def test_qwen3_replay_step_matches_the_meter() -> None:
    """Qwen3's free head_dim (4 heads x 16 = 64 wide attention in a hidden of 32) and q/k norms: measured exact
    (the q norm's input, a copy of the query n d wide, was once missing: 5.6% under)."""
    arch = _arch("qwen3", hidden_size=32, ffn=64)
    torch.manual_seed(0)
    model = build_model(arch)
    shape = RolloutShape(prompt_length=64, responses=8, response_length=8)
    got = measure_step(model, shape, vocab=VOCAB, branch_micro_batch=4)
    pk = step_peak(arch, shape, Layout(), act_bytes=4, branch_micro_batch=4, segment_recompute=False)
    assert pk.saved == pytest.approx(got.saved_peak, rel=TOL), (pk, got)


def _counter_conv_backward(arch: ModelArch, n: int) -> int:
    """What FlopCounterMode charges one GDN layer's convolution_backward over n tokens (its own formula)."""
    _, gdn = _gdn()
    out, _ = gdn(torch.randn(n, 1, arch.hidden_size, requires_grad=True), None)
    with FlopCounterMode(display=False) as bwd:
        out.sum().backward()
    return bwd.get_flop_counts()["Global"][torch.ops.aten.convolution_backward]


@pytest.mark.slow
def test_hybrid_one_sequence_step_matches_the_meter_and_flops() -> None:
    """One rollout per forward through megatron's GDN (naive-fused), against the planner's one-response tree:
    saved bytes within 5% (measured 0.8%), FLOPs exact."""
    arch = _arch("qwen3_5", num_layers=4, hidden_size=32, ffn=64)
    torch.manual_seed(0)
    model = build_model(arch)
    shape = RolloutShape(prompt_length=150, responses=1, response_length=20)
    got = measure_step(model, shape, vocab=VOCAB, schedule="naive-fused", count_flops=True)
    pk = step_peak(
        arch, shape, Layout(), schedule="packed", act_bytes=4, layer_recompute=False, gdn_kernel="torch"
    )
    assert pk.saved == pytest.approx(got.saved_peak, rel=0.05), (pk, got)
    fl = step_flops(arch, shape, "packed")
    n = fl.positions
    assert got.positions_computed == n == 170 and fl.attention > 0
    # FlopCounterMode counts every matmul (the fused CPU attention kernel: 0) and its own conv-backward formula
    conv_fwd = 2 * (2 * arch.linear_qk_dim + arch.linear_v_dim) * arch.linear_conv_kernel_dim * (n + 3)
    counted = fl.dense + fl.logits + fl.linear_attention
    counted += arch.num_linear_layers * (_counter_conv_backward(arch, n) - 2 * conv_fwd)
    assert got.matmul_flops == counted


def test_presets_are_the_published_configs() -> None:
    q8, q32, q36 = MODEL_PRESETS["qwen3-8b"], MODEL_PRESETS["qwen3-32b"], MODEL_PRESETS["qwen3.6-27b"]
    assert (q8.hidden_size, q8.num_layers, q8.num_attention_heads, q8.num_query_groups, q8.ffn_hidden_size) == (
        4096, 36, 32, 8, 12288,
    )  # fmt: skip
    assert q32.head_dim == 128 != q32.hidden_size // q32.num_attention_heads and q32.qk_norm
    assert q36.family == "qwen3_5" and q36.layer_types.count("full_attention") == 16 == q36.num_full_layers
    assert (q36.hidden_size, q36.ffn_hidden_size, q36.head_dim, q36.rotary_dim, q36.rotary_percent) == (
        5120, 17408, 256, 64, 0.25,
    )  # fmt: skip
    assert (q36.linear_num_key_heads, q36.linear_num_value_heads, q36.linear_key_head_dim) == (16, 48, 128)
    assert q36.attention_output_gate and q36.zero_centered_norm and q36.rope_theta == 1e7
    assert parameter_count(q8)["total"] == pytest.approx(8.19e9, rel=1e-3)  # Qwen3-8B: 8.2B
    assert parameter_count(q32)["total"] == pytest.approx(32.76e9, rel=1e-3)  # Qwen3-32B: 32.8B
    assert parameter_count(q36)["total"] == pytest.approx(
        26.90e9, rel=1e-3
    )  # 27B text model (no vision, no MTP)


def test_plan_command_for_the_announced_model(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "qwen3.6-27b", "--prompt-length", "122880", "--responses", "16"]
    argv += ["--response-length", "8192", "--gpus", "8", "--gpu", "h20", "--json"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert d["shape"]["positions_logical"] == 2_097_152
    assert any("gated delta net" in n for n in d["notes"])
    mem = d["memory_bytes_per_rank"]
    assert mem["ring_buffers"] == 0 or d["layout"]["cp"] > 1
    assert d["flops"]["naive"] > d["flops"]["replay"]
    # exact replay of all 16 branches fits on 8 x H20 (TP8: the fastest that fits, CP layouts weighed too), the
    # cache holding the attention layers' K/V and every GDN layer's fork state, with their accumulators
    assert d["fits"] and d["layout"]["cp"] == 1 and d["schedule"] == "replay"
    assert {(r["layout"]["tp"], r["layout"]["cp"]) for r in d["rejected"]} >= {(2, 4), (1, 8)}
    arch, lay = MODEL_PRESETS["qwen3.6-27b"], d["layout"]
    dm = Dims.of(arch, Layout(tp=lay["tp"]), 2)
    kv = arch.num_full_layers * layer_kv_bytes(dm, 122880) + arch.num_linear_layers * linear_state_bytes(dm)
    # the accumulators: fp32 for the bf16 K/V and conv tails (schedule/prefix_cache.py WideSum)
    grads = kv_grad_bytes(dm, 122880) + arch.num_linear_layers * linear_state_grad_bytes(dm)
    assert mem["kv_grads"] == grads and grads > kv
    # at the root's own backward under full recompute its recomputed K/V replace the released cache entry,
    # outside autograd (counted as cached_kv, as the meter sees them: tests/unit/test_plan_terms.py): one copy
    assert mem["cached_kv"] == kv


@pytest.mark.slow
@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "segment_recompute"])
def test_hybrid_replay_step_matches_the_meter(recompute: bool) -> None:
    """Replay through the GDN state: the root's K/V (attention layers) and its GDN state at the fork (S and the
    conv tail per GDN layer, plus their gradient accumulators) cached, the leaves batched from it."""
    arch = _arch("qwen3_5", num_layers=4, hidden_size=32, ffn=64)
    torch.manual_seed(0)
    model = build_model(arch)
    shape = RolloutShape(prompt_length=96, responses=4, response_length=12)
    got = measure_step(model, shape, vocab=VOCAB, branch_micro_batch=4, recompute=recompute)
    pk = step_peak(
        arch, shape, Layout(), act_bytes=4, branch_micro_batch=4, segment_recompute=recompute,
        layer_recompute=False, gdn_kernel="torch",
    )  # fmt: skip
    assert pk.saved == pytest.approx(got.saved_peak, rel=TOL), (pk, got)
    dm = Dims.of(arch, Layout(), 4, gdn_kernel="torch")
    state = arch.num_linear_layers * linear_state_bytes(dm)
    assert got.cached_kv == arch.num_full_layers * layer_kv_bytes(dm, 96) + state  # K/V rows + the fork state


def test_hybrid_cp_layouts_are_planned_with_the_head_exchange(capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen3.6-27B at TP4 x CP2 (4 key / 12 value GDN heads per TP rank, a block of 2 / 6 per CP rank): it fits with
    recompute full, the GDN fork state is the block's, the head exchange is in the step time; a CP size the GDN
    heads do not split is refused in one line, and the search never tries one."""
    from megatron_branch.plan import GPU_PRESETS, plan
    from megatron_branch.plan.search import candidate_layouts

    arch = MODEL_PRESETS["qwen3.6-27b"]
    shape = RolloutShape(prompt_length=122880, responses=16, response_length=8192)
    p = plan("qwen3.6-27b", arch, shape, GPU_PRESETS["h20"], 8, tp=4, cp=2, dp=1, recompute="full")
    assert p.fits and p.step_time["head_exchange"] > 0
    half = linear_state_bytes(Dims.of(arch, Layout(tp=4, cp=2), 2))
    assert 2 * half == linear_state_bytes(
        Dims.of(arch, Layout(tp=4), 2)
    )  # each CP rank: half the heads' state
    argv = ["plan", "--model", "qwen3.6-27b", "--prompt-length", "4096", "--responses", "4", "--response-length", "64",
            "--gpus", "24", "--gpu", "h20", "--tp", "8", "--cp", "3", "--dp", "1", "--recompute", "full"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "--cp 3 cannot split the hybrid's gated delta net heads" in err and "use --cp in 1, 2, 6" in err
    assert main(argv[: argv.index("--dp")]) == 2  # tp and cp fixed, the rest searched: the same line
    err = capsys.readouterr().err.strip()
    assert "--cp 3 cannot split the hybrid's gated delta net heads" in err and "use --cp in 1, 2, 6" in err
    groups = RolloutShape(prompt_length=4096, responses=4, response_length=64, prompts=6)  # dp up to 6
    cps = {lay.cp for lay in candidate_layouts(arch, groups, 48, tp=8, cp=None, dp=None, recompute="full",
                                              schedule="replay")}  # fmt: skip
    assert cps == {1, 2, 6}  # 3 would be possible by the GPU count, not by the heads
