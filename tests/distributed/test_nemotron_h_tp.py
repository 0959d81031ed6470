"""Nemotron-H (Mamba-2 hybrid) under torchrun: conversion bit-exact at TP2 and TP2+SP (each rank its share of
every in_proj and conv1d section) with logits equal to HF, and `megatron-branch grad` against the HF oracle under
TP2+SP with naive, replay and packed (float32) and replay (float64): the SSM state and conv tail of this rank's
heads handed down at each fork. A CP size the Mamba heads cannot split over is refused in one line (CP2 itself:
test_nemotron_h_cp.py). With MoE layers ("E", Nemotron 3: the sigmoid router with its correction bias, on glm4_moe's
harness, test_glm4_moe_parallel.py): the gradient under TP2+SP, EP2 (across the two DP replicas), CP2 (the Mamba
head exchange, the ring) and CP2 x EP2 (EP over the CP ranks) against HF's float64 oracle through `grad`, and
conversion HF -> dist checkpoint at TP2 / EP2 -> HF bit-exact.

    python tests/distributed/launch.py 2 -k nemotron_h

Bound 1e-5 relative per parameter (transformers' SSD scan, the reference, is float32 inside: tests/unit/
test_nemotron_h.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_helpers import shared_tmp
from safetensors.torch import load_file
from test_glm4_moe_parallel import (
    LAYOUTS,
    _grad,
    _worst,
    check_round_trips_at_tp_and_ep,
    sigmoid_router_setup,
)
from test_models_tp import _check, _rollouts

from megatron_branch.checkpoint import (
    convert_hf_to_mcore,
    gather_full_state,
    hf_to_mcore_state,
    load_full_state,
    load_mcore_checkpoint,
    mcore_to_hf_state,
)
from megatron_branch.checkpoint.verify import megatron_logits
from megatron_branch.cli import main
from megatron_branch.data import write_rollouts_jsonl
from megatron_branch.models import ModelArch, build_model
from megatron_branch.models.mamba_arch import conv_sections, in_proj_sections
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.testing import hf_policy_gradient, hf_state, tiny_hf_config, tiny_hf_model


def tiny(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    # the same seed on every rank: the same weights everywhere; layers M * - M -
    return tiny_hf_model(tiny_hf_config("nemotron_h", num_layers=5, ffn=48), seed=0, dtype=dtype).eval()


@pytest.mark.world(2)
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2sp"])
def test_nemotron_h_tp2_shards_round_trip_bit_exact_and_match_hf(sp: bool) -> None:
    hf = tiny()
    arch = ModelArch.from_hf_config(hf.config)
    groups = initialize_parallel(ParallelConfig(tp=2, sequence_parallel=sp))
    model = build_model(arch, tp=2, sequence_parallel=sp)
    load_full_state(
        model, hf_to_mcore_state(hf_state(hf), arch, padded_vocab=arch.padded_vocab_size(2)), groups.tp
    )
    mixer = model.decoder.layers[0].self_attention
    assert mixer.in_proj.weight.shape[0] == sum(in_proj_sections(arch)) // 2
    assert mixer.conv1d.weight.shape[0] == sum(conv_sections(arch)) // 2
    back, want = mcore_to_hf_state(gather_full_state(model, groups.tp), arch), hf_state(hf)
    assert back.keys() == want.keys()
    assert all(torch.equal(back[k], v) for k, v in want.items())
    ids = torch.randint(0, 37, (19,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (megatron_logits(model, ids, 37, groups.tp) - ref).abs().max() <= 2e-6 * ref.abs().max()


RUNS = [
    ("tp2sp", ["--tp", "2", "--sequence-parallel"], ("naive", "replay", "packed")),
    ("tp2sp_fp64", ["--tp", "2", "--sequence-parallel", "--dtype", "float64"], ("replay",)),
]


@pytest.mark.world(2)
def test_grad_nemotron_h_under_tp2(capsys: pytest.CaptureFixture[str]) -> None:
    """Every rank holds its share of the Mamba heads and groups (the gated norm's groups too, so its norm and its
    weight's gradient are per rank); the sequence is gathered by in_proj under SP and scattered by out_proj."""
    d = shared_tmp("nemotron-h-tp-")
    rollouts = _rollouts()
    if dist.get_rank() == 0:
        tiny().save_pretrained(d / "hf")
        write_rollouts_jsonl(d / "r.jsonl", rollouts)
    dist.barrier()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(d / "hf", dtype=torch.float64)
    want = {n.replace("model.", "backbone.", 1): g for n, g in hf_policy_gradient(hf, rollouts)[1].items()}
    base = ["grad", "--hf", str(d / "hf"), "--rollouts", str(d / "r.jsonl")]
    for tag, layout, schedules in RUNS:
        for schedule in schedules:
            out = d / f"{tag}_{schedule}.safetensors"
            assert main([*base, "--out", str(out), "--schedule", schedule, *layout]) == 0, (tag, schedule)
            _check(f"nemotron_h {tag} {schedule}", load_file(out), want, 1e-5)
    # a CP size the head exchange cannot split the Mamba heads over (3 heads in 1 group): one line, exit 2, no output
    if dist.get_rank() == 0:
        cfg = tiny_hf_config("nemotron_h", num_layers=5, ffn=48)
        cfg.mamba_num_heads, cfg.n_groups = 3, 1
        tiny_hf_model(cfg, seed=0).save_pretrained(d / "hf3")
    dist.barrier()
    capsys.readouterr()
    odd = [
        "grad",
        "--hf",
        str(d / "hf3"),
        "--rollouts",
        str(d / "r.jsonl"),
        "--out",
        str(d / "cp.safetensors"),
    ]
    assert main([*odd, "--cp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    if dist.get_rank() == 0:  # the one line is printed once, by rank 0
        assert len(err.splitlines()) == 1 and "--cp 2 cannot split the Mamba-2 heads" in err, err
        assert "3 heads in 1 group (--tp 1)" in err and err.endswith("use --cp in 1, 3"), err
    assert not (d / "cp.safetensors").exists()


@pytest.mark.world(2)
def test_nemotron_h_dist_checkpoint_saved_at_tp2_loads_at_tp1_bit_exact() -> None:
    """Every layer named by its index (the layers differ), the Mamba in_proj / conv1d parts and the gated norm's
    weight split over TP."""
    tmp = shared_tmp("nemotron-h-ckpt-")
    hf = tiny()
    if dist.get_rank() == 0:
        hf.save_pretrained(str(tmp / "hf"))
    dist.barrier()
    convert_hf_to_mcore(tmp / "hf", tmp / "mc", tp=2, progress=False)
    groups = initialize_parallel(ParallelConfig(tp=1))  # dp 2: both ranks load the whole model
    model, arch, meta = load_mcore_checkpoint(tmp / "mc", tp_group=groups.tp, tp=1)
    assert meta["saved_tensor_parallel"] == 2
    full, want = mcore_to_hf_state(gather_full_state(model, groups.tp), arch), hf_state(hf)
    assert full.keys() == want.keys() and all(torch.equal(full[k], v) for k, v in want.items())


@pytest.mark.world(2)
def test_nemotron_h_moe_grad_under_tp2sp_ep2_cp2_and_conversion_at_tp2_ep2() -> None:
    """Layers M E * E - M (tests/unit/test_nemotron_h_moe.py's tiny model): replay float64 and packed float32 under
    TP2+SP, EP2, CP2 and CP2 x EP2 against HF at 1e-5 (the float32 SSD scan bounds both dtypes); then the round
    trips."""
    pattern = "ME*E-M"
    cfg = tiny_hf_config("nemotron_h", num_layers=len(pattern), ffn=48, layer_types=pattern)
    d, ref = sigmoid_router_setup("nemotron_h", cfg)
    ref = {n.replace("model.", "backbone.", 1): g for n, g in ref.items()}
    assert any(".mixer.experts.0.up_proj." in n for n in ref) and any(".mixer.A_log" in n for n in ref)
    for name in ("tp2sp", "ep2", "cp2", "cp2ep2"):
        for schedule, dtype in (("replay", "float64"), ("packed", "float32")):
            grads = _grad(d, f"nh_{name}_{schedule}_{dtype}", schedule, "--dtype", dtype, *LAYOUTS[name])
            err = _worst(grads, ref)
            assert err[0] <= 1e-5, (name, schedule, dtype, err)
    check_round_trips_at_tp_and_ep(d, "nh")
