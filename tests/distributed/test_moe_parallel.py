"""Mixture-of-experts policies under every parallel layout (the grad command, in-process on every rank).

    python tests/distributed/launch.py 2 -k moe     # TP2+SP, CP2, EP2 (across the DP replicas), CP2xEP2, DP2
    python tests/distributed/launch.py 4 -k moe     # EP2xTP2+SP (EP across replicas), EP4, TP2xCP2xEP2,
                                                    # EP2xTP2+SP at expert TP 1 (EP over the TP ranks);
                                                    # the MoE hybrids at CP4, TP2xCP2+SP, CP2xEP2 x DP2

Router losses off: the gradient against Hugging Face's (float64, exact norms and routers), per parameter,
--dtype float64 <= 1e-9 and float32 <= 1e-5. Router losses on: within a layout replay == packed == naive, and every
layout with one data-parallel replica equals the others (float64 1e-9; the losses' scope is a replica's
micro-batch, as megatron's). Expert parallelism across replicas runs the lockstep (parallel/lockstep.py); its
dummy chunks must leave the gradient exact. Conversion: HF -> dist checkpoint at TP2 / EP2 -> HF, bit-exact.

The MoE hybrids (Qwen3.5-MoE, Qwen3-Next) on test_gdn_cp.py's tree (forks at depths 1-3, a 1-token response, a
response that is a prefix of another), at the gated delta rule's float32 bound (1e-5): grad vs HF under TP2+SP,
EP2, CP2, CP2xEP2 (world 2) and CP4, TP2xCP2+SP, CP2xEP2 with two replicas (world 4), measured <= 5.6e-6 (worst
parameter, relative); router losses on, replay and packed under TP2+SP, CP2, CP2xEP2 vs naive <= 3.6e-6, and
with the multiplicity weights planted away 0.47 (CP2 replay); training under EP2 == DP2 (float64, 1e-9).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_helpers import shared_tmp
from safetensors.torch import load_file
from train_helpers import KV_TASK, QUIET

from megatron_branch.cli import main
from megatron_branch.data import Rollout, write_rollouts_jsonl

TOL = {"float64": 1e-9, "float32": 1e-5}


def _rollouts() -> list[Rollout]:
    """The grad matrix's tree: two prompt groups, a shared response beginning with three branches under it."""
    gen = torch.Generator().manual_seed(11)

    def rand(n: int) -> list[int]:
        return [int(x) for x in torch.randint(10, 37, (n,), generator=gen)]

    pa, pb = rand(11), rand(9)
    return [
        Rollout(prompt=pa, response=[3, 4, 5, 6] + rand(4), advantage=1.25),
        Rollout(prompt=pa, response=[3, 4, 5, 7], advantage=-0.5),
        Rollout(prompt=pa, response=[3, 4, 5, 8] + rand(2), advantage=0.75),
        Rollout(prompt=pa, response=[9] + rand(6), advantage=-1.0),
        Rollout(prompt=pb, response=[1] + rand(4), advantage=0.5),
        Rollout(prompt=pb, response=[2] + rand(2), advantage=-1.5),
    ]


@pytest.fixture(scope="module")
def setup() -> tuple[Path, dict[str, torch.Tensor]]:
    """(folder with hf/ and r.jsonl, the float64 HF oracle's gradient) on every rank."""
    from transformers import AutoModelForCausalLM

    from megatron_branch.testing import (
        exact_hf_norms,
        exact_hf_routers,
        hf_experts_kwargs,
        hf_policy_gradient,
        tiny_hf_config,
        tiny_hf_model,
    )

    d = shared_tmp("moe_parallel_")
    rollouts = _rollouts()
    cfg = tiny_hf_config("qwen3_moe", heads=4, kv_heads=2)
    if dist.get_rank() == 0:
        tiny_hf_model(cfg, seed=4).save_pretrained(d / "hf")
        write_rollouts_jsonl(d / "r.jsonl", rollouts)
    dist.barrier()
    hf = AutoModelForCausalLM.from_pretrained(
        d / "hf", dtype=torch.float64, attn_implementation="sdpa", **hf_experts_kwargs(cfg)
    )
    _, grads = hf_policy_gradient(exact_hf_routers(exact_hf_norms(hf)), rollouts)
    return d, grads


