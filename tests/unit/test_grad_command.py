"""`megatron-branch grad`: the stable contract, parity between schedules, and one-line errors for bad input."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_branch.cli import main
from megatron_branch.data import write_rollouts_jsonl
from megatron_branch.testing import (
    exact_hf_norms,
    hf_policy_gradient,
    random_tree_rollouts,
    tiny_hf_config,
    tiny_hf_model,
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("grad")
    hf = tiny_hf_model(tiny_hf_config("llama", tie=True), seed=2)
    hf.save_pretrained(d / "hf")
    write_rollouts_jsonl(d / "r.jsonl", random_tree_rollouts(groups=2, levels=2, branches=3, seed=3))
    return d


def argv(hf: Path, rollouts: Path, out: Path, *extra: str) -> list[str]:
    return ["grad", "--hf", str(hf), "--rollouts", str(rollouts), "--out", str(out), *extra]


def grad(
    workdir: Path, capsys: pytest.CaptureFixture[str], *extra: str, out: str = "g.safetensors"
) -> tuple[int, dict, str]:
    rc = main(argv(workdir / "hf", workdir / "r.jsonl", workdir / out, "--overwrite", *extra))
    cap = capsys.readouterr()
    lines = [ln for ln in cap.out.strip().splitlines() if ln.strip()]
    return rc, (json.loads(lines[-1]) if rc == 0 else {}), cap.err


@pytest.mark.slow
def test_schedules_agree_and_match_hf_float64(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = {}
    for schedule in ("naive", "packed", "replay"):
        rc, summary, _ = grad(
            workdir,
            capsys,
            "--schedule",
            schedule,
            "--dtype",
            "float64",
            "--logprobs-out",
            str(workdir / f"lp_{schedule}.jsonl"),
            out=f"g_{schedule}.safetensors",
        )
        assert rc == 0
        assert {"loss", "positions_logical", "positions_computed", "schedule"} <= summary.keys()
        assert summary["schedule"] == schedule
        assert summary["backend"] == ("megatron-core" if schedule == "naive" else "merge")  # what ran
        results[schedule] = (summary, load_file(workdir / f"g_{schedule}.safetensors"))
    naive_summary, naive = results["naive"]
    assert naive_summary["positions_computed"] == naive_summary["positions_logical"]
    assert (
        results["replay"][0]["positions_computed"]
        == results["replay"][0]["positions_tree"]
        < naive_summary["positions_logical"]
    )

    from transformers import AutoModelForCausalLM

    from megatron_branch.data import read_rollouts_jsonl

    hf = exact_hf_norms(
        AutoModelForCausalLM.from_pretrained(workdir / "hf", dtype=torch.float64, attn_implementation="sdpa")
    )
    hf_loss, hf_grads = hf_policy_gradient(hf, read_rollouts_jsonl(workdir / "r.jsonl"))
    assert set(naive) == {n for n, p in hf.named_parameters()}  # every trainable parameter, HF names
    for schedule, (summary, grads) in results.items():
        assert summary["loss"] == pytest.approx(hf_loss, rel=1e-10)
        for name, g in grads.items():
            assert g.dtype == torch.float64 and g.shape == hf_grads[name].shape
            err = ((g - hf_grads[name]).norm() / hf_grads[name].norm()).item()
            assert err <= 1e-9, f"{schedule} {name}: {err:.2e}"
    lp = {s: [json.loads(x) for x in open(workdir / f"lp_{s}.jsonl")] for s in results}
    assert [r["index"] for r in lp["replay"]] == list(range(len(lp["naive"])))
    for a, b in zip(lp["replay"], lp["naive"]):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-12)


BAD_LINES = {
    "not json": ("{prompt: 1}", "invalid JSON"),
    "missing field": ('{"prompt": [1], "response": [2]}', "advantage"),
    "id beyond vocab": ('{"prompt": [1], "response": [999], "advantage": 1}', "999"),
    "empty response": ('{"prompt": [1], "response": [], "advantage": 1}', "response"),
    "negative id": ('{"prompt": [-1], "response": [2], "advantage": 1}', "-1"),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_bad_rollouts_one_line_error(workdir: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    line, word = BAD_LINES[case]
    bad = workdir / f"bad_{case.replace(' ', '_')}.jsonl"
    bad.write_text(line + "\n")
    out = workdir / "never.safetensors"
    rc = main(argv(workdir / "hf", bad, out))
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("megatron-branch: error:") and "\n" not in err
    assert f"{bad}:1" in err and word in err
    assert not out.exists()


def test_bad_configuration_refused_before_work(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = grad(workdir, capsys, "--tp", "3")
    assert rc == 2 and "tensor parallel size 3" in err
    rc, _, err = grad(workdir, capsys, "--tp", "2")  # world of 1 cannot hold tp=2
    assert rc == 2 and "world size 1" in err
    rc = main(argv(workdir / "nope", workdir / "r.jsonl", workdir / "x"))
    assert rc == 2 and "nope" in capsys.readouterr().err
    rc = main(argv(workdir / "hf", workdir / "r.jsonl", workdir / "no/dir/g.st"))
    assert rc == 2 and "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("folder", ["/proc", "/sys"])
def test_unwritable_out_refused_before_work(
    workdir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, folder: str
) -> None:
    """Issue 35 item 8: os.access says yes there (as root), creating a file does not; refused before loading."""
    import megatron_branch.assembly.engine as engine

    monkeypatch.setattr(engine, "build_stage", lambda *a, **k: pytest.fail("the model was loaded"))
    rc = main(argv(workdir / "hf", workdir / "r.jsonl", f"{folder}/o.safetensors"))
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err, err
    assert err.startswith(
        f"megatron-branch: error: output '{folder}/o.safetensors': cannot create a file in folder"
    )


@pytest.mark.slow
def test_module_entry_point_has_no_traceback(workdir: Path) -> None:
    bad = workdir / "bad.jsonl"
    bad.write_text('{"prompt": [1], "response": [2], "advantage": "high"}\n')
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_branch",
            "grad",
            "--hf",
            str(workdir / "hf"),
            "--rollouts",
            str(bad),
            "--out",
            str(workdir / "x.st"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("megatron-branch: error:")


def test_bad_options_refused_before_work(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = argv(workdir / "hf", workdir / "r.jsonl", workdir / "o.st")
    for extra in (["--backend", "foo"], ["--branch-micro-batch", "0"], ["--chunk-tokens", "-1"]):
        with pytest.raises(SystemExit) as e:  # argparse: usage + one error line, status 2
            main([*base, *extra])
        assert e.value.code == 2
        assert "Traceback" not in capsys.readouterr().err
    (workdir / "a_dir").mkdir(exist_ok=True)
    rc = main([*base[:-1], str(workdir / "a_dir")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "is a folder" in err and "\n" not in err


def test_backend_that_cannot_run_is_refused_in_one_line(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--backend names what runs, or the run stops before any work with one line (exit 2), writing nothing."""
    from megatron_branch.attention.dispatch import BACKENDS
    from megatron_branch.commands.grad import add_grad_command

    sub = argparse.ArgumentParser().add_subparsers()
    add_grad_command(sub)
    backend = next(a for a in sub.choices["grad"]._actions if a.dest == "backend")
    assert set(backend.choices) == set(BACKENDS)  # every backend is reachable from the command
    for extra, words in (
        (["--backend", "flex"], "no backward on CPU"),
        (["--schedule", "naive", "--backend", "packed"], "runs megatron's own attention"),
    ):
        rc, _, err = grad(workdir, capsys, *extra, out="refused.safetensors")
        assert rc == 2 and words in err and "\n" not in err.strip(), (extra, err)
        assert not (workdir / "refused.safetensors").exists()


