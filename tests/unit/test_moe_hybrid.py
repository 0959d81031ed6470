"""Mixture-of-experts hybrids: Qwen3.5-MoE (`qwen3_5_moe`: the qwen3_5 hybrid with a MoE block, routed experts plus a
sigmoid-gated shared expert, in every layer) and Qwen3-Next (`qwen3_next`: the same layers, its GDN projections
fused per key head in the checkpoint, MoE layers where decoder_sparse_step / mlp_only_layers say). Both are
megatron's GatedDeltaNet / gated attention (models/gdn.py) with megatron's MoELayer in the MLP slot (models/moe.py).

Shown: the mapping, bit-exact conversion both ways (state and files, the published layouts: a multimodal container
and experts stored as 3-D tensors), and the policy gradient of replay, packed and naive against Hugging Face per
parameter on trees with forks at several depths, a 1-token response and a response that is a prefix of another;
router losses by multiplicity (replay == packed == naive; a planted bug that drops the multiplicity fails).

Precision: the gated delta net's rule computes in float32 whatever the dtype (tests/unit/test_gdn_replay.py), so
every comparison with a GDN layer in it is at BOUND = 1e-5, float32 and float64 alike. Measured on rollouts()
(worst parameter, relative, against HF): Qwen3.5-MoE float32 naive 2.2e-6, packed 2.1e-6, replay 2.9e-6, float64
<= 3.2e-6; Qwen3-Next float32 <= 2.1e-6, float64 <= 1.6e-6; router losses on, against naive: <= 2.1e-6.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gdn_helpers import plant_start_bug, rollouts
from safetensors.torch import load_file, save_file
from test_gdn_replay import worst

from megatron_branch.checkpoint import (
    convert_hf_to_mcore,
    convert_mcore_to_hf,
    hf_to_mcore_state,
    load_full_state,
    mcore_to_hf_state,
)
from megatron_branch.checkpoint.hf_io import HFTensorReader, load_hf_config
from megatron_branch.checkpoint.tp import gather_full_grads, gather_full_state
from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.losses import PolicyGradientObjective, router_plan
from megatron_branch.losses.router import MoEOptions, RouterLossConfig
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule
from megatron_branch.testing import (
    exact_hf_norms,
    exact_hf_routers,
    hf_policy_gradient,
    hf_state,
    tiny_hf_config,
    tiny_hf_model,
)

BOUND = 1e-5
LAYERS = ("linear_attention", "full_attention", "linear_attention")  # GDN -> attention -> GDN
VARIANTS = {
    "qwen3_5_moe": ("qwen3_5_moe", {}),
    "qwen3_next": ("qwen3_next", {"mlp_only_layers": [2]}),  # the last GDN layer keeps a dense MLP
}


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def hf_of(variant: str, dtype: torch.dtype = torch.float32, *, seed: int = 5):  # noqa: ANN201
    family, moe = VARIANTS[variant]
    cfg = tiny_hf_config(family, num_layers=3, ffn=48, layer_types=LAYERS, moe=moe)
    return exact_hf_routers(exact_hf_norms(tiny_hf_model(cfg, seed=seed, dtype=dtype)))


def megatron_of(hf, dtype: torch.dtype):  # noqa: ANN001, ANN201
    arch = ModelArch.from_hf_config(hf.config)
    model = build_model(arch, dtype=dtype)
    load_full_state(
        model, hf_to_mcore_state(hf_state(hf), arch, padded_vocab=arch.padded_vocab_size(1)), None
    )
    return arch, model


def step(model: torch.nn.Module, arch: ModelArch, schedule: str, rs: list[Rollout], **kw):  # noqa: ANN201
    tree = PrefixTree.build(rs, vocab_size=arch.vocab_size)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rs], tree.num_response_tokens_logical())
    model.zero_grad(set_to_none=True)
    res = run_schedule(
        schedule,
        model,
        tree,
        obj,
        ScheduleOptions(vocab_size=arch.vocab_size, **{"chunk_tokens": None, **kw}),
    )
    return res, mcore_to_hf_state(gather_full_grads(model, None), arch)


# --- mapping and conversion -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mapping_round_trip_and_logits(variant: str) -> None:
    hf = hf_of(variant, torch.float64)
    arch = ModelArch.from_hf_config(hf.config)
    assert arch.is_hybrid and arch.is_moe and arch.shared_expert_gate and arch.moe_norm_topk_prob
    assert arch.moe_layers == ((0, 1, 2) if variant == "qwen3_5_moe" else (0, 1))
    assert ModelArch.from_hf_config(arch.to_hf_config()) == arch  # the exported config maps back
    sd = hf_state(hf)
    state = hf_to_mcore_state(sd, arch, padded_vocab=arch.padded_vocab_size(4))
    back = mcore_to_hf_state(state, arch)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    model = build_model(arch, dtype=torch.float64)
    load_full_state(model, hf_to_mcore_state(sd, arch, padded_vocab=37), None)
    assert all(
        torch.equal(v, sd[k]) for k, v in mcore_to_hf_state(gather_full_state(model, None), arch).items()
    )
    ids = torch.randint(0, 37, (1, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.triu(torch.ones(20, 20, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        got, want = model(ids, torch.arange(20)[None], mask)[0, :, :37], hf(ids).logits[0]
    assert (got - want).abs().max() <= BOUND * want.abs().max()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_files_round_trip_bit_exact(variant: str, tmp_path: Path) -> None:
    """save_pretrained -> dist checkpoint (TP1 here; TP2 / EP2 under torchrun) -> HF: every tensor bit-exact, and
    the exported folder is the same architecture."""
    hf_of(variant, seed=1).save_pretrained(tmp_path / "hf")
    convert_hf_to_mcore(tmp_path / "hf", tmp_path / "mc", progress=False)
    meta = json.loads((tmp_path / "mc" / "megatron_branch.json").read_text())
    assert meta["arch"]["family"] == variant and meta["arch"]["num_experts"] == 4
    convert_mcore_to_hf(tmp_path / "mc", tmp_path / "out")
    src, dst = HFTensorReader(tmp_path / "hf"), HFTensorReader(tmp_path / "out")
    assert sorted(src.keys()) == sorted(dst.keys())
    assert all(torch.equal(src.get(k), dst.get(k)) for k in src.keys())
    a = ModelArch.from_hf_config(load_hf_config(tmp_path / "hf"))
    assert ModelArch.from_hf_config(load_hf_config(tmp_path / "out")) == a


def test_published_qwen3_5_moe_layout_reads_as_saved(tmp_path: Path) -> None:
    """The published Qwen3.5-MoE checkpoints: a multimodal container (text model under model.language_model., a
    vision tower and an MTP head that are not the policy) whose experts are 3-D tensors per layer
    (mlp.experts.gate_up_proj [E, 2e, h], mlp.experts.down_proj [E, h, e]): the same megatron state, bit for bit,
    as the per-expert folder save_pretrained writes."""
    hf = hf_of("qwen3_5_moe", seed=1)
    hf.save_pretrained(tmp_path / "hf")
    sd = load_file(tmp_path / "hf" / "model.safetensors")
    arch = ModelArch.from_hf_config(hf.config)
    packed: dict[str, torch.Tensor] = {}
    for i in range(arch.num_layers):
        e = f"model.layers.{i}.mlp.experts."
        gate_up = [
            torch.cat([sd.pop(f"{e}{j}.gate_proj.weight"), sd.pop(f"{e}{j}.up_proj.weight")])
            for j in range(4)
        ]
        packed[f"{e}gate_up_proj"] = torch.stack(gate_up)
        packed[f"{e}down_proj"] = torch.stack([sd.pop(f"{e}{j}.down_proj.weight") for j in range(4)])
    stored = {k.replace("model.", "model.language_model.", 1): v for k, v in {**sd, **packed}.items()}
    stored["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
    stored["mtp.fc.weight"] = torch.zeros(2, 2)
    pub = tmp_path / "published"
    pub.mkdir()
    save_file({k: v.contiguous() for k, v in stored.items()}, pub / "model.safetensors")
    text = json.loads((tmp_path / "hf" / "config.json").read_text())
    text.pop("architectures", None)
    container = {
        "model_type": "qwen3_5_moe",
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "text_config": {**text, "model_type": "qwen3_5_moe_text"},
        "tie_word_embeddings": False,
    }
    (pub / "config.json").write_text(json.dumps(container))
    assert ModelArch.from_hf_config(load_hf_config(pub)) == arch
    reader = HFTensorReader(pub)
    got = hf_to_mcore_state({k: reader.get(k) for k in reader.keys()}, arch, padded_vocab=37)
    want = hf_to_mcore_state(hf_state(hf), arch, padded_vocab=37)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_qwen3_next_gdn_projection_layout() -> None:
    """in_proj_qkvz / in_proj_ba are grouped per key head ([q, k, v, z] and [b, a] of each); megatron's in_proj is
    [q; k; v; z; beta; alpha]: the map puts HF's rows where transformers' own split sends them."""
    hf = hf_of("qwen3_next", torch.float64)
    lin = hf.model.layers[0].linear_attn
    x = torch.randn(1, 3, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        q, k, v, z, b, a = lin.fix_query_key_value_ordering(lin.in_proj_qkvz(x), lin.in_proj_ba(x))
    arch = ModelArch.from_hf_config(hf.config)
    w = hf_to_mcore_state(hf_state(hf), arch, padded_vocab=37)[
        "decoder.layers.0.self_attention.in_proj.weight"
    ]
    parts = (x[0] @ w.t()).split(list(arch.gdn_in_proj_sections()), dim=-1)
    for got, want in zip(parts, (q, k, v, z, b, a), strict=True):
        torch.testing.assert_close(got, want.reshape(3, -1), rtol=0, atol=1e-12)


# --- the policy gradient, router losses off --------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_replay_packed_naive_match_hf_per_parameter(variant: str, dtype: torch.dtype) -> None:
    """rollouts(): forks at depths 1-3, a 1-token response, a response that is a prefix of another, a prompt over
    two of the rule's 64-position chunks; shared tokens and their siblings' tokens route to different experts."""
    hf = hf_of(variant, dtype)
    arch, model = megatron_of(hf, dtype)
    rs = rollouts()
    hf_loss, want = hf_policy_gradient(hf, rs)
    for schedule in ("naive", "packed", "replay"):
        res, grads = step(model, arch, schedule, rs, branch_micro_batch=2)
        assert worst(grads, want)[0] <= BOUND, (schedule, worst(grads, want))
        assert res.loss == pytest.approx(hf_loss, rel=BOUND)


def test_replay_equals_naive_on_a_small_tree() -> None:
    """The edit loop's check: a fork at depth 2 and a 1-token segment, Qwen3-Next with a dense layer."""
    arch, model = megatron_of(hf_of("qwen3_next", seed=2), torch.float32)
    p = [3, 14, 15, 9, 2]
    rs = [
        Rollout(prompt=p, response=[6, 5, 3], advantage=1.0),
        Rollout(prompt=p, response=[6, 5, 8, 1], advantage=-0.5),
        Rollout(prompt=p, response=[7], advantage=0.4),
    ]
    base, naive = step(model, arch, "naive", rs)
    res, grads = step(model, arch, "replay", rs)
    assert res.loss == pytest.approx(base.loss, rel=BOUND) and worst(grads, naive)[0] <= BOUND


