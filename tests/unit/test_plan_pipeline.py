"""The planner's pipeline terms (plan/pipeline.py): which groups cross nodes, a stage's parameters, the bubble (with
root pieces: the dearest piece's), the stages' peaks (each stage's peak against the activation meter, with and
without root pieces: tests/distributed/test_plan_parallel.py), and the 70B-class recommendation on two 8-GPU
nodes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_branch.cli import main
from megatron_branch.plan import GPU_PRESETS, MODEL_PRESETS, Layout, RolloutShape, evaluate
from megatron_branch.plan.costs import MFU
from megatron_branch.plan.flops import (
    LOGITS_MATMULS,
    attention_flops_per_pair,
    layer_matmul_flops_per_token,
    logits_flops_per_row,
)
from megatron_branch.plan.memory import static_bytes, step_peak
from megatron_branch.plan.model import parameter_count
from megatron_branch.plan.pipeline import (
    crosses_nodes,
    piece_flops,
    root_flops,
    root_pieces_searched,
    stage_parameters,
    stage_parameters_per_rank,
)

ARCH = MODEL_PRESETS["qwen2.5-72b"]
TARGET = RolloutShape(prompt_length=130048, responses=16, response_length=1024)  # 16 x 128K = 2,097,152
H20, H100 = GPU_PRESETS["h20"], GPU_PRESETS["h100"]


def test_groups_cross_nodes_in_megatrons_rank_order() -> None:
    """tp fastest, then cp, dp, pp: on 2 x 8 GPUs TP8 stays in a node and the axis after it crosses."""
    assert not crosses_nodes("tp", Layout(tp=8, pp=2), 8) and crosses_nodes("pp", Layout(tp=8, pp=2), 8)
    assert crosses_nodes("cp", Layout(tp=8, cp=2), 8) and not crosses_nodes("pp", Layout(tp=8, cp=2), 8)
    assert not crosses_nodes("pp", Layout(tp=4, pp=2), 8)  # 8 ranks: one node


def test_a_stage_holds_its_layers_and_one_vocabulary_matrix() -> None:
    """Two stages at TP1 hold every parameter once, except the final norm each end stage is charged for."""
    total = parameter_count(ARCH)["total"]
    assert 2 * stage_parameters_per_rank(ARCH, Layout(pp=2)) == total + ARCH.hidden_size
    assert (
        stage_parameters_per_rank(ARCH, Layout(tp=8, pp=2))
        < stage_parameters_per_rank(ARCH, Layout(tp=8)) / 1.8
    )


def test_the_stages_split_the_model_and_its_optimizer_state() -> None:
    """An untied model's stages hold, together, exactly the one-stage rank's parameters (the vocabulary padded to a
    multiple of TP included; 151665 rows pad at TP8); the distributed optimizer shards a STAGE's state over DP x CP
    (each bytes term exact against the built stage: tests/distributed/test_plan_parallel.py). Planted: at DP1 the
    distributed and the plain optimizer hold the same state (the whole model's was charged before)."""
    arch = dataclasses.replace(ARCH, vocab_size=151665)
    assert not arch.tie_word_embeddings and arch.padded_vocab_size(8) != arch.vocab_size
    for tp in (1, 8):
        for pp in (2, 4):
            stages = [stage_parameters(arch, Layout(tp=tp, pp=pp), s) for s in range(pp)]
            assert sum(stages) == static_bytes(arch, Layout(tp=tp))["parameters_per_rank"]
            assert stage_parameters_per_rank(arch, Layout(tp=tp, pp=pp)) == stages[-1] > stages[0]
            if pp > 2:  # the middle stages: layers only
                assert stages[0] > stages[1]
    for dp in (1, 4):
        st = static_bytes(arch, Layout(tp=8, pp=2, dp=dp))
        assert st["optimizer_state_distributed"] * dp == st["optimizer_state_no_distributed"]
        assert st["optimizer_state_no_distributed"] == 12 * st["parameters_per_rank"]


def test_a_gdn_hybrids_stages_are_priced_by_layer_kind(capsys: pytest.CaptureFixture[str]) -> None:
    """qwen3.6-27b (48 GDN + 16 attention layers, untied) at PP2 / PP4: the stages' parameters, each layer by its
    kind, add up to the one-stage rank's at TP1 and TP4; `plan --pp 2` prints a plan (the refusal lifted; each
    stage's bytes against the meter: tests/distributed/test_plan_parallel.py)."""
    arch = MODEL_PRESETS["qwen3.6-27b"]
    assert arch.is_hybrid and not arch.is_moe and not arch.tie_word_embeddings
    for tp in (1, 4):
        for pp in (2, 4):
            stages = [stage_parameters(arch, Layout(tp=tp, pp=pp), s) for s in range(pp)]
            assert sum(stages) == static_bytes(arch, Layout(tp=tp))["parameters_per_rank"]
    shape = "--prompt-length 32768 --responses 16 --response-length 2048 --gpus 8 --gpu h100"
    assert main(["plan", "--model", "qwen3.6-27b", "--pp", "2", *shape.split(), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["layout"]["pp"] == 2 and out["fits"], out


def test_the_first_stage_holds_the_micro_batches_1f1b_keeps_alive() -> None:
    """Stage 0 keeps min(pp, M) leaf micro-batches in flight, the last stage one (and the output layer): with 16
    leaves in 4 micro-batches of 4 at PP4, stage 0 holds as much as one micro-batch of all 16, stage 3 a quarter."""
    shape = RolloutShape(prompt_length=4096, responses=16, response_length=512)
    kw = {"act_bytes": 2, "segment_recompute": False, "layer_recompute": False}
    lay = Layout(tp=8, pp=4)
    peak = {
        (s, b): step_peak(ARCH, shape, lay, stage=s, branch_micro_batch=b, **kw)
        for s in (0, 3)
        for b in (4, 16)
    }
    assert peak[0, 4].logits == 0 < peak[3, 4].logits  # the output layer's buffers: last stage only
    assert peak[0, 4].activations == pytest.approx(peak[0, 16].activations, rel=0.02)
    # the last stage holds one of the four micro-batches (the leaves are two thirds of this chunk's rows)
    assert peak[3, 16].activations - peak[3, 4].activations > 0.3 * peak[3, 16].activations
    assert step_peak(ARCH, shape, lay, branch_micro_batch=4, **kw) in (peak[0, 4], peak[3, 4])  # the heavier


def test_the_bubble_is_the_root_crossing_the_stages_and_the_waves_fill() -> None:
    lay = Layout(tp=8, pp=2, recompute="full")
    plans = {b: evaluate("72b", ARCH, TARGET, H100, 16, lay, branch_micro_batch=b) for b in (1, 8)}
    t = plans[1].step_time
    assert t["pipeline_bubble"] > 0.4 * t["compute"]  # a 130K root: half of its time a stage waits
    assert plans[8].step_time["pipeline_bubble"] > t["pipeline_bubble"]  # fewer micro-batches: less overlap
    no_pp = evaluate("72b", ARCH, TARGET, H100, 16, Layout(tp=8, cp=2, recompute="full"))
    assert no_pp.step_time["pipeline_bubble"] == 0 and no_pp.step_time["pipeline_messages"] == 0


def _flow_shop(times: list[float], stages: int) -> float:
    """When the last stage finishes: jobs in order through `stages` stages, each job the same time on every stage,
    a stage one job at a time and a job on stage r after stage r - 1 (the pieces' forwards; backwards alike)."""
    end = [0.0] * stages
    for t in times:
        for r in range(stages):
            end[r] = max(end[r], end[r - 1] if r else 0.0) + t
    return end[-1]


def test_the_pieces_flow_like_micro_batches() -> None:
    """The bubble formula the planner uses for pieces: a proportionate flow shop ends at sum + (pp - 1) max."""
    times = [3.0, 1.0, 4.0, 1.5, 5.0, 2.0]
    for pp in (2, 4):
        assert _flow_shop(times, pp) == pytest.approx(sum(times) + (pp - 1) * max(times), rel=1e-12)
    assert _flow_shop([6.0], 2) == 12.0  # a whole root: pp times its own time


def test_root_pieces_add_up_to_the_root_and_the_last_is_dearest() -> None:
    lay = Layout(tp=8, pp=2, recompute="full")
    whole = root_flops(ARCH, TARGET, lay)
    for k in (1, 3, 16):
        parts = piece_flops(ARCH, TARGET, lay, k)
        assert len(parts) == k and sum(parts) == pytest.approx(whole, rel=1e-12)
        assert max(parts) == parts[-1]  # later pieces attend to more keys; the loss rows are the last one's
    # by hand: a 12-token root in 3 pieces of 4 attends to 10, 4 x 4 + 10 and 8 x 4 + 10 pairs; 2 fork rows
    shape = RolloutShape(prompt_length=12, responses=2, response_length=3)
    tok, pair, row = (
        layer_matmul_flops_per_token(ARCH),
        attention_flops_per_pair(ARCH),
        logits_flops_per_row(ARCH),
    )
    want = [3 * tok * 4 + 3 * pair * n for n in (10, 26, 42)]
    want[-1] += row * LOGITS_MATMULS * 2
    assert piece_flops(ARCH, shape, Layout(pp=2), 3) == pytest.approx(want, rel=1e-12)


def test_root_pieces_shrink_the_roots_bubble() -> None:
    """The root's part of the bubble is its dearest piece's time (pp - 1 times), the leaves' part unchanged: the
    step is faster by exactly the difference, and 8 pieces leave between 1/8 and 2/8 of the root's bubble."""
    lay = Layout(tp=8, pp=2, recompute="full")
    rate, ranks = H100.tflops * 1e12 * MFU, 16
    t = {k: evaluate("72b", ARCH, TARGET, H100, 16, lay, branch_micro_batch=1, root_pieces=k) for k in (1, 8)}
    whole, dearest = root_flops(ARCH, TARGET, lay), max(piece_flops(ARCH, TARGET, lay, 8))
    saved = (whole - dearest) / ranks / rate  # pp - 1 = 1
    b1, b8 = t[1].step_time["pipeline_bubble"], t[8].step_time["pipeline_bubble"]
    assert b8 == pytest.approx(b1 - saved, rel=1e-9) and b8 < b1
    assert t[8].step_time["total"] == pytest.approx(t[1].step_time["total"] - saved, rel=1e-9)
    assert whole / 8 < dearest < 2 * whole / 8
    assert t[8].to_json()["root_pieces"] == 8


def test_root_pieces_shrink_the_root_phase_under_segment_recompute() -> None:
    """With segment recompute the root's backward rebuilds one piece at a time; without it every piece's graph
    stays alive as the whole root's would (the same bytes)."""
    kw = {"act_bytes": 2, "branch_micro_batch": 1, "stage": 0}
    rc = Layout(tp=8, pp=2, recompute="selective")
    assert step_peak(ARCH, TARGET, rc, root_pieces=8, **kw).saved < step_peak(ARCH, TARGET, rc, **kw).saved
    keep = Layout(tp=8, pp=2, recompute="none")
    assert step_peak(ARCH, TARGET, keep, root_pieces=8, **kw) == step_peak(ARCH, TARGET, keep, **kw)


def test_the_search_tries_root_pieces_under_pp_for_replay() -> None:
    assert root_pieces_searched(TARGET, Layout(tp=8, pp=2), "replay") == (1, 2, 4, 8, 16)
    assert root_pieces_searched(TARGET, Layout(tp=8, cp=2), "replay") == (1,)  # no pipeline
    assert root_pieces_searched(TARGET, Layout(tp=8, pp=2), "packed") == (1,)  # no root chunk
    short = RolloutShape(prompt_length=8192, responses=16, response_length=1024)
    assert root_pieces_searched(short, Layout(tp=8, pp=2), "replay") == (1, 2)  # pieces of >= 4096 tokens


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["plan", "--model", "qwen2.5-72b", "--prompt-length", "130048", "--responses", "16",
                 "--response-length", "1024", "--gpus", "16", *argv, "--json"]) == 0  # fmt: skip
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_the_70b_class_target_on_two_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen2.5-72B at 2.1M logical positions on 2 x 8 GPUs (docs/planner.md): on H100 (80 GB) only a pipelined
    layout fits (TP8 x PP2, full recompute, part of the optimizer state on the host); on H20 (96 GB) TP8 x CP2
    fits without PP and is faster than any PP layout, whose bubble the root's 130K positions make large."""
    h100 = _plan(capsys, "--gpu", "h100")
    assert h100["fits"] and h100["layout"] == {"tp": 8, "cp": 1, "dp": 1, "pp": 2, "recompute": "full"}
    assert not any(r["layout"]["pp"] == 1 and r["layout"]["recompute"] == "full" and r["layout"]["tp"] == 8
                   and r["memory_bytes_per_rank"] <= 80e9 for r in h100["rejected"])  # fmt: skip
    h20 = _plan(capsys, "--gpu", "h20")
    assert h20["fits"] and h20["layout"] == {"tp": 8, "cp": 2, "dp": 1, "pp": 1, "recompute": "full"}
    pp2 = _plan(
        capsys, "--gpu", "h20", "--tp", "8", "--cp", "1", "--pp", "2", "--dp", "1", "--recompute", "full"
    )
    assert pp2["fits"] and pp2["step_time_s"] > h20["step_time_s"]
    assert pp2["step_time"]["pipeline_bubble"] > 0 and h20["step_time"]["pipeline_bubble"] == 0
    # with the roots cut into pieces (searched: --root-pieces auto) the pipeline's bubble shrinks enough that a
    # pipelined layout (segment recompute only: one piece rebuilt at a time) is faster than TP8 x CP2
    auto = _plan(capsys, "--gpu", "h20", "--root-pieces", "auto")
    assert auto["fits"] and auto["layout"]["pp"] == 2 and auto["root_pieces"] == 16
    assert (
        auto["step_time_s"] < h20["step_time_s"]
        and auto["step_time"]["pipeline_bubble"] < 0.25 * (pp2["step_time"]["pipeline_bubble"])
    )
    assert h20["root_pieces"] == 1  # not searched by default (train's sampler cannot run PP at this size)


def test_pipeline_refusals_in_the_planner(capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_branch.errors import UserError

    with pytest.raises(UserError, match="does not divide the model's 80 layers"):
        evaluate("72b", ARCH, TARGET, H20, 24, Layout(tp=8, pp=3, recompute="full"))
    with pytest.raises(UserError, match="has no pipeline parallelism"):
        evaluate("72b", ARCH, TARGET, H20, 16, Layout(tp=8, pp=2), schedule="naive")
    slow_link = dataclasses.replace(H100, node_link_gbps=1)
    lay = Layout(tp=8, pp=2, recompute="full")
    assert (evaluate("72b", ARCH, TARGET, slow_link, 16, lay).step_time["pipeline_messages"]
            > 10 * evaluate("72b", ARCH, TARGET, H100, 16, lay).step_time["pipeline_messages"])  # fmt: skip


def test_what_the_pipeline_does_not_run_is_refused_in_one_line() -> None:
    """rules.check_pipeline: MoE with EP groups across replicas (EP inside a replica runs), Mamba-2 hybrids (GDN
    hybrids run; the planner prices a dense hybrid's stages, not a MoE hybrid's), interleaved stages
    (the same rule every entry point calls; grad and train show the schedule and layer rules:
    tests/unit/test_rules.py)."""
    from megatron_branch.errors import SettingError
    from megatron_branch.rules import check_pipeline

    for kw, says in (
        ({"moe": True, "ep": 2, "ep_spans_dp": True}, "--pp 2 with --ep 2 across data-parallel replicas"),
        (
            {"moe": True, "ep": 2},
            "--pp 2 with --ep 2: expert parallelism under pipeline parallelism is not shown",
        ),
        ({"mamba": True}, "--pp 2: pipeline parallelism cannot run a Mamba-2 hybrid model yet"),
        (
            {"hybrid": True, "moe": True, "planner": True},
            "--pp 2: the planner does not price a mixture-of-experts hybrid (gated delta net)",
        ),
        ({"virtual": 2}, "--vp 2: interleaved (virtual) pipeline stages are not supported"),
    ):
        with pytest.raises(SettingError) as e:
            check_pipeline("replay", pp=2, num_layers=4, **kw)
        assert str(e.value).startswith(says) and "\n" not in str(e.value), str(e.value)
    check_pipeline("naive", pp=1, num_layers=3)  # nothing to refuse without PP
    check_pipeline("replay", pp=2, num_layers=4, moe=True)  # EP1: tests/distributed/test_pipeline_moe.py
    check_pipeline("replay", pp=2, num_layers=4, moe=True, ep=2, ep_spans_dp=False)  # EP inside a replica
    check_pipeline("replay", pp=2, num_layers=4, hybrid=True)  # GDN: the engine runs it (same file)
    check_pipeline("replay", pp=2, num_layers=4, hybrid=True, planner=True)  # a dense hybrid's stages priced


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--pp", "1", "--root-pieces", "4"], "--root-pieces 4 needs pipeline parallelism (--pp > 1)"),
        (["--schedule", "packed", "--root-pieces", "4"], "--root-pieces 4 applies to --schedule replay only"),
        (["--root-pieces", "0"], "--root-pieces must be a positive number of pieces, got 0"),
    ],
)
def test_root_pieces_refused_by_the_planner_in_one_line(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["plan", "--model", "qwen2.5-72b", "--prompt-length", "130048", "--responses", "16",
               "--response-length", "1024", "--gpus", "16", "--gpu", "h20", *flags])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert rc == 2 and says in err and "\n" not in err, err
