"""GLM-4.5 MoE (glm4_moe: the DeepSeek-style sigmoid router with its correction bias, group-limited top-k, routed
scaling, shared experts, a first dense layer) under tensor, context and expert parallelism (the grad and convert commands,
in-process on every rank).

    python tests/distributed/launch.py 2 -k glm     # TP2+SP, CP2, EP2 (across the two DP replicas), CP2xEP2

Router losses off: the gradient against Hugging Face's, per parameter: float64 at the float32-sigmoid bound 1e-6
(megatron computes the sigmoid router's scores in float32: tests/unit/test_glm4_moe.py), float32 at 1e-5. Router
losses on (aux + seq-aux + z), float64: replay == packed (== naive where it runs: no CP) within each layout at the
same bound.
Conversion: HF -> dist checkpoint at TP2 / EP2 -> HF, bit-exact (the correction biases included).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_helpers import shared_tmp
from safetensors.torch import load_file
from test_moe_parallel import _rollouts  # the MoE layouts' tree (forks under a shared beginning)

from megatron_branch.cli import main
from megatron_branch.data import write_rollouts_jsonl

TOL = {"float64": 1e-6, "float32": 1e-5}
LAYOUTS = {
    "tp2sp": ["--tp", "2", "--sequence-parallel"],
    "cp2": ["--cp", "2"],
    "ep2": ["--ep", "2"],  # EP across the two DP replicas: lockstep
    "cp2ep2": ["--cp", "2", "--ep", "2"],  # EP over the CP ranks
}


@pytest.fixture(scope="module")
def glm_setup() -> tuple[Path, dict[str, torch.Tensor]]:
    return sigmoid_router_setup("glm4_moe")


def sigmoid_router_setup(family: str, config: Any = None) -> tuple[Path, dict[str, torch.Tensor]]:
    """(folder with hf/ and r.jsonl, the float64 HF oracle's gradient) on every rank, for a tiny model of a family
    with the DeepSeek-style router (glm4_moe, deepseek_v3: tests/distributed/test_deepseek_v3_parallel.py; the
    nemotron_h "E" layers: test_nemotron_h_tp.py); `config`: that HF config instead of the family's tiny one."""
    from transformers import AutoModelForCausalLM

    from megatron_branch.testing import (
        exact_hf_norms,
        exact_hf_routers,
        hf_experts_kwargs,
        hf_policy_gradient,
        tiny_hf_config,
        tiny_hf_model,
    )

    d = shared_tmp("glm4_moe_parallel_")
    rollouts = _rollouts()
    cfg = config if config is not None else tiny_hf_config(family)
    if dist.get_rank() == 0:
        hf = tiny_hf_model(cfg, seed=4)
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():  # correction biases that change the choice
            for m in hf.modules():
                if hasattr(m, "e_score_correction_bias"):
                    m.e_score_correction_bias.copy_(
                        0.3 * torch.randn(m.e_score_correction_bias.shape, generator=gen)
                    )
        hf.save_pretrained(d / "hf")
        write_rollouts_jsonl(d / "r.jsonl", rollouts)
    dist.barrier()
    hf = AutoModelForCausalLM.from_pretrained(d / "hf", attn_implementation="sdpa", **hf_experts_kwargs(cfg))
    _, grads = hf_policy_gradient(exact_hf_routers(exact_hf_norms(hf.to(torch.float64))), rollouts)
    return d, grads


def _grad(d: Path, name: str, schedule: str, *flags: str) -> dict[str, torch.Tensor]:
    out = d / f"{name}.safetensors"
    argv = ["grad", "--hf", str(d / "hf"), "--rollouts", str(d / "r.jsonl"), "--out", str(out), "--overwrite"]
    rc = main([*argv, "--schedule", schedule, "--branch-micro-batch", "2", *flags])
    dist.barrier()
    assert rc == 0, (name, schedule)
    return load_file(out)


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    # the frozen correction biases carry a zero gradient: HF's are buffers, with none
    extra = set(got) - set(want)
    assert set(want) <= set(got) and all(n.endswith("e_score_correction_bias") for n in extra), extra
    assert all(not got[n].any() for n in extra)  # (an expert no token reaches: zeros on both sides)
    return max(
        (((got[n].double() - w.double()).norm() / w.double().norm().clamp(min=1e-30)).item(), n)
        for n, w in want.items()
    )


@pytest.mark.world(2)
def test_glm_grad_matches_hf_under_every_layout(glm_setup) -> None:
    d, ref = glm_setup
    for name, layout in LAYOUTS.items():
        for schedule, dtype in (("replay", "float64"), ("packed", "float32")):
            grads = _grad(d, f"glm_{name}_{schedule}_{dtype}", schedule, "--dtype", dtype, *layout)
            err = _worst(grads, ref)
            assert err[0] <= TOL[dtype], (name, schedule, dtype, err)


@pytest.mark.world(2)
def test_glm_router_losses_are_schedule_invariant_under_every_layout(glm_setup) -> None:
    d, _ = glm_setup
    losses = ["--moe-aux-loss-coeff", "0.3", "--moe-seq-aux-loss-coeff", "0.2", "--moe-z-loss-coeff", "0.05"]
    for name, layout in LAYOUTS.items():
        schedules = (
            ("replay", "packed") if "--cp" in layout else ("replay", "packed", "naive")
        )  # naive: no CP
        runs = {
            s: _grad(d, f"glm_aux_{name}_{s}", s, "--dtype", "float64", *losses, *layout) for s in schedules
        }
        for s in schedules[1:]:
            assert set(runs[s]) == set(runs["replay"])
            assert _worst(runs[s], runs["replay"])[0] <= 1e-6, (name, s)


@pytest.mark.world(2)
def test_glm_conversion_round_trips_bit_exact_at_tp_and_ep(glm_setup) -> None:
    from megatron_branch.checkpoint.hf_io import HFTensorReader

    d, _ = glm_setup
    assert any(k.endswith("e_score_correction_bias") for k in HFTensorReader(d / "hf").keys())
    check_round_trips_at_tp_and_ep(d, "glm")


def check_round_trips_at_tp_and_ep(d: Path, tag: str) -> None:
    """HF (d/hf) -> dist checkpoint at TP2 and at EP2 -> HF: every tensor bit-exact."""
    from megatron_branch.checkpoint.hf_io import HFTensorReader

    src = HFTensorReader(d / "hf")
    for name, layout in {"tp2": ["--tp", "2"], "ep2": ["--ep", "2"]}.items():
        mc, back = d / f"{tag}_mc_{name}", d / f"{tag}_hf_{name}"
        assert main(["convert", "hf-to-mcore", "--hf", str(d / "hf"), "--out", str(mc), *layout]) == 0
        assert main(["convert", "mcore-to-hf", "--mcore", str(mc), "--out", str(back)]) == 0
        dist.barrier()
        dst = HFTensorReader(back)
        assert sorted(src.keys()) == sorted(dst.keys())
        for k in src.keys():
            assert torch.equal(src.get(k), dst.get(k)), (name, k)
