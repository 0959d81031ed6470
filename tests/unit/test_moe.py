"""Mixture-of-experts policies on megatron-core's MoELayer: Qwen3-MoE (norm_topk_prob on and off,
decoder_sparse_step, mlp_only_layers), Mixtral, Qwen2-MoE (shared expert with its gate). Mapping and refusals,
bit-exact conversion, and the policy gradient of every exact schedule against Hugging Face with the router losses
off, on trees where a shared token and its siblings' own tokens route to different experts.

float64: <= 1e-9 relative per parameter (measured ~2e-15; HF's float32 router softmax is made float64 in the
oracle, megatron's by compat/moe.py); float32: <= 1e-5 (measured ~1e-6).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conversion_helpers import assert_round_trip_and_logits, files_round_trip

from megatron_branch.checkpoint import (
    hf_to_mcore_state,
    load_full_state,
    mcore_to_hf_state,
)
from megatron_branch.checkpoint.param_map import mcore_names, sharded_keys
from megatron_branch.checkpoint.tp import gather_full_grads
from megatron_branch.data import PrefixTree
from megatron_branch.errors import UserError
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.models import ModelArch, build_model
from megatron_branch.models.moe import BranchRouter
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule
from megatron_branch.testing import (
    exact_hf_norms,
    exact_hf_routers,
    hf_policy_gradient,
    hf_state,
    random_tree_rollouts,
    tiny_hf_config,
    tiny_hf_model,
)

TOL = {torch.float64: 1e-9, torch.float32: 1e-5}
EXACT = ("naive", "packed", "replay", "naive-fused", "packed-nosharing")
VARIANTS = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-softmax-topk": ("qwen3_moe", {"norm_topk_prob": False}),
    "qwen3_moe-sparse": ("qwen3_moe", {"decoder_sparse_step": 2}),  # layer 0 dense, layer 1 MoE
    "qwen3_moe-mlp-only": ("qwen3_moe", {"mlp_only_layers": [1]}),
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),
}


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def hf_moe(variant: str, *, seed: int = 2, dtype: torch.dtype = torch.float64, tie: bool = False):  # noqa: ANN201
    family, moe = VARIANTS[variant]
    cfg = tiny_hf_config(family, ffn=48, tie=tie, moe=moe)
    return exact_hf_routers(exact_hf_norms(tiny_hf_model(cfg, seed=seed, dtype=dtype))).eval()


def megatron_of(hf, dtype: torch.dtype):  # noqa: ANN001, ANN201
    arch = ModelArch.from_hf_config(hf.config)
    model = build_model(arch, dtype=dtype)
    load_full_state(model, hf_to_mcore_state(hf_state(hf), arch, padded_vocab=arch.vocab_size), None)
    return arch, model


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


# --- mapping --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "variant,pattern,norm",
    [
        ("qwen3_moe", None, True),
        ("qwen3_moe-softmax-topk", None, False),
        ("qwen3_moe-sparse", (0, 1), True),
        ("qwen3_moe-mlp-only", (1, 0), True),
        ("mixtral", None, True),
        ("qwen2_moe", None, False),
    ],
)
def test_mapping_round_trips_and_builds_megatron_moe(variant: str, pattern: tuple | None, norm: bool) -> None:
    hf = hf_moe(variant, dtype=torch.float32)
    arch = ModelArch.from_hf_config(hf.config)
    assert (arch.num_experts, arch.moe_top_k, arch.moe_layer_pattern, arch.moe_norm_topk_prob) == (
        4,
        2,
        pattern,
        norm,
    )
    assert ModelArch.from_hf_config(arch.to_hf_config()) == arch
    cfg = arch.to_transformer_config()
    assert cfg.moe_router_pre_softmax is (not norm) and cfg.moe_token_dispatcher_type == "alltoall"
    assert cfg.moe_layer_freq == (1 if pattern is None else list(pattern))
    model = build_model(arch)
    assert set(dict(model.named_parameters())) == set(mcore_names(arch))
    moe_layers = [
        i
        for i, layer in enumerate(model.decoder.layers)
        if isinstance(getattr(layer.mlp, "router", None), BranchRouter)
    ]
    assert tuple(moe_layers) == arch.moe_layers
    keys = {sh.key for sh in model.sharded_state_dict().values() if not sh.key.endswith("_extra_state")}
    assert keys == set(sharded_keys(arch))
    if arch.shared_expert_gate:
        assert model.decoder.layers[0].mlp.shared_experts.gate_weight.shape == (1, 32)


@pytest.mark.parametrize(
    "family,change,words",
    [
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ("mixtral", {"sliding_window": 64}, "sliding_window"),
        ("qwen3_moe", {"mlp_only_layers": [0, 1]}, "no MoE layer"),
        ("qwen3_moe", {"mlp_only_layers": [7]}, "mlp_only_layers lists layer 7"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
        ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_refusals_are_one_line(family: str, change: dict, words: str) -> None:
    d = dict(tiny_hf_config(family).to_dict(), **change)
    with pytest.raises(UserError, match=words) as e:
        ModelArch.from_hf_config(d)
    assert "\n" not in str(e.value)


def test_parallel_sizes_are_checked() -> None:
    arch = ModelArch.from_hf_config(tiny_hf_config("qwen3_moe"))
    with pytest.raises(UserError, match="expert parallel size 3 does not divide num_experts=4"):
        arch.check_expert_parallel(3)
    with pytest.raises(UserError, match="moe_intermediate_size=16"):
        arch.check_expert_parallel(1, tp=32)  # the experts split over TP (expert TP = TP)
    dense = ModelArch.from_hf_config(tiny_hf_config("qwen3"))
    with pytest.raises(UserError, match="needs a mixture-of-experts model"):
        dense.check_expert_parallel(2)


# --- conversion ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["qwen3_moe-mlp-only", "mixtral", "qwen2_moe"])
def test_round_trip_is_bit_exact_and_logits_match(variant: str) -> None:
    hf = hf_moe(variant, dtype=torch.float32)
    assert_round_trip_and_logits(hf, hf_state(hf))


def test_files_round_trip_and_verify(tmp_path: Path) -> None:
    arch, _, cfg = files_round_trip(hf_moe("qwen3_moe-sparse", seed=1, dtype=torch.float32), tmp_path)
    assert arch["num_experts"] == 4 and arch["moe_layer_pattern"] == [0, 1]
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["mlp_only_layers"] == [0]


# --- the policy gradient, router losses off -------------------------------------------------------------------------
def routed_experts(model: torch.nn.Module, tree: PrefixTree) -> dict[int, torch.Tensor]:
    """layer -> [N, E] bool: the experts every packed token routes to (one packed forward, megatron's routing)."""
    from megatron_branch.losses.routing import RoutingRecorder
    from megatron_branch.models.moe import attach_router_context
    from megatron_branch.schedule.chunks import make_chunk
    from megatron_branch.schedule.common import forward_chunk

    rec = RoutingRecorder()
    chunk = make_chunk(tree, range(len(tree.segments)))
    with torch.no_grad(), attach_router_context(model, rec):
        forward_chunk(model, tree, chunk, None, ScheduleOptions(vocab_size=37, chunk_tokens=None))
    return rec.maps


def test_tree_routes_shared_and_private_tokens_to_different_experts() -> None:
    """The trees the parity tests use do exercise routing under sharing: in every MoE layer some shared token (the
    last of a segment with children) goes to other experts than one of its children's first tokens, and some
    siblings' first tokens go to different experts (a schedule that mixed up whose rows an expert sees would be
    caught), at every fork in some layer."""
    hf = hf_moe("qwen3_moe")
    _, model = megatron_of(hf, torch.float64)
    tree = PrefixTree.build(random_tree_rollouts(prompt_len=7, branches=3, levels=2, seed=202), vocab_size=37)
    maps = routed_experts(model, tree)
    forks = [s for s in tree.segments if len(s.children) >= 2]
    assert len(forks) >= 3
    differs = {}  # (layer, fork) -> (shared vs a child differ, siblings differ)
    for layer, m in maps.items():
        for seg in forks:
            last = m[seg.offset + seg.length - 1]
            firsts = [m[tree.segments[c].offset] for c in seg.children]
            differs[layer, seg.id] = (
                any(not torch.equal(last, f) for f in firsts),
                len({tuple(f.tolist()) for f in firsts}) > 1,
            )
    for layer in maps:
        assert any(differs[layer, s.id][0] for s in forks) and any(differs[layer, s.id][1] for s in forks)
    for seg in forks:
        assert any(differs[layer, seg.id][0] and differs[layer, seg.id][1] for layer in maps), seg.id


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_exact_schedule_matches_hf(variant: str, dtype: torch.dtype) -> None:
    if dtype == torch.float32 and variant not in ("qwen3_moe", "mixtral"):
        pytest.skip("float32: one Qwen and one Mixtral variant")
    hf = hf_moe(variant, dtype=dtype)
    arch, model = megatron_of(hf, dtype)
    rollouts = random_tree_rollouts(prompt_len=7, branches=3, levels=2, seed=202)
    hf_loss, hf_grads = hf_policy_gradient(hf, rollouts)
    tree = PrefixTree.build(rollouts, vocab_size=37)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rollouts], tree.num_response_tokens_logical())
    for schedule in EXACT:
        model.zero_grad(set_to_none=True)
        res = run_schedule(
            schedule,
            model,
            tree,
            obj,
            ScheduleOptions(vocab_size=37, branch_micro_batch=2, chunk_tokens=None),
        )
        grads = mcore_to_hf_state(gather_full_grads(model, None), arch)
        assert res.loss == pytest.approx(hf_loss, rel=10 * TOL[dtype])
        assert grads.keys() == hf_grads.keys()
        worst = max((_rel(grads[n], g), n) for n, g in hf_grads.items())
        assert worst[0] <= TOL[dtype], (schedule, worst)


