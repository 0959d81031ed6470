"""`megatron-branch bench` end to end at a tiny size (timings are not asserted: only what is deterministic), and the
analytic FLOP counts the speed-ups are quoted against."""

from __future__ import annotations

import json

import pytest

from megatron_branch.bench.config import VARIANTS
from megatron_branch.bench.flops import per_pair_flops, per_position_flops, per_row_head_flops, variant_flops
from megatron_branch.cli import main
from megatron_branch.data import PrefixTree
from megatron_branch.models import ModelArch
from megatron_branch.testing import random_tree_rollouts


def test_flops_of_one_prompt_with_g_responses() -> None:
    P, G, S, V = 20, 3, 5, 50
    arch = ModelArch(
        family="llama", vocab_size=V, hidden_size=16, num_layers=2, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=24,
    )  # fmt: skip
    tree = PrefixTree.build(random_tree_rollouts(vocab_size=V, prompt_len=P, branches=G, seg_len=(S, S)))
    f = variant_flops(arch, tree)
    tok, row, pair = per_position_flops(arch), per_row_head_flops(arch), per_pair_flops(arch)
    # the tree: P + G*S positions; G*S rows reach the output projection (every response token, none of the prompt)
    shared_pairs = P * (P + 1) // 2 + G * sum(p + 1 for p in range(P, P + S))
    assert f["replay"].forward == pytest.approx(tok * (P + G * S) + row * G * S + pair * shared_pairs)
    # naive-fused: every rollout alone, causal (L(L+1)/2 pairs, not L^2), the same G*S loss rows
    L = P + S
    assert f["naive-fused"].forward == pytest.approx(tok * G * L + row * G * S + pair * G * L * (L + 1) // 2)
    # megatron's naive computes every row's logits
    assert f["naive"].head == pytest.approx(row * G * L)
    # recompute: the prompt forward once more (its G fork rows included)
    assert f["replay+recompute"].step - f["replay"].step == pytest.approx(
        tok * P + row * G + pair * P * (P + 1) // 2
    )
    # full: also every layer's forward once more at every position (the output projection is not checkpointed)
    assert f["replay+recompute-full"].step - f["replay+recompute"].step == pytest.approx(
        tok * (P + G * S) + pair * shared_pairs
    )
    assert f["minimal"] == f["packed"] == f["repeat-prefix"]
    assert f["naive-fused"].step == 3 * f["naive-fused"].forward


@pytest.mark.slow
def test_bench_runs_every_variant_and_writes_json_and_plots(tmp_path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "b.json"
    rc = main(
        ["bench", "--preset", "tiny", "--branches", "2,4", "--rounds", "1", "--json", str(out),
         "--markdown", str(tmp_path / "b.md"), "--plot", str(tmp_path / "png")]
    )  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {(r["variant"], r["branches"]) for r in rows} == {(v, g) for v in VARIANTS for g in (2, 4)}
    for g in (2, 4):
        by = {r["variant"]: r for r in rows if r["branches"] == g}
        assert by["naive-fused"]["speedup"] == 1.0 and by["naive-fused"]["flop_ratio"] == 1.0
        # the tree variants' FLOP ratio IS the analytic limit; recompute is below it, the unshared ones at 1
        assert by["replay"]["flop_ratio"] == pytest.approx(by["replay"]["analytic_limit"])
        assert by["packed-nosharing"]["flop_ratio"] == 1.0
        assert 1.0 < by["replay+recompute"]["flop_ratio"] < by["replay"]["flop_ratio"]
        # same rollouts, same model: every variant's loss is the same number
        for r in by.values():
            assert r["loss"] == pytest.approx(by["naive"]["loss"], rel=1e-4, abs=1e-6)
        assert by["replay"]["positions_computed"] < by["naive-fused"]["positions_computed"]
        assert all(r["activation_meter_mb"] > 0 and len(r["times_s"]) == 1 for r in by.values())
    assert "| replay |" in (tmp_path / "b.md").read_text()
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == [
        "bench_plots.json",
        "bench_vs_G_prompt48.png",
    ]
    assert "analytic limit" in capsys.readouterr().out
    # issue 35: the machine's load is recorded, and a busy machine is said in the report
    load = report["load"]
    assert {"foreign_cpu_s", "foreign_cpu_fraction", "busy", "load_average_start", "cpus"} <= set(load)
    assert any(w.startswith("warning: the machine was busy") for w in report["warnings"]) == load["busy"]


def test_bench_outputs_follow_the_outputs_rule(tmp_path, capsys) -> None:  # noqa: ANN001
    """An existing output needs --overwrite and a missing parent folder is refused, both before the run."""
    (tmp_path / "b.json").write_text("keep")
    tiny = ["bench", "--preset", "tiny", "--rounds", "1", "--variants", "replay"]
    assert main([*tiny, "--json", str(tmp_path / "b.json")]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (tmp_path / "b.json").read_text() == "keep"
    assert main([*tiny, "--markdown", str(tmp_path / "missing" / "b.md")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--variants", "replay,fastest"], "unknown variant(s) fastest"),
        (["--heads", "3"], "--heads 3 must be a multiple of --kv-heads 2"),
        (["--dtype", "int8"], "--dtype must be one of"),
        # a hybrid whose GDN key heads (--heads // 2) do not divide its value heads: ModelArch's ValueError
        (
            ["--full-attention-interval", "2", "--heads", "5", "--kv-heads", "5", "--hidden", "40"],
            "--heads 5 with --full-attention-interval 2",
        ),
        (["--full-attention-interval", "3"], "--full-attention-interval 3 exceeds --layers 2"),
    ],
)
def test_bench_bad_input_is_one_line_exit_2(argv: list[str], match: str, capsys) -> None:  # noqa: ANN001
    assert main(["bench", "--preset", "tiny", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1


def test_a_variant_out_of_memory_is_reported_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_branch.bench import runner
    from megatron_branch.bench.config import PRESETS, BenchConfig
    from megatron_branch.bench.report import markdown

    real = runner._step

    def step(cfg, arch, model, case, variant):  # noqa: ANN001, ANN202
        if variant == "repeat-prefix":
            raise MemoryError("planted")
        return real(cfg, arch, model, case, variant)

    monkeypatch.setattr(runner, "_step", step)
    cfg = BenchConfig(
        **{**PRESETS["tiny"], "variants": ("naive-fused", "repeat-prefix", "replay"), "meter": False}
    )
    report = runner.run_bench(cfg, log=lambda *_: None)
    by = {r["variant"]: r for r in report["rows"]}
    assert by["repeat-prefix"]["failed"].startswith("out of memory: planted")
    assert by["replay"]["failed"] == "" and by["replay"]["speedup"] > 0
    assert "| repeat-prefix | out of memory: planted |" in markdown(report)


def test_profile_splits_the_step_into_ops_and_the_rest() -> None:
    """--profile: the step's wall time split into op time (GEMMs, fused attention, other ops) and time outside
    any op, next to the analytic FLOPs at the measured GEMM rate (the issue-24 overhead split)."""
    from megatron_branch.bench import runner
    from megatron_branch.bench.config import PRESETS, BenchConfig
    from megatron_branch.bench.report import markdown

    cfg = BenchConfig(**{**PRESETS["tiny"], "variants": ("naive-fused", "replay"), "meter": False,
                         "profile": "replay"})  # fmt: skip
    report = runner.run_bench(cfg, log=lambda *_: None)
    prof = report["profile"]
    assert prof["variant"] == "replay" and "aten::" in prof["table"]
    assert (
        0 < prof["op_s"]
        and prof["gemm_s"] > 0
        and prof["flash_forward_s"] > 0
        and prof["flash_backward_s"] > 0
    )
    parts = prof["gemm_s"] + prof["flash_forward_s"] + prof["flash_backward_s"] + prof["other_ops_s"]
    assert abs(parts - prof["op_s"]) < 1e-9
    assert prof["gemm_gflops"] > 0 and prof["flop_time_at_gemm_rate_s"] > 0
    assert "outside any op" in markdown(report)


def test_bench_models_with_experts_and_hybrid_layers_round_trip_their_flags() -> None:
    """--experts and --full-attention-interval together: a Qwen3.5-MoE-style hybrid; every bench model's flags
    describe it (model_flags is bench_model's inverse), and a bad expert flag is one line."""
    from megatron_branch.bench.config import bench_model, model_flags
    from megatron_branch.errors import UserError

    for kw in (
        {},
        {"experts": 4},
        {"full_attention_interval": 2},
        {"experts": 4, "top_k": 1, "full_attention_interval": 2},
    ):
        arch = bench_model(layers=4, hidden=64, **kw)
        assert arch.is_moe == bool(kw.get("experts")) and arch.is_hybrid == bool(
            kw.get("full_attention_interval")
        )
        assert bench_model(**model_flags(arch)) == arch
    assert bench_model(layers=4, hidden=64, experts=4, full_attention_interval=2).family == "qwen3_5_moe"
    with pytest.raises(UserError, match="need 0 < top-k <= experts"):
        bench_model(experts=2, top_k=3)


def test_moe_preset_runs_megatrons_moe_layer(tmp_path, capsys) -> None:  # noqa: ANN001
    """`bench --preset moe` (the README's MoE row) at a smoke size: a Qwen3-MoE model through every variant."""
    out = tmp_path / "moe.json"
    argv = ["bench", "--preset", "moe", "--prompt", "32", "--branches", "2", "--response", "4", "--rounds", "1",
            "--no-meter", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    d = json.loads(out.read_text())
    assert d["config"]["model"]["family"] == "qwen3_moe" and d["config"]["model"]["num_experts"] == 8
    assert {r["variant"] for r in d["rows"]} >= {"naive-fused", "packed", "replay"}


# --- the hybrid preset -------------------------------------------------------------------------------------------------
def test_bench_and_planner_count_a_hybrids_flops_the_same_way() -> None:
    """The bench's analytic FLOPs (bench/flops.py) and the planner's (plan/flops.py) are ONE count for a hybrid:
    per-position matmuls of both layer kinds, pairs in the full-attention layers only, and the GDN convolution +
    delta rule per sequence (each rollout unshared, each tree segment shared), with and without recompute."""
    from megatron_branch.bench.config import PRESETS
    from megatron_branch.plan import Layout, RolloutShape
    from megatron_branch.plan.flops import step_flops
    from megatron_branch.plan.measure import shape_rollouts

    arch = PRESETS["hybrid"]["model"]
    assert arch.is_hybrid and (arch.num_linear_layers, arch.num_full_layers) == (3, 1)
    shape = RolloutShape(prompt_length=150, responses=4, response_length=20, shared_response_length=5)
    tree = PrefixTree.build(shape_rollouts(shape, 64), vocab_size=arch.vocab_size)
    f = variant_flops(arch, tree)
    plan = {s: step_flops(arch, shape, s) for s in ("naive", "replay", "packed")}
    assert f["naive-fused"].linear + f["naive-fused"].linear_backward == plan["naive"].linear_attention > 0
    for v in ("replay", "packed"):
        assert f[v].linear + f[v].linear_backward == plan[v].linear_attention
        assert 3 * f[v].dense == plan[v].dense and 3 * f[v].attention == plan[v].attention
    assert f["replay"].linear < f["naive-fused"].linear  # the shared prefix's GDN runs once
    for variant, recompute in (("replay+recompute", "selective"), ("replay+recompute-full", "full")):
        again = step_flops(arch, shape, "replay", Layout(recompute=recompute))
        # what recompute adds is counted alike (the output projection's recomputed rows: 1 pass in both)
        assert f[variant].step - f["replay"].step == pytest.approx(
            again.total - plan["replay"].total, rel=1e-12
        )


@pytest.mark.slow
def test_the_hybrid_preset_runs_at_a_reduced_size(tmp_path, capsys) -> None:  # noqa: ANN001
    """`bench --preset hybrid` (Qwen3.5-style 3:1 layers) end to end at a reduced size: every variant the same
    loss, replay's FLOP ratio its analytic limit. No timing is quoted from this machine."""
    out = tmp_path / "h.json"
    argv = ["bench", "--preset", "hybrid", "--prompt", "96", "--branches", "4", "--response", "8", "--hidden", "64",
            "--vocab", "256", "--rounds", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"naive-fused", "packed-nosharing", "packed", "replay"}
    for r in rows.values():
        assert r["loss"] == pytest.approx(rows["naive-fused"]["loss"], rel=1e-5)
    assert rows["replay"]["flop_ratio"] == pytest.approx(rows["replay"]["analytic_limit"])
    assert rows["replay"]["analytic_limit"] > 1
    assert "analytic limit" in capsys.readouterr().out


def test_plot_of_a_one_point_grid_says_why_nothing_is_drawn(tmp_path, capsys) -> None:  # noqa: ANN001
    """Issue 35 item 7: `--plot` with one P and one G used to write no PNG and say nothing."""
    argv = [
        "bench",
        "--preset",
        "tiny",
        "--variants",
        "replay",
        "--no-meter",
        "--plot",
        str(tmp_path / "png"),
    ]
    assert main(argv) == 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("bench: --plot")]
    assert len(err) == 2 and err[0] == err[1], err  # before the run and after it
    assert (
        "it is one point (P=48, G=4) and a plot needs two values or more of --prompt or --branches" in err[0]
    )
    assert not (tmp_path / "png").exists()


def test_load_meter_sees_another_process_and_warnings_say_so() -> None:
    import subprocess
    import sys
    import time

    from megatron_branch.bench.load import LoadMeter, warnings

    meter = LoadMeter.start()
    busy = subprocess.Popen(
        [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"]
    )
    time.sleep(1.2)
    load = meter.read()  # the child is not waited for yet: its CPU time is someone else's
    busy.wait()
    assert load["foreign_cpu_s"] >= 0.5 and load["foreign_cpu_fraction"] > 0
    quiet = {**load, "busy": False, "foreign_cpu_fraction": 0.0}
    row = {"variant": "replay", "prompt": 48, "branches": 4, "fraction_of_limit": 8.22}
    assert warnings(quiet, [{**row, "fraction_of_limit": 0.9}]) == []
    (above,) = warnings(quiet, [row])  # above the limit: always a warning, busy or not
    assert "above the analytic limit (up to 822%, replay at P=48, G=4)" in above
    loaded = warnings({**load, "busy": True, "foreign_cpu_fraction": 0.4, "cpus": 2}, [row])
    assert loaded[0].startswith(
        "warning: the machine was busy during this run (other processes used 40% of its 2"
    )


@pytest.mark.parametrize(("budget", "picked"), [([], "packed"), (["--memory-budget", "1e-9"], "replay")])
def test_prompt_groups_and_the_auto_variant(tmp_path, budget: list[str], picked: str) -> None:  # noqa: ANN001
    """`--groups` prompts of lengths spread by `--min-prompt` (issue 33's small-prompts shape, reduced): every
    variant the same loss; `auto` runs packed where its planned peak fits (the free memory) and replay under a
    budget it does not fit, says so in the JSON and the table, and its time is that schedule's (no timing asserted)."""
    out = tmp_path / "g.json"
    argv = ["bench", "--preset", "tiny", "--prompt", "24", "--min-prompt", "8", "--groups", "3", "--levels", "2",
            "--response", "4", "--variants", "packed,replay,auto", "--rounds", "1", "--no-meter", "--json", str(out),
            "--markdown", str(tmp_path / "g.md"), *budget]  # fmt: skip
    assert main(argv) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    # 3 prompts (8, 16, 24 tokens) x (2 x 4 rollouts of 2 levels of 4 tokens)
    assert rows["naive-fused"]["positions_logical"] == sum(8 * (p + 8) for p in (8, 16, 24))
    for r in rows.values():
        assert r["loss"] == pytest.approx(rows["naive-fused"]["loss"], rel=1e-5)
    auto = rows["auto"]["auto"]
    assert auto["picked"] == picked and (auto["packed_bytes"] <= auto["budget_bytes"]) == (picked == "packed")
    assert rows["auto"]["flop_ratio"] == pytest.approx(rows[picked]["flop_ratio"])
    assert f"| auto ({picked}) |" in (tmp_path / "g.md").read_text()
    assert rows["packed"].get("auto") is None


def test_auto_weighs_replays_chunks() -> None:
    """The bench's `auto` (runner._auto, plan/auto.py's rule) with replay's default chunks (4096 tokens): packed on a
    tree of one chunk, replay on one over it although packed fits the budget (issue 33's small-prompts, agentic and
    P = 4096 shapes), with the tokens and the budget in its JSON."""
    from megatron_branch.bench import runner
    from megatron_branch.bench.config import PRESETS, BenchConfig, with_context

    cfg = BenchConfig(**{**PRESETS["tiny"], "memory_budget_gb": 100.0, "meter": False})
    arch = with_context(cfg.model, 4096 + 64)
    small, large = (runner.make_case(cfg, arch, prompt, 4).auto for prompt in (48, 4096))
    assert small.schedule == "packed" and small.tokens <= small.chunk_tokens == 4096
    assert large.schedule == "replay" and large.tokens > large.chunk_tokens == 4096
    assert f"the tree's {large.tokens} tokens span more than one chunk of 4096" in large.reason
    assert large.to_json()["tokens"] == large.tokens and large.packed_bytes <= large.budget_bytes
