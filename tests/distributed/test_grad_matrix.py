"""`megatron-branch grad` under every parallel layout vs the float64 HF oracle (the command run in-process).

    python tests/distributed/launch.py 2 -k grad_matrix     # TP2+SP, CP2, DP2
    python tests/distributed/launch.py 4 -k grad_matrix     # CP4, TP2xCP2+SP, DP2xCP2
    python tests/distributed/launch.py 8 -k cp8             # CP8

Every rank calls `megatron_branch.cli.main([...])` with the same arguments (as torchrun would start it); rank 0
writes the files into a folder whose path rank 0 broadcasts. Every rank then reads them and compares them with the
single-rank reference it computes itself: HF in float64 with exact norms (`testing.hf_policy_gradient`), so every
rank fails or passes together and the next collective never hangs. The tree has a shared prompt, shared response
beginnings and segment lengths (11, 9, 3, 5, 1, 7) that no 2*CP divides.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_helpers import shared_tmp
from safetensors.torch import load_file

from megatron_branch.cli import main
from megatron_branch.data import PrefixTree, Rollout, write_rollouts_jsonl

TOL = 1e-5  # float32 command vs float64 oracle, per parameter (relative Frobenius error)


def _rollouts() -> list[Rollout]:
    """Two prompt groups; group A has a shared response beginning [3, 4, 5] with three branches under it."""
    gen = torch.Generator().manual_seed(11)

    def rand(n: int) -> list[int]:
        return [int(x) for x in torch.randint(10, 37, (n,), generator=gen)]

    pa, pb = rand(11), rand(9)
    return [
        Rollout(prompt=pa, response=[3, 4, 5, 6] + rand(4), advantage=1.25),  # leaf of 5 under [3,4,5]
        Rollout(prompt=pa, response=[3, 4, 5, 7], advantage=-0.5),  # leaf of 1
        Rollout(prompt=pa, response=[3, 4, 5, 8] + rand(2), advantage=0.75),  # leaf of 3
        Rollout(prompt=pa, response=[9] + rand(6), advantage=-1.0),  # leaf of 7 under the prompt
        Rollout(prompt=pb, response=[1] + rand(4), advantage=0.5),
        Rollout(prompt=pb, response=[2] + rand(2), advantage=-1.5),
    ]


def _setup(rollouts: list[Rollout]) -> Path:
    from megatron_branch.testing import tiny_hf_config, tiny_hf_model

    d = shared_tmp("grad_matrix_")
    if dist.get_rank() == 0:
        tiny_hf_model(tiny_hf_config("qwen2", heads=4, kv_heads=2), seed=4).save_pretrained(d / "hf")
        write_rollouts_jsonl(d / "r.jsonl", rollouts)
    dist.barrier()
    return d


def _oracle(d: Path, rollouts: list[Rollout]) -> tuple[float, dict[str, torch.Tensor], list[list[float]]]:
    """(loss, grads by HF name, each rollout's response logprobs) of HF in float64, rollout by rollout."""
    from transformers import AutoModelForCausalLM

    from megatron_branch.testing import exact_hf_norms, hf_policy_gradient

    hf = exact_hf_norms(
        AutoModelForCausalLM.from_pretrained(d / "hf", dtype=torch.float64, attn_implementation="sdpa")
    )
    loss, grads = hf_policy_gradient(hf, rollouts)
    lps = []
    with torch.no_grad():
        for r in rollouts:
            seq = torch.tensor([r.prompt + r.response])
            logp = torch.log_softmax(hf(input_ids=seq).logits[0, :-1], dim=-1)  # [L-1, V]
            lps.append(logp.gather(1, seq[0, 1:, None]).squeeze(1)[len(r.prompt) - 1 :].tolist())
    return loss, grads, lps


def _grad(d: Path, name: str, schedule: str, *layout: str) -> tuple[int, dict[str, torch.Tensor], list]:
    """Run the command on every rank; (rc, grads, logprobs rows) as rank 0 wrote them."""
    out, lp = d / f"{name}.safetensors", d / f"{name}.lp.jsonl"
    argv = ["grad", "--hf", str(d / "hf"), "--rollouts", str(d / "r.jsonl"), "--out", str(out)]
    rc = main(
        [*argv, "--schedule", schedule, "--logprobs-out", str(lp), "--branch-micro-batch", "2", *layout]
    )
    if rc != 0:
        return rc, {}, []
    return rc, load_file(out), [json.loads(line) for line in open(lp)]


def _check(name: str, grads: dict, rows: list, ref: tuple, tol: float = TOL) -> None:
    _, ref_grads, ref_lps = ref
    assert set(grads) == set(ref_grads), name
    for n, g in ref_grads.items():
        err = ((grads[n].double() - g).norm() / g.norm().clamp(min=1e-30)).item()
        assert err <= tol, f"{name} {n}: relative grad error {err:.2e} > {tol}"
    # logprobs complete on rank 0: every rollout, every response token, none missing (NaN) under CP/DP
    assert [r["index"] for r in rows] == list(range(len(ref_lps))), name
    for r, want in zip(rows, ref_lps):
        assert len(r["logprobs"]) == len(want) and r["logprobs"] == pytest.approx(want, abs=1e-5), (name, r)


LAYOUTS = {
    2: [
        ("tp2sp", ["--tp", "2", "--sequence-parallel"]),
        ("cp2", ["--cp", "2"]),
        ("dp2", []),
    ],
    4: [
        ("cp4", ["--cp", "4"]),
        ("tp2cp2sp", ["--tp", "2", "--cp", "2", "--sequence-parallel"]),
        ("dp2cp2", ["--cp", "2"]),
    ],
}


@pytest.mark.world(2, 4)
def test_grad_matrix_matches_hf_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron_branch.parallel.ddp as ddp_mod

    calls: list[str] = []
    real = ddp_mod.finalize_megatron_grads

    def spy(ddp_model: torch.nn.Module, **kw: object) -> None:  # proves the default path IS megatron's DDP
        calls.append(type(ddp_model).__name__)
        assert all(hasattr(p, "main_grad") for p in ddp_model.module.parameters())
        real(ddp_model, **kw)

    monkeypatch.setattr(ddp_mod, "finalize_megatron_grads", spy)
    rollouts = _rollouts()
    d = _setup(rollouts)
    ref = _oracle(d, rollouts)
    for name, layout in LAYOUTS[dist.get_world_size()]:
        for schedule in ("packed", "replay"):
            rc, grads, rows = _grad(d, f"{name}_{schedule}", schedule, *layout)
            assert rc == 0, (name, schedule)
            _check(f"{name} {schedule}", grads, rows, ref)
    assert calls == ["DistributedDataParallel"] * 2 * len(LAYOUTS[dist.get_world_size()])
    # megatron DDP (the default) and the plain reference reduction give the same gradients (the DP x CP layout)
    name, layout = LAYOUTS[dist.get_world_size()][-1]
    rc, manual, _ = _grad(d, f"{name}_manual", "replay", *layout, "--grad-sync", "manual")
    assert rc == 0
    ddp = load_file(d / f"{name}_replay.safetensors")
    for n, g in manual.items():
        err = ((ddp[n] - g).norm() / g.norm().clamp(min=1e-30)).item()
        assert err <= 1e-6, f"ddp vs manual {n}: {err:.2e}"


@pytest.mark.world(2, 4)
def test_grad_backend_means_the_same_under_cp(capsys: pytest.CaptureFixture[str]) -> None:
    """`grad --backend X --cp N` runs executor X on every ring block (exact against the HF oracle) and says so in
    its JSON line, as at --cp 1; a backend that cannot run is refused in one line (exit 2) before any work."""
    rollouts = _rollouts()
    d = _setup(rollouts)
    ref = _oracle(d, rollouts)
    cp = str(dist.get_world_size())
    for backend in ("packed", "reference"):
        capsys.readouterr()
        rc, grads, rows = _grad(d, f"cp_{backend}", "replay", "--cp", cp, "--backend", backend)
        out = capsys.readouterr().out.strip().splitlines()
        assert rc == 0, backend
        _check(f"cp{cp} {backend}", grads, rows, ref)
        if dist.get_rank() == 0:
            summary = json.loads(out[-1])
            assert summary["backend"] == backend and summary["cp"] == int(cp), summary
    for backend, words in (("repeat", "one-rank benchmark baseline"), ("flex", "no backward on CPU")):
        capsys.readouterr()
        rc, _, _ = _grad(d, f"cp_{backend}", "packed", "--cp", cp, "--backend", backend)
        err = capsys.readouterr().err.strip()
        assert rc == 2 and not (d / f"cp_{backend}.safetensors").exists()
        if dist.get_rank() == 0:
            assert words in err and "\n" not in err, err


@pytest.mark.world(8)
def test_grad_matrix_cp8() -> None:
    rollouts = _rollouts()[:3]  # prompt of 11 >= 8: every CP rank holds a real token
    d = _setup(rollouts)
    ref = _oracle(d, rollouts)
    rc, grads, rows = _grad(d, "cp8_replay", "replay", "--cp", "8")
    assert rc == 0
    _check("cp8 replay", grads, rows, ref)


@pytest.mark.world(2)
def test_grad_refusals_before_work(capsys: pytest.CaptureFixture[str]) -> None:
    """Impossible layouts fail with one line on every rank, before any collective or model work, writing nothing."""
    # the boundary of check_cp_fits: longest segment 2 runs under CP2 (and is exact), longest 1 is refused
    fits = [
        Rollout(prompt=[1, 2], response=[3], advantage=1.0),
        Rollout(prompt=[1, 2], response=[4], advantage=-1),
    ]
    d = _setup(fits)
    rc, grads, rows = _grad(d, "boundary", "packed", "--cp", "2")
    assert rc == 0
    _check("cp2 boundary", grads, rows, _oracle(d, fits))
    if dist.get_rank() == 0:
        write_rollouts_jsonl(
            d / "r.jsonl", [Rollout(prompt=[1], response=[r], advantage=1.0) for r in (2, 3)]
        )
    dist.barrier()
    assert max(s.length for s in PrefixTree.build(_read(d)).segments) == 1
    capsys.readouterr()
    cases = [
        (["--cp", "2"], "longest prefix-tree segment has 1 tokens"),
        (["--tp", "3"], "tensor parallel size 3"),  # 4 heads
        (["--tp", "2", "--cp", "2"], "tp*cp = 2*2 = 4 ranks > world size 2"),
        (["--cp", "2", "--schedule", "naive"], "--schedule naive has no context parallelism"),
    ]
    for i, (layout, words) in enumerate(cases):
        rc, _, _ = _grad(d, f"refused{i}", "packed", *layout)
        err = capsys.readouterr().err.strip()
        if dist.get_rank() == 0:  # an error every rank raised is printed once, by rank 0 (docs/errors.md)
            assert rc == 2 and words in err and "\n" not in err, (layout, err)
        else:
            assert rc == 2 and err == "", (layout, err)
        assert not (d / f"refused{i}.safetensors").exists()


def _read(d: Path) -> list[Rollout]:
    from megatron_branch.data import read_rollouts_jsonl

    return read_rollouts_jsonl(d / "r.jsonl")