def _grad(d: Path, name: str, schedule: str, *flags: str) -> tuple[int, dict[str, torch.Tensor], dict]:
    out = d / f"{name}.safetensors"
    argv = ["grad", "--hf", str(d / "hf"), "--rollouts", str(d / "r.jsonl"), "--out", str(out), "--overwrite"]
    rc = main([*argv, "--schedule", schedule, "--branch-micro-batch", "2", *flags])
    dist.barrier()
    return rc, (load_file(out) if rc == 0 else {}), {}


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert set(got) == set(want)
    return max(
        (((got[n].double() - w.double()).norm() / w.double().norm().clamp(min=1e-30)).item(), n)
        for n, w in want.items()
    )


LAYOUTS = {
    2: {
        "tp2sp": ["--tp", "2", "--sequence-parallel"],
        "tp2sp-etp1": ["--tp", "2", "--sequence-parallel", "--etp", "1"],  # whole experts on each TP rank
        "cp2": ["--cp", "2"],
        "ep2": ["--ep", "2"],  # EP across the two DP replicas: lockstep
        "cp2ep2": ["--cp", "2", "--ep", "2"],  # EP over the CP ranks
        "dp2": [],
    },
    4: {
        "tp2sp-ep2": ["--tp", "2", "--sequence-parallel", "--ep", "2"],  # expert TP2, EP across replicas
        "ep4": ["--ep", "4"],  # two replicas without rollouts: all dummies
        "tp2cp2sp-ep2": ["--tp", "2", "--cp", "2", "--sequence-parallel", "--ep", "2"],
        # expert TP 1, EP over each replica's TP ranks
        "tp2sp-ep2-etp1": ["--tp", "2", "--sequence-parallel", "--ep", "2", "--etp", "1"],
    },
}


@pytest.mark.world(2, 4)
def test_moe_grad_matches_hf_under_every_layout(setup) -> None:
    d, ref = setup
    for name, layout in LAYOUTS[dist.get_world_size()].items():
        for schedule, dtype in (("replay", "float64"), ("packed", "float32")):
            rc, grads, _ = _grad(d, f"{name}_{schedule}_{dtype}", schedule, "--dtype", dtype, *layout)
            assert rc == 0, (name, schedule)
            err = _worst(grads, ref)
            assert err[0] <= TOL[dtype], (name, schedule, dtype, err)


@pytest.mark.world(2)
def test_moe_router_losses_are_layout_and_schedule_invariant(setup) -> None:
    """aux + seq_aux + z losses on, float64: replay == packed (== naive where it runs) in every layout, and the
    layouts with one replica (TP2+SP, CP2, CP2xEP2) give one gradient; EP2 across replicas equals DP2."""
    d, _ = setup
    losses = ["--moe-aux-loss-coeff", "0.3", "--moe-seq-aux-loss-coeff", "0.2", "--moe-z-loss-coeff", "0.05"]
    runs = {}
    for name in ("tp2sp", "cp2", "cp2ep2", "ep2", "dp2"):
        layout = LAYOUTS[2][name]
        schedules = ("replay", "packed") if "--cp" in layout else ("replay", "packed", "naive")
        for schedule in schedules:
            rc, grads, _ = _grad(
                d, f"aux_{name}_{schedule}", schedule, "--dtype", "float64", *losses, *layout
            )
            assert rc == 0, (name, schedule)
            runs[name, schedule] = grads
        for schedule in schedules[1:]:
            assert _worst(runs[name, schedule], runs[name, "replay"])[0] <= 1e-9, (name, schedule)
    for name in ("cp2", "cp2ep2"):
        assert _worst(runs[name, "replay"], runs["tp2sp", "replay"])[0] <= 1e-9, name
    assert _worst(runs["ep2", "replay"], runs["dp2", "replay"])[0] <= 1e-9
    assert _worst(runs["dp2", "replay"], runs["tp2sp", "replay"])[0] > 1e-6  # per-replica scope: another loss


