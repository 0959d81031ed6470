"""`megatron-branch grad` with the objective additions: grpo (clip, dual clip, KL, entropy, aggregation), gspo,
cispo, geo_mean and dpo, replay == naive in float64, grpo on-policy == pg, and one-line errors naming file:line for missing fields."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
from safetensors.torch import load_file

from megatron_branch.cli import main
from megatron_branch.data import Rollout, write_rollouts_jsonl
from megatron_branch.testing import random_tree_rollouts, tiny_hf_config, tiny_hf_model


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("grad_obj")
    tiny_hf_model(tiny_hf_config("qwen2"), seed=7).save_pretrained(d / "hf")
    rng = random.Random(5)
    rs = random_tree_rollouts(groups=2, levels=2, branches=3, seed=8)
    ppo = [
        dataclasses.replace(
            r,
            token_fields={
                "old_logprobs": tuple(rng.uniform(-4.5, -2.5) for _ in r.response),
                "ref_logprobs": tuple(rng.uniform(-4.5, -2.5) for _ in r.response),
                "advantages": tuple(rng.uniform(-1, 1) for _ in r.response),
            },
        )
        for r in rs
    ]
    write_rollouts_jsonl(d / "plain.jsonl", rs)
    write_rollouts_jsonl(d / "ppo.jsonl", ppo)
    pairs = []
    for k in range(3):
        prompt = tuple(rng.randrange(37) for _ in range(5))
        for chosen in (True, False):
            resp = (4, 5, 10 + chosen) + tuple(rng.randrange(37) for _ in range(2))
            ref = tuple(rng.uniform(-4.5, -2.5) for _ in resp)
            pairs.append(
                Rollout(
                    prompt=prompt,
                    response=resp,
                    pair=f"q{k}",
                    chosen=chosen,
                    token_fields={"ref_logprobs": ref},
                )
            )
    write_rollouts_jsonl(d / "dpo.jsonl", pairs)
    return d


def grad(
    d: Path, capsys: pytest.CaptureFixture[str], rollouts: str, out: str, *extra: str
) -> tuple[int, dict, str]:
    argv = [
        "grad",
        "--hf",
        str(d / "hf"),
        "--rollouts",
        str(d / rollouts),
        "--out",
        str(d / out),
        "--dtype",
        "float64",
    ]
    rc = main([*argv, *extra])
    cap = capsys.readouterr()
    lines = [ln for ln in cap.out.strip().splitlines() if ln.strip()]
    return rc, (json.loads(lines[-1]) if rc == 0 else {}), cap.err.strip()


def close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for n, g in b.items():
        assert ((a[n] - g).norm() / g.norm()).item() <= tol, n


@pytest.mark.slow
def test_grpo_on_policy_equals_pg(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, _ = grad(workdir, capsys, "plain.jsonl", "pg.st")
    assert rc == 0
    rc, summary, _ = grad(workdir, capsys, "plain.jsonl", "grpo.st", "--objective", "grpo")
    assert rc == 0 and summary["objective"] == "grpo" and summary["metrics"]["actor/pg_clipfrac"] == 0
    close(load_file(workdir / "grpo.st"), load_file(workdir / "pg.st"), 1e-12)


GRPO = [
    "--objective",
    "grpo",
    "--clip-c",
    "3",
    "--kl-coef",
    "0.1",
    "--kl-type",
    "low_var_kl",
    "--entropy-coef",
    "0.01",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        GRPO,
        [*GRPO, "--loss-agg", "seq-mean-token-sum-norm", "--loss-agg-norm", "8", "--clip-high", "0.28"],
        ["--objective", "dpo", "--beta", "0.2"],
        ["--objective", "dpo", "--dpo-loss", "ipo"],
        ["--objective", "gspo", "--clip-ratio-low", "0.0003", "--clip-ratio-high", "0.0004"],
        ["--objective", "cispo", "--clip-ratio-high", "0.28", "--kl-coef", "0.1"],
        ["--objective", "geo_mean", "--clip-ratio-low", "0.4", "--clip-ratio-high", "0.4"],
        ["--objective", "verl:gspo", "--kl-coef", "0.1"],
    ],
    ids=["grpo", "grpo_norm", "dpo", "ipo", "gspo", "cispo", "geo_mean", "verl_gspo"],
)
def test_objectives_replay_equals_naive(
    workdir: Path, capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    if any(x.startswith("verl:") for x in extra):
        pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")
    data = "dpo.jsonl" if "dpo" in extra else "ppo.jsonl"
    out = {}
    for schedule in ("naive", "replay"):
        rc, summary, err = grad(
            workdir, capsys, data, f"{schedule}.st", "--schedule", schedule, "--overwrite", *extra
        )
        assert rc == 0, err
        out[schedule] = (summary, load_file(workdir / f"{schedule}.st"))
    close(out["replay"][1], out["naive"][1], 1e-9)
    s_naive, s_replay = out["naive"][0], out["replay"][0]
    assert s_replay["loss"] == pytest.approx(s_naive["loss"], rel=1e-10)
    assert s_replay["positions_computed"] < s_naive["positions_computed"]
    for k, v in s_naive["metrics"].items():
        if not k.startswith("tree/"):
            assert s_replay["metrics"][k] == pytest.approx(v, rel=1e-10, abs=1e-14), k
    if {"gspo", "cispo", "geo_mean"} & set(extra):
        assert 0 < s_naive["metrics"]["actor/pg_clipfrac"] < 1
    if "grpo" in extra:
        m = s_naive["metrics"]
        assert (
            0 < m["actor/pg_clipfrac"] < 1 and {"actor/kl_loss", "actor/entropy", "actor/ppo_kl"} <= m.keys()
        )


BAD = {
    "kl needs ref": (
        '{"prompt": [1], "response": [2], "advantage": 1}',
        ["--objective", "grpo", "--kl-coef", "0.1"],
        "ref_logprobs",
    ),
    "grpo needs advantage": ('{"prompt": [1], "response": [2]}', ["--objective", "grpo"], "advantage"),
    "dpo needs pair": (
        '{"prompt": [1], "response": [2], "ref_logprobs": [-1]}',
        ["--objective", "dpo"],
        "pair",
    ),
    "dpo needs ref": (
        '{"prompt": [1], "response": [2], "pair": 1, "chosen": true}\\n{"prompt": [1], "response": [3], "pair": 1, "chosen": false}',
        ["--objective", "dpo"],
        "ref_logprobs",
    ),
    "dpo two chosen": (
        '{"prompt": [1], "response": [2], "pair": 1, "chosen": true, "ref_logprobs": [-1]}\\n{"prompt": [1], "response": [3], "pair": 1, "chosen": true, "ref_logprobs": [-1]}',
        ["--objective", "dpo"],
        "one chosen and one rejected",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_missing_fields_one_line_error_with_file_line(
    workdir: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    text, extra, word = BAD[case]
    bad = workdir / f"bad_{case.replace(' ', '_')}.jsonl"
    bad.write_text(text.replace("\\n", "\n") + "\n")
    rc, _, err = grad(workdir, capsys, bad.name, "never.st", *extra)
    assert rc == 2 and err.startswith("megatron-branch: error:") and "\n" not in err
    assert f"{bad}:" in err and word in err, err
    assert not (workdir / "never.st").exists()


@pytest.mark.parametrize(
    ("extra", "word"),
    [
        (["--objective", "grpo", "--clip-c", "1"], "dual-clip"),
        (["--objective", "grpo", "--loss-agg", "seq-mean-token-sum-norm"], "L_norm"),
        (["--objective", "verl:nope"], "--objective 'verl:nope'"),
    ],
)
def test_bad_objective_flags(
    workdir: Path, capsys: pytest.CaptureFixture[str], extra: list[str], word: str
) -> None:
    rc, _, err = grad(workdir, capsys, "ppo.jsonl", "never.st", *extra)
    assert rc == 2 and word in err and "\n" not in err


# ---- loss_mask (issue 31) -----------------------------------------------------------------------------------------


def _masked(rs: list[Rollout], seed: int) -> list[Rollout]:
    """Per-rollout masks (about a third context) and one wholly masked rollout."""
    rng = random.Random(seed)
    out = []
    for k, r in enumerate(rs):
        mask = [0] * len(r.response) if k == 1 else [int(rng.random() > 0.35) for _ in r.response]
        mask[-1] = int(k != 1)
        out.append(dataclasses.replace(r, loss_mask=mask))
    return out


@pytest.mark.slow
def test_loss_mask_through_grad_equals_hf_and_reports_every_logprob(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """pg with masks: naive, packed and replay equal HF's per-rollout gradient (fp64 1e-9 per parameter); the
    --logprobs-out file still has every response token; the trained-token fraction is in the metrics."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_branch.data import read_rollouts_jsonl
    from megatron_branch.testing import exact_hf_norms, hf_policy_gradient

    rs = _masked(random_tree_rollouts(groups=2, levels=2, branches=3, seed=8), seed=3)
    write_rollouts_jsonl(workdir / "masked.jsonl", rs)
    hf = exact_hf_norms(
        AutoModelForCausalLM.from_pretrained(workdir / "hf", dtype=torch.float64, attn_implementation="sdpa")
    )
    want_loss, want = hf_policy_gradient(hf, read_rollouts_jsonl(workdir / "masked.jsonl"))
    _, unmasked = hf_policy_gradient(hf, [dataclasses.replace(r, loss_mask=None) for r in rs])
    trained = sum(r.num_trained for r in rs) / sum(len(r.response) for r in rs)
    for schedule in ("naive", "packed", "replay"):
        lp = workdir / f"mlp_{schedule}.jsonl"
        rc, summary, err = grad(workdir, capsys, "masked.jsonl", "m.st", "--schedule", schedule, "--overwrite",
                                "--logprobs-out", str(lp))  # fmt: skip
        assert rc == 0, err
        assert summary["loss"] == pytest.approx(want_loss, rel=1e-10)
        assert summary["metrics"]["tree/trained_token_fraction"] == pytest.approx(trained, rel=1e-12)
        close(load_file(workdir / "m.st"), want, 1e-9)
        rows = [json.loads(x) for x in lp.read_text().splitlines()]
        assert [len(x["logprobs"]) for x in rows] == [len(r.response) for r in rs]
    got = load_file(workdir / "m.st")
    assert (
        max(((got[n] - g).norm() / g.norm()).item() for n, g in unmasked.items()) > 1e-3
    )  # the mask matters


