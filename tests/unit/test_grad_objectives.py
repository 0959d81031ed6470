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