@pytest.mark.world(2, 4)
def test_moe_conversion_round_trips_bit_exact_at_tp_and_ep(setup) -> None:
    """HF -> dist checkpoint built at TP2 (experts split over TP, or whole: --etp 1) and at EP2 (EP2 x TP2 at world 4)
    -> HF: every tensor bit-exact."""
    from megatron_branch.checkpoint.hf_io import HFTensorReader

    d, _ = setup
    world = dist.get_world_size()
    layouts = (
        {"tp2": ["--tp", "2"], "tp2etp1": ["--tp", "2", "--etp", "1"], "ep2": ["--ep", "2"]}
        if world == 2
        else {"tp2ep2": ["--tp", "2", "--ep", "2"]}
    )
    src = HFTensorReader(d / "hf")
    for name, layout in layouts.items():
        mc, back = d / f"mc_{name}", d / f"hf_{name}"
        assert main(["convert", "hf-to-mcore", "--hf", str(d / "hf"), "--out", str(mc), *layout]) == 0
        assert main(["convert", "mcore-to-hf", "--mcore", str(mc), "--out", str(back)]) == 0
        dist.barrier()
        meta = json.loads((mc / "megatron_branch.json").read_text())
        assert meta["arch"]["num_experts"] == 4
        dst = HFTensorReader(back)
        assert sorted(src.keys()) == sorted(dst.keys())
        for k in src.keys():
            assert torch.equal(src.get(k), dst.get(k)), (name, k)


def _train_cfg(hf: Path | None, out: Path, *overrides: str):  # noqa: ANN202
    from megatron_branch.train.config_io import load_config

    model = (
        f"model.hf_path={hf}"  # the same weights under every layout (a random init draws per EP rank)
        if hf is not None
        else "model.arch={family: qwen3_moe, hidden_size: 16, num_layers: 2, num_attention_heads: 2, "
        "num_query_groups: 2, ffn_hidden_size: 32, num_experts: 4, moe_top_k: 2, moe_ffn_hidden_size: 8}"
    )
    base = [
        model,
        "model.dtype=float64",
        *KV_TASK,
        "moe.router_replay=R3",
        "moe.aux_loss_coeff=0.01",
        "moe.z_loss_coeff=0.001",
        f"trainer.default_local_dir={out}",
        *QUIET,
        "checkpoint.hf_export=false",
    ]
    return load_config(None, [*base, *overrides])


def _train(cfg) -> tuple[object, list[list]]:  # noqa: ANN001
    from megatron_branch.train.loop import Trainer

    tr = Trainer(cfg)
    tokens = []
    while tr.step < cfg.trainer.total_training_steps:
        tr.train_step()
        tokens.append([r.response for r in tr.last_batch])
    return tr, tokens


def _full_params(tr) -> dict[str, torch.Tensor]:  # noqa: ANN001
    from megatron_branch.checkpoint.tp import gather_full_state
    from megatron_branch.train.models import unwrap

    return gather_full_state(unwrap(tr.policy), tr.groups.tp, tr.groups.ep)


TRAIN_MODELS = {
    "qwen3_moe": {"ffn": 32},
    # a MoE hybrid: a gated delta net layer, then gated attention, a MoE block (gated shared expert) after each
    "qwen3_next": {"ffn": 32, "layer_types": ("linear_attention", "full_attention")},
}


@pytest.mark.world(2)
@pytest.mark.parametrize("family", list(TRAIN_MODELS))
def test_moe_training_under_ep_equals_dp_and_resumes_exactly(family: str) -> None:
    """A tiny Qwen3-MoE and a tiny Qwen3-Next (GDN state handed down at each fork) trained with routing replay (R3)
    and router losses: EP2 across the two DP replicas (lockstep sampling, scoring and updates; the lockstep's dummy
    chunks run through the GDN layers too) trains the same run as DP2 without EP, float64; an EP2 run stopped
    after one step and resumed (experts sharded in the dist checkpoint) equals the uninterrupted one."""
    from megatron_branch.testing import tiny_hf_config, tiny_hf_model
    from megatron_branch.train.loop import Trainer

    d = shared_tmp("moe_parallel_")
    hf = d / "hf"
    vocab = Trainer(
        _train_cfg(None, d / "probe", "trainer.total_training_steps=1")
    ).arch.vocab_size  # the tokenizer's
    if dist.get_rank() == 0:
        shape = dict(vocab_size=vocab, hidden_size=16, num_layers=2, heads=2, kv_heads=2)
        cfg = tiny_hf_config(family, **shape, **TRAIN_MODELS[family])
        tiny_hf_model(cfg, seed=5).save_pretrained(hf)
    dist.barrier()
    dp, dp_tokens = _train(_train_cfg(hf, d / "dp2", "trainer.total_training_steps=2"))
    a = _full_params(dp)  # now: the next run lays out the groups anew
    ep, ep_tokens = _train(_train_cfg(hf, d / "ep2", "trainer.total_training_steps=2", "parallel.ep=2"))
    b = _full_params(ep)
    assert dp_tokens == ep_tokens
    assert set(a) == set(b)
    if family == "qwen3_next":
        assert any(".self_attention.in_proj." in n for n in a)  # the GDN layers trained
    for n in a:
        assert ((a[n] - b[n]).norm() / a[n].norm().clamp(min=1e-30)) <= 1e-9, n
    part, _ = _train(_train_cfg(hf, d / "part", "trainer.total_training_steps=1", "parallel.ep=2"))
    part.save()
    again, tokens = _train(
        _train_cfg(
            hf, d / "part", "trainer.total_training_steps=2", "parallel.ep=2", "trainer.resume_mode=auto"
        )
    )
    assert tokens == ep_tokens[1:]
    c = _full_params(again)
    for n in b:
        assert ((b[n] - c[n]).norm() / b[n].norm().clamp(min=1e-30)) <= 1e-9, n