@pytest.mark.slow
def test_planted_zero_parent_state_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GDN state handed down at a fork is what makes replay exact here too: children started from a zero state
    (a planted bug in models/gdn.py's _start, tests/gdn_helpers.py) are far from naive."""
    arch, model = megatron_of(hf_of("qwen3_5_moe", seed=2), torch.float32)
    rs = rollouts()
    _, naive = step(model, arch, "naive", rs)
    plant_start_bug(monkeypatch, "zero_parent_state")
    _, grads = step(model, arch, "replay", rs)
    assert worst(grads, naive)[0] > 100 * BOUND


# --- router losses by multiplicity ------------------------------------------------------------------------------------
LOSSES = RouterLossConfig(aux_loss_coeff=0.2, seq_aux_loss_coeff=0.4, z_loss_coeff=0.1)


def _with_losses(model: torch.nn.Module, arch: ModelArch, schedule: str, rs: list[Rollout]) -> tuple:
    return step(model, arch, schedule, rs, branch_micro_batch=2, moe=MoEOptions(losses=LOSSES))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_router_losses_replay_equals_packed_equals_naive(
    variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aux + seq_aux + z losses on, float32: every schedule gives naive training's losses and gradient (BOUND); with
    the multiplicity weights planted away (a shared token counted once), packed and replay no longer do."""
    arch, model = megatron_of(hf_of(variant, seed=3), torch.float32)
    rs = rollouts()
    base, naive = _with_losses(model, arch, "naive", rs)
    assert base.stats["load_balancing_loss"] > 0 and base.stats["z_loss"] > 0
    for schedule in ("packed", "replay"):
        res, grads = _with_losses(model, arch, schedule, rs)
        assert worst(grads, naive)[0] <= BOUND, (schedule, worst(grads, naive))
        for k in ("load_balancing_loss", "seq_load_balancing_loss", "z_loss"):
            assert res.stats[k] == pytest.approx(base.stats[k], rel=BOUND), (schedule, k)
    monkeypatch.setattr(
        router_plan, "token_multiplicity", lambda member: torch.ones(member.shape[0], dtype=member.dtype)
    )
    for schedule in ("packed", "replay"):
        _, grads = _with_losses(model, arch, schedule, rs)
        assert worst(grads, naive)[0] > 100 * BOUND, schedule
