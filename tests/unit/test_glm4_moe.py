"""GLM-4.5 / 4.6 MoE (`glm4_moe`, models/families/glm4_moe.py) on megatron-core: partial RoPE, q/k/v bias, q/k
norms, first dense layers, and the DeepSeek-style router (sigmoid scores, the correction bias in the choice only,
group-limited top-k, renormalised, scaled) with shared experts. Mapping and refusals, bit-exact conversion, the
policy gradient of every exact schedule against Hugging Face on fork-heavy trees, router losses by multiplicity,
planted bugs (the bias ignored in the top-k, the bias added into the weights, the group limit ignored) that each
fail, and a checkpoint carrying its MTP layer refused. The sampler, routing replay, `train`, the tiny assets and the
planner: tests/unit/test_glm4_moe_use.py.

Bounds: megatron computes the sigmoid router's scores in float32 whatever the model's dtype
(`torch.sigmoid(logits.float())`, moe_utils.topk_routing_with_score_function), so a float64 run's routing weights
carry float32 rounding (2^-24 relative): float64 is tested at FP64_SIGMOID_BOUND against HF's router computed in
float64 (testing.exact_hf_routers); the schedules among themselves too (a shared token's float64 logits computed
once may round to float32 otherwise than a rollout's own copy: measured 3e-8). float32: 1e-5 relative.
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
from megatron_branch.losses.router import MoEOptions
from megatron_branch.models import ModelArch, build_model
from megatron_branch.models.moe import branch_routers
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

FP64_SIGMOID_BOUND = 1e-6
"""float64 vs HF: megatron's float32 sigmoid scores (measured ~1e-8 relative per parameter)."""
TOL = {torch.float64: FP64_SIGMOID_BOUND, torch.float32: 1e-5}
EXACT = ("naive", "packed", "replay", "naive-fused", "packed-nosharing")


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def glm_hf(*, seed: int = 2, dtype: torch.dtype = torch.float64, moe: dict | None = None, exact: bool = True):  # noqa: ANN201
    """A tiny GLM MoE (12 experts in 3 groups, top-4 within 2 groups, a shared expert, layer 0 dense) whose
    correction biases are random (float32 values, as HF keeps them), large enough to change the choice."""
    return with_random_biases(
        tiny_hf_config("glm4_moe", ffn=48, moe=moe), seed=seed, dtype=dtype, exact=exact
    )


def with_random_biases(config, *, seed: int, dtype: torch.dtype, exact: bool):  # noqa: ANN001, ANN201
    """A tiny HF model of a DeepSeek-style-router `config` (glm4_moe, deepseek_v3) whose correction biases are
    random, large enough to change the choice; `exact`: HF's norms and routers in the model's dtype."""
    hf = tiny_hf_model(config, seed=seed, dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for m in hf.modules():
            if hasattr(m, "e_score_correction_bias"):
                b = m.e_score_correction_bias
                b.copy_((0.3 * torch.randn(b.shape, generator=gen)).to(b.dtype))
    if exact:
        exact_hf_routers(exact_hf_norms(hf))
    return hf.eval()


def megatron_of(hf, dtype: torch.dtype):  # noqa: ANN001, ANN201
    arch = ModelArch.from_hf_config(hf.config)
    model = build_model(arch, dtype=dtype)
    load_full_state(model, hf_to_mcore_state(hf_state(hf), arch, padded_vocab=arch.vocab_size), None)
    return arch, model


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def _worst(got: dict, want: dict) -> tuple[float, str]:
    return max((_rel(got[n], g), n) for n, g in want.items())


# --- mapping --------------------------------------------------------------------------------------------------------
def test_mapping_round_trips_and_builds_megatrons_sigmoid_router() -> None:
    hf = glm_hf(dtype=torch.float32)
    arch = ModelArch.from_hf_config(hf.config)
    assert (arch.num_experts, arch.moe_top_k, arch.moe_num_groups, arch.moe_group_topk) == (12, 4, 3, 2)
    assert (arch.moe_score_function, arch.moe_expert_bias, arch.moe_routed_scaling_factor) == (
        "sigmoid",
        True,
        1.5,
    )
    assert (arch.moe_layer_pattern, arch.shared_expert_ffn_hidden_size, arch.shared_expert_gate) == (
        (0, 1),
        16,
        False,
    )
    assert (arch.qkv_bias, arch.qk_norm, arch.rotary_percent, arch.rotary_dim) == (True, True, 0.5, 8)
    assert ModelArch.from_hf_config(arch.to_hf_config()) == arch
    assert arch.to_hf_config().first_k_dense_replace == 1
    cfg = arch.to_transformer_config()
    assert cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_enable_expert_bias
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk, cfg.moe_router_topk_scaling_factor) == (
        3,
        2,
        1.5,
    )
    assert cfg.moe_router_bias_update_rate == 0.0 and cfg.moe_shared_expert_intermediate_size == 16
    model = build_model(arch)
    (router,) = branch_routers(model)
    assert isinstance(router.expert_bias, torch.nn.Parameter) and not router.expert_bias.requires_grad
    assert router.expert_bias.dtype == torch.float32 and router.layer_number == 2
    assert set(dict(model.named_parameters())) == set(mcore_names(arch))
    keys = {sh.key for sh in model.sharded_state_dict().values() if not sh.key.endswith("_extra_state")}
    assert keys == set(sharded_keys(arch))