HYBRIDS = {"qwen3_5_moe": {}, "qwen3_next": {"mlp_only_layers": [2]}}
"""The MoE hybrids (GDN -> attention -> GDN, a MoE block after each; Qwen3-Next's last layer dense)."""
HYBRID_RUNS = {
    2: [
        ("tp2sp", ["--tp", "2", "--sequence-parallel"], ("naive", "packed", "replay")),
        ("ep2", ["--ep", "2"], ("replay",)),  # EP across the replicas: lockstep dummies through GDN layers
        ("cp2", ["--cp", "2"], ("packed", "replay")),  # GDN heads exchanged over CP, experts after them
        ("cp2ep2", ["--cp", "2", "--ep", "2"], ("replay",)),  # EP over the CP ranks
        ("tp2sp_fp64", ["--tp", "2", "--sequence-parallel", "--dtype", "float64"], ("replay",)),
    ],
    4: [
        ("tp2sp-dp2", ["--tp", "2", "--sequence-parallel"], ("naive",)),  # naive (no CP), two replicas
        ("cp4", ["--cp", "4"], ("packed", "replay")),  # one GDN value head per rank, key heads shared by two
        ("tp2cp2sp", ["--tp", "2", "--cp", "2", "--sequence-parallel"], ("packed", "replay")),
        ("cp2ep2-dp2", ["--cp", "2", "--ep", "2"], ("replay",)),  # two replicas, EP over each one's CP ranks
    ],
}
ROUTER_LOSSES = ["--moe-aux-loss-coeff", "0.3", "--moe-seq-aux-loss-coeff", "0.2"] + [
    "--moe-z-loss-coeff",
    "0.05",
]


def _hybrid_rollouts() -> list[Rollout]:
    """The hybrid CP tests' tree (tests/distributed/test_gdn_cp.py): forks at depths 1, 2 and 3, a 1-token
    response ([4]), a response that is a prefix of another ([1, 2]), segments shorter than the conv's K-1 inputs
    and than 2 x CP, a 70-token prompt (two of the delta rule's 64-position chunks) forking mid-chunk; shared
    tokens carry different advantages per rollout and route to different experts than their siblings' tokens."""
    from gdn_helpers import rollouts

    return rollouts()


@pytest.fixture(scope="module", params=list(HYBRIDS))
def hybrid(request: pytest.FixtureRequest) -> tuple[str, Path, dict[str, torch.Tensor]]:
    """(family, folder with hf/ and r.jsonl, the float64 HF oracle's gradient) on every rank."""
    from transformers import AutoModelForCausalLM

    from megatron_branch.testing import (
        exact_hf_norms,
        exact_hf_routers,
        hf_experts_kwargs,
        hf_policy_gradient,
        tiny_hf_config,
        tiny_hf_model,
    )

    family = request.param
    d = shared_tmp("moe_parallel_")
    rollouts = _hybrid_rollouts()
    layers = ("linear_attention", "full_attention", "linear_attention")
    cfg = tiny_hf_config(family, num_layers=3, ffn=48, layer_types=layers, moe=HYBRIDS[family])
    if dist.get_rank() == 0:
        tiny_hf_model(cfg, seed=4).save_pretrained(d / "hf")
        write_rollouts_jsonl(d / "r.jsonl", rollouts)
    dist.barrier()
    hf = AutoModelForCausalLM.from_pretrained(
        d / "hf", dtype=torch.float64, attn_implementation="sdpa", **hf_experts_kwargs(cfg)
    )
    _, ref = hf_policy_gradient(exact_hf_routers(exact_hf_norms(hf)), rollouts)
    return family, d, ref