@pytest.mark.slow
def test_replay_options_keep_parity(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--recompute, --recompute-layers, --branch-micro-batch and --chunk-tokens change what is kept alive and how
    many forwards run, never the gradient."""
    rc, _, _ = grad(workdir, capsys, "--schedule", "naive", "--dtype", "float64", out="opt_naive.safetensors")
    assert rc == 0
    want = load_file(workdir / "opt_naive.safetensors")
    for extra in (
        # --chunk-tokens 0: chunks off, the walk segment by segment (its leaf micro-batches)
        ["--recompute", "--branch-micro-batch", "1", "--chunk-tokens", "0"],
        ["--recompute", "--recompute-layers", "--branch-micro-batch", "2", "--chunk-tokens", "0"],
        ["--backend", "packed", "--branch-micro-batch", "3", "--chunk-tokens", "0"],
        ["--chunk-tokens", "24"],
        ["--recompute", "--recompute-layers"],  # the default chunks (4096 tokens: the whole tiny tree)
    ):
        rc, summary, _ = grad(
            workdir, capsys, "--schedule", "replay", "--dtype", "float64", *extra, out="opt.safetensors"
        )
        assert rc == 0 and summary["positions_computed"] == summary["positions_tree"]
        assert summary["backend"] == ("packed" if "packed" in extra else "merge")
        got = load_file(workdir / "opt.safetensors")
        for name, g in want.items():
            assert ((got[name] - g).norm() / g.norm()).item() <= 1e-9, (extra, name)


def test_tiny_assets_example_feeds_the_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "make_tiny_assets.py"))["main"](
        ["--out", str(tmp_path), "--groups", "1", "--prompt-len", "6"]
    )
    rc = main(argv(tmp_path / "hf", tmp_path / "rollouts.jsonl", tmp_path / "g.st"))
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and summary["positions_computed"] < summary["positions_logical"]


def test_progress_lines_on_stderr_and_quiet(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 35 item 9: grad says what it is doing (loading, tree, schedule, writing) on stderr, stdout keeps only
    the JSON line; --quiet silences the phases."""
    rc, summary, err = grad(workdir, capsys, out="p.safetensors")
    assert rc == 0 and summary["out"].endswith("p.safetensors")
    assert (
        summary["chunk_tokens"] == 4096 and "chunk_tokens_off" not in summary
    )  # replay's default chunks ran
    lines = err.strip().splitlines()
    phases = [ln.split("] ", 1)[1] for ln in lines]
    assert all(ln.startswith("grad: [") for ln in lines), lines
    assert phases[0].startswith("inputs checked; prefix tree: ") and phases[1].startswith("loading the model")
    assert phases[2] == "replay schedule: forward and backward" and phases[3].startswith("writing ")
    assert phases[4] == "done" and len(phases) == 5
    rc, _, err = grad(workdir, capsys, "--quiet", out="p.safetensors")
    assert rc == 0 and err == ""
