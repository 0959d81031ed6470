"""Qwen3 dense and the Qwen3.5 hybrid under torchrun: conversion bit-exact at TP2 (tensors, files, a dist checkpoint
saved at TP2 loading at TP1), and `megatron-branch grad` against the HF oracle under TP2+SP, TP2 without SP and
(every schedule that has CP) CP2; the hybrid with naive, replay and packed (its GDN state handed down).

    python tests/distributed/launch.py 2 -k models_tp

Every rank runs the command with the same arguments and compares rank 0's files with the single-rank HF oracle it
computes itself (float64, exact norms), so every rank passes or fails together. Bounds as in the unit tests:
Qwen3 float64 1e-9; Qwen3.5 1e-5 (megatron's and HF's gated delta rule compute in float32,
tests/unit/test_hybrid_models.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_helpers import shared_tmp
from safetensors.torch import load_file

from megatron_branch.checkpoint import (
    convert_hf_to_mcore,
    convert_mcore_to_hf,
    gather_full_state,
    hf_to_mcore_state,
    load_full_state,
    load_mcore_checkpoint,
    mcore_to_hf_state,
)
from megatron_branch.checkpoint.hf_io import HFTensorReader
from megatron_branch.checkpoint.verify import megatron_logits
from megatron_branch.cli import main
from megatron_branch.data import Rollout, write_rollouts_jsonl
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.testing import exact_hf_norms, hf_policy_gradient, tiny_hf_config, tiny_hf_model

FAMILIES = {
    "qwen3_untied": dict(family="qwen3", tie=False),
    "qwen3_tied": dict(family="qwen3", tie=True),
    "qwen3_5": dict(family="qwen3_5", num_layers=4),
}


def tiny(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    # the same seed on every rank: the same weights everywhere
    return tiny_hf_model(tiny_hf_config(ffn=48, **FAMILIES[name]), seed=0, dtype=dtype).eval()


@pytest.mark.world(2)
@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2sp"])
def test_tp2_shards_round_trip_bit_exact_and_match_hf(name: str, sp: bool) -> None:
    hf = tiny(name)
    arch = ModelArch.from_hf_config(hf.config)
    groups = initialize_parallel(ParallelConfig(tp=2, sequence_parallel=sp))
    model = build_model(arch, tp=2, sequence_parallel=sp)
    load_full_state(
        model, hf_to_mcore_state(hf.state_dict(), arch, padded_vocab=arch.padded_vocab_size(2)), groups.tp
    )
    if arch.is_hybrid:  # each rank holds its share of every in_proj / conv1d section (checkpoint/layouts.py)
        gdn = model.decoder.layers[0].self_attention
        assert gdn.in_proj.weight.shape[0] == sum(arch.gdn_in_proj_sections()) // 2
        assert gdn.conv1d.weight.shape[0] == sum(arch.gdn_conv_sections()) // 2
    back = mcore_to_hf_state(gather_full_state(model, groups.tp), arch)
    want = {
        k: v for k, v in hf.state_dict().items() if not (arch.tie_word_embeddings and k == "lm_head.weight")
    }
    assert back.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(back[k], v), k
    ids = torch.randint(0, 37, (11,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (megatron_logits(model, ids, 37, groups.tp) - ref).abs().max() <= 2e-5 * ref.abs().max()


@pytest.mark.world(2)
@pytest.mark.parametrize("name", ["qwen3_untied", "qwen3_5"])
def test_dist_checkpoint_saved_at_tp2_loads_at_tp1_and_exports_bit_exact(name: str) -> None:
    tmp = shared_tmp("models-tp-")
    hf = tiny(name)
    if dist.get_rank() == 0:
        hf.save_pretrained(str(tmp / "hf"))
    dist.barrier()
    convert_hf_to_mcore(tmp / "hf", tmp / "mc", tp=2, progress=False)
    groups = initialize_parallel(ParallelConfig(tp=1))  # dp 2: both ranks load the whole model
    model, arch, meta = load_mcore_checkpoint(tmp / "mc", tp_group=groups.tp, tp=1)
    assert meta["saved_tensor_parallel"] == 2
    full = mcore_to_hf_state(gather_full_state(model, groups.tp), arch)
    for k, v in hf.state_dict().items():
        assert torch.equal(full[k], v), k
    convert_mcore_to_hf(tmp / "mc", tmp / "out")  # loads at TP2 again, rank 0 writes
    if dist.get_rank() == 0:
        src, dst = HFTensorReader(tmp / "hf"), HFTensorReader(tmp / "out")
        assert sorted(src.keys()) == sorted(dst.keys())
        assert all(torch.equal(src.get(k), dst.get(k)) for k in src.keys())
    dist.barrier()


def _rollouts() -> list[Rollout]:
    """A shared prompt with shared response beginnings, forks at two depths, a 1-token leaf, a response that is a
    prefix of others ([3, 4, 5]: it ends where its siblings fork), a second group."""
    gen = torch.Generator().manual_seed(11)

    def rand(n: int) -> list[int]:
        return [int(x) for x in torch.randint(10, 37, (n,), generator=gen)]

    pa, pb = rand(11), rand(9)
    return [
        Rollout(prompt=pa, response=[3, 4, 5, 6] + rand(4), advantage=1.25),
        Rollout(prompt=pa, response=[3, 4, 5, 7], advantage=-0.5),
        Rollout(prompt=pa, response=[3, 4, 5, 8] + rand(2), advantage=0.75),
        Rollout(prompt=pa, response=[9] + rand(6), advantage=-1.0),
        Rollout(prompt=pa, response=[3, 4, 5], advantage=0.4),
        Rollout(prompt=pb, response=[1] + rand(4), advantage=0.5),
        Rollout(prompt=pb, response=[2], advantage=-1.5),
    ]


def _setup(name: str) -> tuple[Path, dict[str, torch.Tensor]]:
    d = shared_tmp("models-tp-")
    rollouts = _rollouts()
    if dist.get_rank() == 0:
        tiny(name).save_pretrained(d / "hf")
        write_rollouts_jsonl(d / "r.jsonl", rollouts)
    dist.barrier()
    from transformers import AutoModelForCausalLM

    hf = exact_hf_norms(
        AutoModelForCausalLM.from_pretrained(d / "hf", dtype=torch.float64, attn_implementation="sdpa")
    )
    return d, hf_policy_gradient(hf, rollouts)[1]


def _grad(d: Path, tag: str, *args: str) -> dict[str, torch.Tensor]:
    out = d / f"{tag}.safetensors"
    rc = main(["grad", "--hf", str(d / "hf"), "--rollouts", str(d / "r.jsonl"), "--out", str(out), *args])
    assert rc == 0, (tag, rc)
    return load_file(out)


def _check(tag: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float) -> None:
    assert got.keys() == want.keys(), tag
    for n, g in want.items():
        err = ((got[n].double() - g).norm() / g.norm().clamp(min=1e-30)).item()
        assert err <= tol, f"{tag} {n}: relative grad error {err:.2e} > {tol}"


QWEN3_RUNS = [
    ("tp2sp", ["--tp", "2", "--sequence-parallel"], ("naive", "packed", "replay")),
    ("tp2", ["--tp", "2"], ("naive", "replay")),
    (
        "tp2_manual",
        ["--tp", "2", "--grad-sync", "manual"],
        ("packed",),
    ),  # q/k norms summed by parallel/grads.py
    ("cp2", ["--cp", "2"], ("packed", "replay")),
    ("dp2", [], ("naive", "replay")),  # each replica its share of the prompt groups, DDP sums
]


@pytest.mark.world(2)
def test_grad_qwen3_every_layout() -> None:
    """float64 at 1e-9 in every layout and schedule; float32 replay at 1e-5 under TP2+SP, CP2, DP2."""
    d, want = _setup("qwen3_untied")
    for tag, layout, schedules in QWEN3_RUNS:
        for schedule in schedules:
            got = _grad(d, f"{tag}_{schedule}", "--schedule", schedule, "--dtype", "float64", *layout)
            _check(f"qwen3 {tag} {schedule}", got, want, 1e-9)
    for tag, layout in (("tp2sp", ["--tp", "2", "--sequence-parallel"]), ("cp2", ["--cp", "2"]), ("dp2", [])):
        got = _grad(d, f"{tag}_replay_fp32", "--schedule", "replay", "--dtype", "float32", *layout)
        _check(f"qwen3 {tag} replay float32", got, want, 1e-5)


QWEN3_5_RUNS = [
    ("tp2sp", ["--tp", "2", "--sequence-parallel"], ("naive", "replay", "packed")),
    ("tp2", ["--tp", "2"], ("naive", "replay")),
    ("tp2_manual", ["--tp", "2", "--grad-sync", "manual"], ("naive", "packed")),
    ("tp2sp_fp64", ["--tp", "2", "--sequence-parallel", "--dtype", "float64"], ("replay",)),
    ("cp2", ["--cp", "2"], ("replay", "packed")),  # GDN layers through the head exchange, attention the ring
]


@pytest.mark.world(2)
def test_grad_qwen3_5_under_tp2_and_cp2() -> None:
    """naive, and the tree schedules through the GDN state (each rank its share of the value heads and conv
    channels, the sequence gathered by in_proj under SP); under CP2 each rank runs one key head's value heads over
    the whole chunk (models/gdn_heads.py). The GDN out_norm sees one rank's value heads: its gradient
    is summed over TP by the norm itself (compat/norm.py GatedOutputNorm), under SP and without, with megatron's
    DDP and with the manual reduction."""
    d, want = _setup("qwen3_5")
    for tag, layout, schedules in QWEN3_5_RUNS:
        for schedule in schedules:
            got = _grad(d, f"{tag}_{schedule}", "--schedule", schedule, *layout)
            _check(f"qwen3_5 {tag} {schedule}", got, want, 1e-5)