@pytest.mark.world(2, 4)
def test_moe_hybrid_grad_matches_hf(hybrid) -> None:  # noqa: ANN001
    """Qwen3.5-MoE and Qwen3-Next: `grad` against the float64 HF oracle per parameter at the gated delta rule's
    float32 bound (1e-5, tests/unit/test_moe_hybrid.py): world 2 TP2+SP, EP2, CP2 (the GDN head exchange) and
    CP2 x EP2; world 4 CP4, TP2 x CP2 + SP, CP2 x EP2 with two replicas, naive at TP2+SP with two replicas. The
    launch's first run is naive (without CP); every later one equals it too (replay == packed == naive)."""
    family, d, ref = hybrid
    naive = None
    for name, layout, schedules in HYBRID_RUNS[dist.get_world_size()]:
        for schedule in schedules:
            rc, grads, _ = _grad(d, f"{family}_{name}_{schedule}", schedule, *layout)
            assert rc == 0, (family, name, schedule)
            naive = grads if naive is None else naive
            assert schedule != "naive" or grads is naive
            for against, want in (("hf", ref), ("naive", naive)):
                err = _worst(grads, want)
                assert err[0] <= 1e-5, (family, name, schedule, against, err)


@pytest.mark.world(2)
def test_moe_hybrid_router_losses_under_cp(hybrid, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """aux + seq_aux + z losses on, float32, the shared tokens weighted by their multiplicity: replay and packed
    under TP2+SP and CP2, replay under CP2 x EP2, equal naive (TP2+SP) at the delta rule's bound 1e-5 (one
    replica: one loss scope); with the multiplicity weights planted away (a shared token counted once) replay
    under CP2 no longer does."""
    from megatron_branch.losses import router_plan

    family, d, _ = hybrid
    layouts = {
        "tp2sp": ["--tp", "2", "--sequence-parallel"],
        "tp2sp-etp1": ["--tp", "2", "--sequence-parallel", "--etp", "1"],  # whole experts on each TP rank
        "cp2": ["--cp", "2"],
        "cp2ep2": ["--cp", "2", "--ep", "2"],
    }
    rc, naive, _ = _grad(d, f"{family}_aux_naive", "naive", *layouts["tp2sp"], *ROUTER_LOSSES)
    assert rc == 0
    for name, layout in layouts.items():
        for schedule in ("packed", "replay") if name != "cp2ep2" else ("replay",):
            rc, grads, _ = _grad(d, f"{family}_aux_{name}_{schedule}", schedule, *layout, *ROUTER_LOSSES)
            assert rc == 0, (family, name, schedule)
            err = _worst(grads, naive)
            assert err[0] <= 1e-5, (family, name, schedule, err)
    monkeypatch.setattr(
        router_plan, "token_multiplicity", lambda member: torch.ones(member.shape[0], dtype=member.dtype)
    )
    rc, grads, _ = _grad(d, f"{family}_aux_bug", "replay", *layouts["cp2"], *ROUTER_LOSSES)
    assert rc == 0
    err = _worst(grads, naive)
    assert err[0] > 100 * 1e-5, (family, err)


@pytest.mark.world(2)
def test_moe_hybrid_converts_bit_exact(hybrid) -> None:  # noqa: ANN001
    """HF -> dist checkpoint at TP2 / EP2 -> HF: every tensor bit-exact."""
    from megatron_branch.checkpoint.hf_io import HFTensorReader

    family, d, _ = hybrid
    src = HFTensorReader(d / "hf")
    for name, layout in {"tp2": ["--tp", "2"], "ep2": ["--ep", "2"]}.items():
        mc, back = d / f"mc_{family}_{name}", d / f"hf_{family}_{name}"
        assert main(["convert", "hf-to-mcore", "--hf", str(d / "hf"), "--out", str(mc), *layout]) == 0
        assert main(["convert", "mcore-to-hf", "--mcore", str(mc), "--out", str(back)]) == 0
        dist.barrier()
        dst = HFTensorReader(back)
        assert sorted(src.keys()) == sorted(dst.keys())
        for k in src.keys():
            assert torch.equal(src.get(k), dst.get(k)), (family, name, k)