@pytest.mark.slow
@pytest.mark.parametrize("agg", ["token-mean", "token-sum", "seq-mean-token-mean"])
def test_loss_mask_grpo_replay_equals_naive(
    workdir: Path, capsys: pytest.CaptureFixture[str], agg: str
) -> None:
    from megatron_branch.data import read_rollouts_jsonl

    rs = _masked(read_rollouts_jsonl(workdir / "ppo.jsonl"), seed=4)
    write_rollouts_jsonl(workdir / "ppo_masked.jsonl", rs)
    out = {}
    for schedule in ("naive", "replay"):
        rc, summary, err = grad(workdir, capsys, "ppo_masked.jsonl", f"{schedule}.st", "--schedule", schedule,
                                "--overwrite", *GRPO, "--loss-agg", agg)  # fmt: skip
        assert rc == 0, err
        out[schedule] = (summary, load_file(workdir / f"{schedule}.st"))
    close(out["replay"][1], out["naive"][1], 1e-9)
    assert out["replay"][0]["loss"] == pytest.approx(out["naive"][0]["loss"], rel=1e-10)


@pytest.mark.parametrize(
    ("mask", "word"),
    [
        ("[1, 2]", "value 1 is 2"),
        ("[1]", "has 1 values"),
        ('"11"', "got str"),
        ("[[1], 0]", "value 0 is [1]"),
    ],
)
def test_malformed_loss_mask_refused_in_one_line(
    workdir: Path, capsys: pytest.CaptureFixture[str], mask: str, word: str
) -> None:
    bad = workdir / "bad_mask.jsonl"
    bad.write_text('{"prompt": [1], "response": [2, 3], "advantage": 1}\n'
                   f'{{"prompt": [1], "response": [2, 4], "advantage": 1, "loss_mask": {mask}}}\n')  # fmt: skip
    rc, _, err = grad(workdir, capsys, bad.name, "never.st")
    assert rc == 2 and err.startswith("megatron-branch: error:") and "\n" not in err, err
    assert f"{bad}:2" in err and "loss_mask" in err and word in err, err
    assert not (workdir / "never.st").exists()