def test_metrics_count_tokens_per_expert_logical_and_computed() -> None:
    """Per layer the experts' token counts: computed = rows this schedule ran (each routed to k experts), logical =
    the same weighted by multiplicity, which is what naive per-rollout training routes."""
    hf = hf_moe("qwen3_moe")
    arch, model = megatron_of(hf, torch.float64)
    rollouts = random_tree_rollouts(groups=2, prompt_len=6, branches=3, levels=2, seed=7)
    tree = PrefixTree.build(rollouts, vocab_size=37)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rollouts], tree.num_response_tokens_logical())
    stats = {}
    for schedule in ("naive", "packed", "replay"):
        model.zero_grad(set_to_none=True)
        stats[schedule] = run_schedule(
            schedule, model, tree, obj, ScheduleOptions(vocab_size=37, chunk_tokens=None)
        ).stats
    k, E = arch.moe_top_k, arch.num_experts
    for layer in arch.moe_layers:

        def counts(s: dict, kind: str, layer: int = layer) -> list[float]:
            return [s[f"moe/tokens_per_expert/{kind}/layer_{layer}/expert_{e}"] for e in range(E)]

        assert sum(counts(stats["packed"], "computed")) == k * tree.positions_computed
        assert sum(counts(stats["packed"], "logical")) == k * tree.positions_logical
        assert (
            counts(stats["packed"], "logical")
            == counts(stats["naive"], "computed")
            == counts(stats["replay"], "logical")
        )
        assert counts(stats["packed"], "computed") == counts(stats["replay"], "computed")
        assert counts(stats["packed"], "computed") != counts(stats["packed"], "logical")