@pytest.mark.parametrize(
    "change,words",
    [
        ({"norm_topk_prob": False}, "norm_topk_prob=False with num_experts_per_tok=4"),
        ({"topk_group": 1}, "HF ranks groups by their top-2 scores"),
        ({"n_group": 5}, "n_group=5"),
        ({"n_shared_experts": 0}, "n_shared_experts=0"),
        ({"first_k_dense_replace": 2}, "first_k_dense_replace=2 leaves no MoE layer"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}, "rope scaling 'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_refusals_are_one_line(change: dict, words: str) -> None:
    d = dict(tiny_hf_config("glm4_moe").to_dict(), **change)
    with pytest.raises(UserError, match=words) as e:
        ModelArch.from_hf_config(d)
    assert "\n" not in str(e.value)


def test_one_group_and_no_qk_norm_map_too() -> None:
    """GLM-4.5-Air's shape of router: one group (no group limit), no q/k norm, no scaling."""
    cfg = tiny_hf_config("glm4_moe", moe={"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0})
    d = dict(cfg.to_dict(), use_qk_norm=False, attention_bias=False)
    arch = ModelArch.from_hf_config(d)
    assert (arch.qk_norm, arch.qkv_bias, arch.moe_num_groups) == (False, False, 1)
    cfg = arch.to_transformer_config()
    assert cfg.moe_router_num_groups is None and cfg.moe_router_topk_scaling_factor is None
    assert ModelArch.from_hf_config(arch.to_hf_config()) == arch


# --- conversion ---------------------------------------------------------------------------------------------------
def test_round_trip_is_bit_exact_and_logits_match() -> None:
    hf = glm_hf(dtype=torch.float32, exact=False)  # HF's own float32 router
    sd = hf_state(hf)
    assert any(k.endswith("e_score_correction_bias") for k in sd)
    assert_round_trip_and_logits(hf, sd)


def test_files_round_trip_and_verify(tmp_path: Path) -> None:
    arch, _, cfg = files_round_trip(glm_hf(seed=1, dtype=torch.float32, exact=False), tmp_path)
    assert arch["family"] == "glm4_moe" and arch["moe_layer_pattern"] == [0, 1]
    assert cfg["architectures"] == ["Glm4MoeForCausalLM"] and cfg["first_k_dense_replace"] == 1
    assert (cfg["n_group"], cfg["topk_group"], cfg["routed_scaling_factor"]) == (3, 2, 1.5)


# --- the policy gradient ------------------------------------------------------------------------------------------
def _tree_rollouts() -> list:
    return random_tree_rollouts(prompt_len=7, branches=3, levels=2, seed=202)


def _schedule_grads(model, arch, rollouts, schedule: str, **opts) -> dict:  # noqa: ANN001
    tree = PrefixTree.build(rollouts, vocab_size=37)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rollouts], tree.num_response_tokens_logical())
    model.zero_grad(set_to_none=True)
    run_schedule(
        schedule,
        model,
        tree,
        obj,
        ScheduleOptions(vocab_size=37, branch_micro_batch=2, **{"chunk_tokens": None, **opts}),
    )
    return mcore_to_hf_state(gather_full_grads(model, None), arch)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_every_exact_schedule_matches_hf(dtype: torch.dtype) -> None:
    hf = glm_hf(dtype=dtype)
    arch, model = megatron_of(hf, dtype)
    rollouts = _tree_rollouts()
    _, want = hf_policy_gradient(hf, rollouts)
    got = {s: _schedule_grads(model, arch, rollouts, s) for s in EXACT}
    for schedule, grads in got.items():
        assert set(want) <= set(grads)  # + the frozen correction biases (no gradient)
        worst = _worst(grads, want)
        assert worst[0] <= TOL[dtype], (schedule, worst)
        print(f"{schedule} {dtype}: worst vs HF {worst[0]:.1e} ({worst[1]})")
    for schedule in EXACT[1:]:  # the schedules among themselves: a shared token's float64 logits may round to
        # float32 otherwise than a rollout's own copy of it (a last-bit difference), so the same bound
        worst = _worst(got[schedule], got["naive"])
        print(f"{schedule} {dtype}: worst vs naive {worst[0]:.1e}")
        assert worst[0] <= TOL[dtype], schedule


# --- planted bugs: each breaks the gradient against HF --------------------------------------------------------------
def _plant_routing(monkeypatch: pytest.MonkeyPatch, planted) -> None:  # noqa: ANN001
    """Replace megatron's top-k routing (what the schedules' router context calls) by `planted(real, ...)`."""
    from megatron.core.transformer.moe import moe_utils

    real = moe_utils.topk_routing_with_score_function
    monkeypatch.setattr(
        moe_utils, "topk_routing_with_score_function", lambda *a, **kw: planted(real, *a, **kw)
    )


def _bias_ignored(monkeypatch: pytest.MonkeyPatch, model) -> None:  # noqa: ANN001
    _plant_routing(monkeypatch, lambda real, *a, **kw: real(*a, **{**kw, "expert_bias": None}))


def _bias_in_weights(monkeypatch: pytest.MonkeyPatch, model) -> None:  # noqa: ANN001
    def planted(real, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        probs, routing_map = real(*a, **kw)
        return probs + (kw["expert_bias"] * routing_map).to(probs.dtype), routing_map

    _plant_routing(monkeypatch, planted)


def _group_limit_ignored(monkeypatch: pytest.MonkeyPatch, model) -> None:  # noqa: ANN001
    for r in branch_routers(model):
        monkeypatch.setattr(r.config, "moe_router_group_topk", None)
        monkeypatch.setattr(r.config, "moe_router_num_groups", None)


@pytest.mark.parametrize("plant", [_bias_ignored, _bias_in_weights, _group_limit_ignored])
def test_planted_router_bugs_fail(plant, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    hf = glm_hf()
    arch, model = megatron_of(hf, torch.float64)
    rollouts = _tree_rollouts()
    _, want = hf_policy_gradient(hf, rollouts)
    assert _worst(_schedule_grads(model, arch, rollouts, "replay"), want)[0] <= FP64_SIGMOID_BOUND
    plant(monkeypatch, model)
    assert _worst(_schedule_grads(model, arch, rollouts, "replay"), want)[0] > 1e-3


def test_router_losses_by_multiplicity_replay_equals_packed_equals_naive() -> None:
    """aux + seq-aux + z losses on megatron's sigmoid scores (compute_routing_scores_for_aux_loss), weighted by
    multiplicity: the tree schedules equal naive (float64, the sigmoid bound), and the losses do move the gradient."""
    from megatron_branch.losses.router import RouterLossConfig

    hf = glm_hf()
    arch, model = megatron_of(hf, torch.float64)
    rollouts = _tree_rollouts()
    losses = RouterLossConfig(aux_loss_coeff=0.3, seq_aux_loss_coeff=0.2, z_loss_coeff=0.05)
    got = {
        s: _schedule_grads(model, arch, rollouts, s, moe=MoEOptions(losses=losses))
        for s in ("naive", "packed", "replay")
    }
    for s in ("packed", "replay"):
        assert _worst(got[s], got["naive"])[0] <= FP64_SIGMOID_BOUND, s
    assert _worst(got["naive"], _schedule_grads(model, arch, rollouts, "naive"))[0] > 1e-3


def test_a_checkpoint_with_its_mtp_layer_is_refused_in_one_line() -> None:
    """The published checkpoints store the multi-token-prediction layer as model.layers.{num_hidden_layers}.*;
    it is not part of the policy and not converted: refused by name (not silently dropped, not half-read)."""
    from megatron_branch.checkpoint.param_map import check_hf_names

    hf = glm_hf(dtype=torch.float32, exact=False)
    arch = ModelArch.from_hf_config(hf.config)
    names = list(hf_state(hf)) + ["model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight"]
    with pytest.raises(
        UserError, match="unexpected tensor 'model.layers.2.eh_proj.weight' \\(and 1 more\\)"
    ) as e:
        check_hf_names(names, arch)
    assert "\n" not in str(e.value)
