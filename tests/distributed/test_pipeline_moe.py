"""Mixture-of-experts and gated-delta-net hybrid policies under pipeline parallelism (schedule/pipeline.py; the grad
command, in-process on both ranks, replay walking every segment as its own chunk): a tiny Qwen3-MoE (2 layers, one
MoE layer on each stage, 4 experts, top-2) at PP2, EP1 (and at PP2 x CP2 x EP2, world 4); a 4-layer DeepSeek-V3; `train`; tiny Qwen3.5 / Qwen3-Next.

    python tests/distributed/launch.py 2 -k pipeline_moe
    python tests/distributed/launch.py 4 -k pipeline_moe_expert_parallel   # PP2 x CP2 x EP2: grad, train

- Router losses off: replay (float64) and packed (float32) against the float64 HF oracle, per parameter (1e-9,
  1e-5), on test_moe_parallel.py's tree (two prompt groups, a shared response beginning with three branches under
  it: siblings route the tokens after the fork to different experts).
- Router losses on (aux + seq-aux + z), float64: PP2 replay and packed == TP2+SP replay (one replica each: one loss
  scope) at 1e-9, and the summary's router metrics (each stage's layers, gathered over the pipeline group as
  megatron's tracker reduces them) equal TP2+SP's. Planted: the balancing losses' gradient dropped on stage 0,
  and the metrics left per stage, each fails.
- Routing replay (recorded experts per token and MoE layer, each stage reading its own layers' records): PP2
  replay == TP2+SP replay at 1e-9, and the records matter (replay without them differs); planted: the records'
  layers swapped between the stages fails.
- DeepSeek-V3 (dense first layer on stage 0) == HF; `train` PP2 == TP2+SP (R3, router losses).
- GDN hybrids (GDN, attention, GDN, attention): PP2 == HF at 1e-5; planted: the fork states' gradient withheld;
  `train` of a config-defined Qwen3.5-style hybrid at PP2 == CP2 (1e-5).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_helpers import shared_tmp
from safetensors.torch import load_file
from test_moe_parallel import ROUTER_LOSSES, TOL, _rollouts, _worst

from megatron_branch.cli import main
from megatron_branch.data import Rollout, write_rollouts_jsonl
from megatron_branch.losses import router_plan

TP2SP = ["--tp", "2", "--sequence-parallel"]
PP2 = ["--pp", "2"]


def _records(rollouts: list[Rollout]) -> list[Rollout]:
    """Each rollout with recorded experts [T, 2 layers, top-2]: a function of the token, its position and the layer
    (so shared prefixes carry equal records), unlike what the model would route."""
    out = []
    for r in rollouts:
        seq = list(r.prompt) + list(r.response)
        rec = [[sorted([(t + p + 3 * layer) % 4, (t + p + 3 * layer + 1 + t % 3) % 4]) for layer in range(2)]
               for p, t in enumerate(seq)]  # fmt: skip
        out.append(Rollout(prompt=r.prompt, response=r.response, advantage=r.advantage,
                           routed_experts=torch.tensor(rec)))  # fmt: skip
    return out


def _oracle(prefix: str, cfg: object, rollouts: list[Rollout], **files: list[Rollout]) -> tuple[Path, dict]:
    """(a shared folder with hf/ (`cfg`'s tiny model), r.jsonl and `files`, the float64 HF oracle's gradient over
    `rollouts` with exact norms and routers) on every rank."""
    from transformers import AutoModelForCausalLM

    from megatron_branch.testing import (
        exact_hf_norms,
        exact_hf_routers,
        hf_experts_kwargs,
        hf_policy_gradient,
        tiny_hf_model,
    )

    d = shared_tmp(prefix)
    if dist.get_rank() == 0:
        tiny_hf_model(cfg, seed=4).save_pretrained(d / "hf")
        for name, rows in {"r": rollouts, **files}.items():
            write_rollouts_jsonl(d / f"{name}.jsonl", rows)
    dist.barrier()
    hf = AutoModelForCausalLM.from_pretrained(
        d / "hf", dtype=torch.float64, attn_implementation="sdpa", **hf_experts_kwargs(cfg)
    )
    _, grads = hf_policy_gradient(exact_hf_routers(exact_hf_norms(hf)), rollouts)
    return d, grads


@pytest.fixture(scope="module")
def pp_setup() -> Iterator[tuple[Path, dict[str, torch.Tensor]]]:
    """(folder with hf/, r.jsonl and routed.jsonl, the float64 HF oracle's gradient) on every rank."""
    from megatron_branch.testing import tiny_hf_config

    cfg = tiny_hf_config("qwen3_moe", heads=4, kv_heads=2)
    assert cfg.num_hidden_layers == 2 and cfg.decoder_sparse_step == 1  # one MoE layer per stage
    rollouts = _rollouts()
    d, grads = _oracle("pipeline_moe_", cfg, rollouts, routed=_records(rollouts))
    yield d, grads
    _remove(d)


def _remove(d: Path) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(d, ignore_errors=True)


def _grad(
    d: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    schedule: str,
    *flags: str,
    rollouts: str = "r.jsonl",
) -> tuple[dict[str, torch.Tensor], dict]:
    """(the gradient by HF name, the summary's metrics: rank 0's, on every rank) of one `grad` run."""
    out = d / f"{name}.safetensors"
    argv = ["grad", "--hf", str(d / "hf"), "--rollouts", str(d / rollouts), "--out", str(out), "--overwrite"]
    capsys.readouterr()
    # --chunk-tokens 0: replay walks every segment as its own chunk (the tiny tree would fit one chunk of the
    # default budget), so the stages hand prefix state (K/V, GDN fork states) down the walk
    rc = main([*argv, "--schedule", schedule, "--branch-micro-batch", "2", "--chunk-tokens", "0", *flags])
    captured = capsys.readouterr()
    assert rc == 0, (name, captured.err[-2000:])
    dist.barrier()
    lines = [ln for ln in captured.out.splitlines() if ln.startswith("{")]
    box = [json.loads(lines[-1])["metrics"] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)  # every rank asserts the same (no rank left waiting)
    return load_file(out), box[0]


@pytest.mark.world(2)
def test_pipeline_moe_grad_matches_hf(pp_setup, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    d, ref = pp_setup
    for schedule, dtype, extra in (
        ("replay", "float64", []),
        ("packed", "float32", []),
        ("replay", "float64", ["--root-pieces", "3"]),
    ):
        grads, _ = _grad(d, capsys, f"pp2_{schedule}_{dtype}", schedule, "--dtype", dtype, *PP2, *extra)
        err = _worst(grads, ref)
        assert err[0] <= TOL[dtype], (schedule, dtype, extra, err)
    assert any(".mlp.experts." in n for n in ref) and any(".mlp.gate." in n for n in ref)


def _router_metrics(metrics: dict) -> dict[str, object]:
    return {
        k: v
        for k, v in metrics.items()
        if k.startswith("moe/") or k.endswith(("load_balancing_loss", "z_loss"))
    }


@pytest.mark.world(2)
def test_pipeline_moe_router_losses(
    pp_setup,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
) -> None:
    """Router losses on: PP2 == TP2+SP (gradient and metrics); planted bugs on the stages fail."""
    d, _ = pp_setup
    want, want_m = _grad(d, capsys, "aux_tp2sp", "replay", "--dtype", "float64", *ROUTER_LOSSES, *TP2SP)
    for schedule in ("replay", "packed"):
        grads, metrics = _grad(
            d, capsys, f"aux_pp2_{schedule}", schedule, "--dtype", "float64", *ROUTER_LOSSES, *PP2
        )
        assert _worst(grads, want)[0] <= 1e-9, schedule
        got, exp = _router_metrics(metrics), _router_metrics(want_m)
        assert set(got) == set(exp) and "moe/load_balancing_loss_layer_1" in got, sorted(got)
        assert "moe/tokens_per_expert/logical/layer_0" in got
        for k, v in exp.items():
            assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12), (schedule, k)
        assert got["load_balancing_loss"] > 0 and got["z_loss"] > 0

    # planted: stage 0's balancing losses attached with no gradient (the metric still recorded)
    real = router_plan.RouterPlan.balancing_loss

    def dropped(self, layer, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        loss = real(self, layer, *a, **kw)
        return loss.detach() if layer == 0 else loss

    monkeypatch.setattr(router_plan.RouterPlan, "balancing_loss", dropped)
    grads, _ = _grad(d, capsys, "aux_pp2_bug_grad", "replay", "--dtype", "float64", *ROUTER_LOSSES, *PP2)
    assert _worst(grads, want)[0] > 1e-6
    monkeypatch.setattr(router_plan.RouterPlan, "balancing_loss", real)

    # planted: the metrics left per stage (not gathered over the pipeline group)
    monkeypatch.setattr(router_plan.RouterPlan, "_over_stages", lambda self, table, keys, shape: table)
    grads, metrics = _grad(
        d, capsys, "aux_pp2_bug_metric", "replay", "--dtype", "float64", *ROUTER_LOSSES, *PP2
    )
    assert _worst(grads, want)[0] <= 1e-9  # the gradient does not depend on the metrics
    assert metrics["load_balancing_loss"] != pytest.approx(want_m["load_balancing_loss"], rel=1e-6)


@pytest.mark.world(2)
def test_pipeline_moe_routing_replay(
    pp_setup,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
) -> None:
    """Routing replay: each stage forces its own layers' recorded experts; PP2 == TP2+SP; a stage reading the
    other stage's records fails."""
    d, _ = pp_setup
    flags = ["--dtype", "float64", "--routing-replay", *ROUTER_LOSSES]
    want, _ = _grad(d, capsys, "rr_tp2sp", "replay", *flags, *TP2SP, rollouts="routed.jsonl")
    fresh, _ = _grad(d, capsys, "rr_fresh_pp2", "replay", "--dtype", "float64", *ROUTER_LOSSES, *PP2)
    assert _worst(fresh, want)[0] > 1e-6  # the records change the routing
    for schedule in ("replay", "packed"):
        grads, _ = _grad(d, capsys, f"rr_pp2_{schedule}", schedule, *flags, *PP2, rollouts="routed.jsonl")
        assert _worst(grads, want)[0] <= 1e-9, schedule
    real = router_plan._tree_routes
    monkeypatch.setattr(router_plan, "_tree_routes", lambda *a: real(*a).flip(1))  # layer 0 <-> layer 1
    grads, _ = _grad(d, capsys, "rr_pp2_bug", "replay", *flags, *PP2, rollouts="routed.jsonl")
    assert _worst(grads, want)[0] > 1e-6


@pytest.mark.world(2)
def test_pipeline_deepseek_v3_dense_first_layer_grad_matches_hf(capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny DeepSeek-V3 (multi-latent attention, sigmoid router with correction biases that change the choice,
    a shared expert, `first_k_dense_replace` 1) of 4 layers at PP2: stage 0 a dense layer and a MoE layer, stage 1
    two MoE layers; replay (float64, the sigmoid router's float32 bound 1e-6) and packed (float32, 1e-5) against
    HF, per parameter (test_glm4_moe_parallel.py's harness and tree)."""
    from test_glm4_moe_parallel import TOL as SIGMOID_TOL
    from test_glm4_moe_parallel import _worst as worst_with_biases
    from test_glm4_moe_parallel import sigmoid_router_setup

    from megatron_branch.testing import tiny_hf_config

    d, ref = sigmoid_router_setup("deepseek_v3", tiny_hf_config("deepseek_v3", num_layers=4))
    assert any("layers.0.mlp.gate_proj" in n for n in ref) and any("layers.1.mlp.experts." in n for n in ref)
    for schedule, dtype in (("replay", "float64"), ("packed", "float32")):
        grads, _ = _grad(d, capsys, f"ds_pp2_{schedule}_{dtype}", schedule, "--dtype", dtype, *PP2)
        err = worst_with_biases(grads, ref)  # the frozen correction biases: zero gradients
        assert err[0] <= SIGMOID_TOL[dtype], (schedule, dtype, err)
    _remove(d)


@pytest.mark.world(2)
def test_pipeline_moe_train_equals_tp2() -> None:
    """`train` of a tiny Qwen3-MoE with routing replay (R3: the sampler's whole-model copy records, each stage
    replays its own layers) and router losses, two steps, float64: parallel.pp=2 == parallel.tp=2 + SP (one replica
    each: the same sampled tokens, the same loss scope), every parameter at 1e-9."""
    from test_moe_parallel import _train, _train_cfg

    from megatron_branch.checkpoint.param_map import mcore_to_hf_state
    from megatron_branch.checkpoint.stages import gather_model_state
    from megatron_branch.testing import tiny_hf_config, tiny_hf_model
    from megatron_branch.train.loop import Trainer
    from megatron_branch.train.models import unwrap

    d = shared_tmp("pipeline_moe_train_")
    vocab = Trainer(_train_cfg(None, d / "probe", "trainer.total_training_steps=1")).arch.vocab_size
    if dist.get_rank() == 0:
        cfg = tiny_hf_config(
            "qwen3_moe", vocab_size=vocab, hidden_size=16, num_layers=2, heads=2, kv_heads=2, ffn=32
        )
        tiny_hf_model(cfg, seed=5).save_pretrained(d / "hf")
    dist.barrier()
    steps = "trainer.total_training_steps=2"
    tp, tp_tokens = _train(
        _train_cfg(d / "hf", d / "tp2", steps, "parallel.tp=2", "parallel.sequence_parallel=true")
    )
    # HF names (the vocabulary's TP padding dropped), before the next run lays out other groups
    a = mcore_to_hf_state(gather_model_state(unwrap(tp.policy), tp.groups), tp.arch)
    pp, pp_tokens = _train(_train_cfg(d / "hf", d / "pp2", steps, "parallel.pp=2"))
    assert (pp.groups.pp_size, pp.groups.dp_size) == (2, 1)
    b = mcore_to_hf_state(gather_model_state(unwrap(pp.policy), pp.groups), pp.arch)
    assert tp_tokens == pp_tokens and a.keys() == b.keys()
    start = load_file(d / "hf" / "model.safetensors")
    moved = [n for n in a if ".mlp.experts." in n and not torch.equal(a[n], start[n].to(a[n].dtype))]
    assert len(moved) > 4, moved  # the steps trained the experts
    for n in a:
        assert float((a[n] - b[n]).norm() / a[n].norm().clamp(min=1e-30)) <= 1e-9, n
    _remove(d)


@pytest.mark.world(2)
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_pipeline_gdn_hybrid_grad_matches_hf(
    family: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny gated-delta-net hybrid (GDN, attention, GDN, attention: one of each per stage; Qwen3-Next with a MoE
    block after each) at PP2 on test_gdn_cp.py's tree (forks at depths 1-3, a 70-token prompt forking mid-chunk):
    each stage's prefix cache holds its GDN layers' fork states; replay and packed against HF at the delta rule's
    float32 bound 1e-5. Planted (Qwen3.5): the GDN fork states' summed gradient not injected into a stage's
    backward of the shared segment fails."""
    from gdn_helpers import rollouts as gdn_rollouts

    from megatron_branch.models.gdn_tree import GDN_STATE
    from megatron_branch.schedule.prefix_cache import PrefixCache
    from megatron_branch.testing import tiny_hf_config

    layers = ("linear_attention", "full_attention", "linear_attention", "full_attention")
    cfg = tiny_hf_config(family, num_layers=4, ffn=48, layer_types=layers)
    d, ref = _oracle("pipeline_hybrid_", cfg, gdn_rollouts())
    assert any(".linear_attn." in n for n in ref)
    for schedule in ("replay", "packed"):
        grads, _ = _grad(d, capsys, f"hybrid_{schedule}", schedule, *PP2)
        err = _worst(grads, ref)
        assert err[0] <= 1e-5, (family, schedule, err)
    if family == "qwen3_5":
        injection = PrefixCache.injection

        def without_gdn(self, seg_id, captured):  # noqa: ANN001, ANN202
            return injection(self, seg_id, {k: h for k, h in captured.items() if h.kind is not GDN_STATE})

        monkeypatch.setattr(PrefixCache, "injection", without_gdn)
        grads, _ = _grad(d, capsys, "hybrid_bug", "replay", *PP2)
        err = _worst(grads, ref)
        assert err[0] > 100 * 1e-5, err
    _remove(d)


@pytest.mark.world(2)
def test_pipeline_gdn_hybrid_train_equals_cp2() -> None:
    """`train` of test_train_loop.py's config-defined Qwen3.5-style hybrid (a GDN layer on stage 0, attention on
    stage 1), a supervised warm-up and one replay step, float64: parallel.pp=2 == parallel.cp=2 (one replica each,
    the same random init and sampling stream): the same sampled tokens and rewards, the same gradient norm, every
    parameter within the delta rule's float32 bound (1e-5 relative; the GDN layers compute in float32 whatever the
    model dtype)."""
    from test_train_loop import HYBRID, _cfg
    from train_helpers import run_steps

    from megatron_branch.checkpoint.stages import gather_model_state
    from megatron_branch.train.models import unwrap

    d = shared_tmp("pipeline_hybrid_train_")
    # a short supervised warm-up (through the pipelined update too) so that the sampled answers earn rewards
    common = [HYBRID, "model.dtype=float64", "schedule.name=replay", "trainer.total_training_steps=1",
              "warmup.steps=8", "warmup.batch_size=4", "warmup.lr=0.1", "rollout.n=4"]  # fmt: skip
    cp, cp_rows = run_steps(_cfg(d / "cp2", *common, "parallel.cp=2"))
    a = gather_model_state(unwrap(cp.policy), cp.groups)  # before the next run lays out other groups
    pp, pp_rows = run_steps(_cfg(d / "pp2", *common, "parallel.pp=2"))
    assert (pp.groups.pp_size, pp.groups.dp_size) == (2, 1) and unwrap(pp.policy).arch.is_hybrid
    b = gather_model_state(unwrap(pp.policy), pp.groups)
    assert [(m["_tokens"], m["_rewards"]) for m in cp_rows] == [
        (m["_tokens"], m["_rewards"]) for m in pp_rows
    ]
    g_cp, g_pp = cp_rows[0]["actor/grad_norm"], pp_rows[0]["actor/grad_norm"]
    assert g_pp > 0 and abs(g_pp - g_cp) <= 1e-6 * g_cp, (g_cp, g_pp)  # the step moved the policy, alike
    assert a.keys() == b.keys() and any(".self_attention.in_proj." in n for n in a)
    err = max(float((a[k] - b[k]).norm() / a[k].norm().clamp(min=1e-30)) for k in a)
    assert err <= 1e-5, err  # the delta rule's float32 bound, per parameter (relative)
    _remove(d)


PP2EP2 = ["--pp", "2", "--cp", "2", "--ep", "2"]  # EP over each stage's CP ranks (one replica)


@pytest.mark.world(4)
def test_pipeline_moe_expert_parallel_world4(
    pp_setup,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
) -> None:
    """PP2 x CP2 x EP2 (one replica; each stage's two experts per rank, its EP group the stage's two CP ranks):
    replay (float64) and packed (float32) == the float64 HF oracle per parameter (1e-9, 1e-5); router losses on
    (float64): == PP2 x CP2 at EP1 (the same replica, the same loss scope) at 1e-9, its router metrics too.
    Planted: every EP rank of a stage loading the first experts (its EP rank's offset ignored) fails: the experts
    really are split."""
    from megatron_branch.checkpoint import stages

    d, ref = pp_setup
    for schedule, dtype in (("replay", "float64"), ("packed", "float32")):
        grads, _ = _grad(d, capsys, f"pp2ep2_{schedule}_{dtype}", schedule, "--dtype", dtype, *PP2EP2)
        err = _worst(grads, ref)
        assert err[0] <= TOL[dtype], (schedule, dtype, err)
    aux = ["replay", "--dtype", "float64", *ROUTER_LOSSES, "--pp", "2", "--cp", "2"]
    want, want_m = _grad(d, capsys, "aux_pp2cp2", *aux)
    grads, metrics = _grad(d, capsys, "aux_pp2cp2ep2", *aux, "--ep", "2")
    assert _worst(grads, want)[0] <= 1e-9
    got, exp = _router_metrics(metrics), _router_metrics(want_m)
    assert set(got) == set(exp) and "moe/load_balancing_loss_layer_1" in got, sorted(got)
    for k, v in exp.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    real = stages._expert_targets
    monkeypatch.setattr(stages, "_expert_targets", lambda model, ep_rank: real(model, 0))
    grads, _ = _grad(d, capsys, "pp2ep2_bug", "replay", "--dtype", "float64", *PP2EP2)
    assert _worst(grads, ref)[0] > 1e-6


@pytest.mark.world(4)
def test_pipeline_moe_expert_parallel_train_world4() -> None:
    """`train` of a tiny Qwen3-MoE (R3, router losses), two steps, float64: PP2 x CP2 x EP2 == PP2 x CP2 at EP1
    (one replica each: the same sampled tokens, the same loss scope), every parameter at 1e-9."""
    from test_moe_parallel import _train, _train_cfg

    from megatron_branch.checkpoint.param_map import mcore_to_hf_state
    from megatron_branch.checkpoint.stages import gather_model_state
    from megatron_branch.testing import tiny_hf_config, tiny_hf_model
    from megatron_branch.train.loop import Trainer
    from megatron_branch.train.models import unwrap

    d = shared_tmp("pipeline_moe_ep_train_")
    vocab = Trainer(_train_cfg(None, d / "probe", "trainer.total_training_steps=1")).arch.vocab_size
    if dist.get_rank() == 0:
        cfg = tiny_hf_config(
            "qwen3_moe", vocab_size=vocab, hidden_size=16, num_layers=2, heads=2, kv_heads=2, ffn=32
        )
        tiny_hf_model(cfg, seed=5).save_pretrained(d / "hf")
    dist.barrier()
    common = ["trainer.total_training_steps=2", "parallel.pp=2", "parallel.cp=2"]
    ep1, ep1_tokens = _train(_train_cfg(d / "hf", d / "ep1", *common))
    a = mcore_to_hf_state(gather_model_state(unwrap(ep1.policy), ep1.groups), ep1.arch)
    ep2, ep2_tokens = _train(_train_cfg(d / "hf", d / "ep2", *common, "parallel.ep=2"))
    assert (ep2.groups.pp_size, ep2.groups.ep_size, ep2.groups.dp_size) == (2, 2, 1)
    b = mcore_to_hf_state(gather_model_state(unwrap(ep2.policy), ep2.groups), ep2.arch)
    assert ep1_tokens == ep2_tokens and a.keys() == b.keys()
    start = load_file(d / "hf" / "model.safetensors")
    moved = [n for n in a if ".mlp.experts." in n and not torch.equal(a[n], start[n].to(a[n].dtype))]
    assert len(moved) > 4, moved  # the steps trained the experts
    for n in a:
        assert float((a[n] - b[n]).norm() / a[n].norm().clamp(min=1e-30)) <= 1e-9, n
    _remove(d)
