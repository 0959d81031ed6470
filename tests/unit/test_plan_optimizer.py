"""The planner's optimizer terms and search: megatron's bytes per parameter (plain 18 = 2 + 4 + 12, distributed
6 + 12 / (dp * cp), as Megatron-LM's theoretical_memory_usage.py; float32 weights are their own master), the
offload's host terms and host<->device traffic, the gradient reduction per choice, the search over optimizer
choices and branch micro-batches, and the 2.1M-position Qwen2.5-32B target on 8 x H20."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_branch.cli import main
from megatron_branch.plan import GPU_PRESETS, MODEL_PRESETS, Layout, RolloutShape, evaluate, plan
from megatron_branch.plan.costs import memory_terms
from megatron_branch.plan.memory import static_bytes
from megatron_branch.plan.optimizer import HOST_RUNTIME_BYTES, OptimizerChoice

SMALL = RolloutShape(prompt_length=4096, responses=4, response_length=256, prompts=2)
TARGET = RolloutShape(prompt_length=130048, responses=16, response_length=1024)
TARGET_ARGV = ["--model", "qwen2.5-32b", "--prompt-length", "130048", "--responses", "16"]
TARGET_ARGV += ["--response-length", "1024", "--gpus", "8", "--gpu", "h20"]
H20 = GPU_PRESETS["h20"]
A32 = MODEL_PRESETS["qwen2.5-32b"]


@pytest.mark.parametrize("tp,cp,dp", [(1, 8, 1), (2, 2, 2), (8, 1, 1), (1, 1, 2)])
@pytest.mark.parametrize("dtype,e", [("bf16", 2), ("float32", 4)])
def test_bytes_per_parameter_are_megatrons(tp: int, cp: int, dp: int, dtype: str, e: int) -> None:
    arch, lay = MODEL_PRESETS["qwen2.5-7b"], Layout(tp=tp, cp=cp, dp=dp)
    n = static_bytes(arch, lay)["parameters_per_rank"]
    state = 12 if e == 2 else 8  # fp32 master + m + v; a float32 weight is its own master
    for distributed, want in ((False, e + 4 + state), (True, e + 4 + state / (cp * dp))):
        m = memory_terms(
            arch, SMALL, lay, "replay", dtype=dtype, optimizer=OptimizerChoice(distributed=distributed)
        )
        assert (m["parameters"] + m["gradients"] + m["optimizer_state"]) / n == pytest.approx(want, abs=1e-6)
    if e == 2:  # Megatron-LM's own figures
        assert e + 4 + 12 == 18


@pytest.mark.parametrize("fraction", [0.25, 1.0])
def test_offload_moves_state_and_master_to_the_host_and_costs_copies(fraction: float) -> None:
    lay = Layout(tp=2, cp=2, dp=2, recompute="full")
    n, s = static_bytes(A32, lay)["parameters_per_rank"], 4
    gpu = dataclasses.replace(H20, gpus_per_node=4)
    base = evaluate("m", A32, SMALL, gpu, 8, lay)
    p = evaluate("m", A32, SMALL, gpu, 8, lay, optimizer=OptimizerChoice(offload_fraction=fraction))
    assert p.memory["optimizer_state"] == pytest.approx(12 * (1 - fraction) * n / s, abs=1)
    assert (
        p.memory["parameters"] == base.memory["parameters"]
        and p.memory["gradients"] == base.memory["gradients"]
    )
    host = p.host_memory
    off = fraction * n / s
    assert host["host_master_params"] == pytest.approx(4 * off, abs=1)
    assert host["host_optimizer_state"] == pytest.approx(8 * off, abs=1)
    assert host["host_grad_staging"] == pytest.approx(4 * off, abs=1)
    assert host["host_runtime"] == HOST_RUNTIME_BYTES and host["per_node"] == 4 * host["total"]
    t = p.step_time
    assert t["offload_transfer"] == pytest.approx(8 * off / (gpu.host_link_gbps * 1e9))
    assert t["host_optimizer_step"] == pytest.approx(28 * off / (gpu.host_adam_gbps * 1e9))
    extra = t["offload_transfer"] + t["host_optimizer_step"]
    assert t["total"] == pytest.approx(base.step_time["total"] + extra) and extra > 0
    assert base.step_time["offload_transfer"] == 0 and base.host_memory["host_optimizer_state"] == 0


def test_grad_reduce_per_optimizer() -> None:
    lay = Layout(tp=1, cp=4, dp=2)
    n, s = static_bytes(A32, lay)["parameters_per_rank"], 8
    link = H20.link_gbps * 1e9
    plain = evaluate("m", A32, SMALL, H20, 8, lay, optimizer=OptimizerChoice(distributed=False))
    dist = evaluate("m", A32, SMALL, H20, 8, lay, optimizer=OptimizerChoice(distributed=True))
    assert plain.step_time["grad_reduce"] == pytest.approx(2 * (s - 1) / s * 4 * n / link)  # all-reduce fp32
    assert dist.step_time["grad_reduce"] == pytest.approx(
        (s - 1) / s * (4 + 2) * n / link
    )  # RS fp32 + AG bf16


def test_search_takes_the_smallest_offload_that_fits() -> None:
    gpu = dataclasses.replace(H20, name="h20*", memory_gb=110)
    p = plan("qwen2.5-32b", A32, TARGET, gpu, 8, tp=8, cp=1, dp=1, recompute="full", branch_micro_batch=8)
    assert p.fits and p.optimizer == OptimizerChoice(distributed=True, offload_fraction=0.25)
    q = evaluate("m", A32, TARGET, gpu, 8, p.layout, optimizer=OptimizerChoice(offload_fraction=0.0))
    assert not q.fits  # the smaller fraction does not fit: 0.25 is the least offload that does
    assert evaluate("m", A32, TARGET, gpu, 8, p.layout, optimizer=OptimizerChoice(offload_fraction=1.0)).fits
    # offload costs time: the lighter fraction that fits is faster
    heavier = evaluate("m", A32, TARGET, gpu, 8, p.layout, optimizer=OptimizerChoice(offload_fraction=1.0))
    assert p.step_time["total"] < heavier.step_time["total"]


def test_search_keeps_the_state_on_the_device_where_it_fits() -> None:
    a7 = MODEL_PRESETS["qwen2.5-7b"]
    p = plan("qwen2.5-7b", a7, TARGET, GPU_PRESETS["h200"], 8)
    assert p.fits and p.optimizer.offload_fraction == 0
    assert p.optimizer.distributed == (p.layout.cp * p.layout.dp > 1)  # sharding helps only over DP x CP > 1
    assert p.branch_micro_batch == 8  # the largest that fits wins ties


def test_host_memory_limits_the_offload() -> None:
    small_host = dataclasses.replace(H20, name="h20*", host_memory_gb=300)
    p = plan("qwen2.5-32b", A32, TARGET, small_host, 8)
    assert not p.fits
    both = evaluate("m", A32, TARGET, small_host, 8, Layout(tp=8, recompute="full"),
                    optimizer=OptimizerChoice(offload_fraction=1.0))  # fmt: skip
    assert both.fits_device and not both.fits_host and "host" in both.why_not()


def _run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[str, dict]:
    rc = main(["plan", *argv, "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    d = json.loads(out[-1])
    assert rc == (0 if d["fits"] else 1)  # 1: nothing fits
    return "\n".join(out[:-1]), d


def test_the_32b_target_fits_on_8_h20_with_offload(capsys: pytest.CaptureFixture[str]) -> None:
    text, d = _run_json(capsys, *TARGET_ARGV)
    assert d["fits"] and d["fits_device"] and d["fits_host"]
    assert d["layout"] == {"tp": 8, "cp": 1, "dp": 1, "pp": 1, "recompute": "full"}
    assert d["optimizer"] == {
        "name": "distributed + offload 0.5",
        "use_distributed_optimizer": True,
        "optimizer_cpu_offload": True,
        "optimizer_offload_fraction": 0.5,
    }
    mem = d["memory_bytes_per_rank"]
    assert mem["optimizer_state"] == mem["optimizer_state_no_distributed"] / 2  # half on the host
    assert mem["total"] <= d["gpu_memory_bytes"]
    host = d["host_memory_bytes_per_rank"]
    assert host["host_optimizer_state"] == 2 * host["host_master_params"] > 0
    assert d["host_memory_bytes_per_node"] == 8 * host["total"] <= d["host_memory_bytes"]
    assert d["step_time"]["offload_transfer"] > 0 and d["step_time"]["host_optimizer_step"] > 0
    # every other layout that does not fit is there with why (TP4 x CP2 + full fits too, slower)
    # (the pipeline layouts the search adds: plan/pipeline.py; those without PP are the 10 of before)
    assert len([r for r in d["rejected"] if r["layout"]["pp"] == 1]) == 10
    assert all(r["reason"].startswith("device") for r in d["rejected"])
    assert "the other layouts" in text and "optimizer distributed + offload 0.5" in text
    # without the offload nothing fits: the optimizer state is what breaks TP8
    _, no = _run_json(capsys, *TARGET_ARGV, "--offload-fraction", "0")
    assert not no["fits"] and no["layout"]["tp"] == 8 and no["largest_term"] == "optimizer_state"


def test_offload_without_the_distributed_optimizer_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *TARGET_ARGV, "--optimizer", "plain", "--offload-fraction", "0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs the distributed optimizer" in err[0]
