"""Nemotron-H / Nemotron 3 MoE layers ("E": transformers' NemotronHMoE) on megatron's MoELayer beside Mamba-2,
attention and MLP layers (models/families/nemotron_h.py): the DeepSeek-style sigmoid router (the correction bias
in the choice only, group-limited top-k, renormalised, scaled: GLM-4.5's megatron settings), ungated relu2 experts
and shared expert. Mapping and refusals, bit-exact conversion, logits, every exact schedule's policy gradient
against Hugging Face on the fork-heavy tree of the Mamba tests, the sampler against HF `generate`, and planted bugs
(the bias ignored in the top-k, the group limit ignored, a fork's SSM state dropped) that each fail. TP2+SP and EP2
(world 2): tests/distributed/test_nemotron_h_tp.py.

Bound: 1e-5 relative per parameter for float32 AND float64 (tests/unit/test_nemotron_h.py: transformers' SSD scan,
the reference and the CPU path, is float32 inside whatever the dtype; megatron's sigmoid scores are float32 too,
tests/unit/test_glm4_moe.py). The float64 oracle's norms and router compute in float64 (testing.exact_hf_*).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import pytest
import torch
from conversion_helpers import files_round_trip
from gdn_helpers import rollouts
from test_gdn_replay import rel, step
from test_glm4_moe import _bias_ignored, _group_limit_ignored, with_random_biases
from test_nemotron_h import BOUND, hf_grads, megatron_of, plant_start_bug
from torch.utils.checkpoint import CheckpointError

from megatron_branch.checkpoint import gather_full_state, mcore_to_hf_state
from megatron_branch.checkpoint.param_map import hf_shapes, mcore_names, sharded_keys
from megatron_branch.errors import UserError
from megatron_branch.models import ModelArch, build_model, layer_checkpoint
from megatron_branch.models.moe import branch_routers
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.testing import hf_state, tiny_hf_config

PATTERN = "ME*E-M"
"""Mamba, MoE, attention, MoE, MLP, Mamba: every layer kind, an "E" layer between Mamba layers."""
FULL = {"branch_micro_batch": 2, "recompute": True, "recompute_layers": True}
"""The planner's `recompute full`: segment recompute and every layer checkpointed."""


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def nemotron_moe_config(**moe: Any) -> Any:
    return tiny_hf_config("nemotron_h", num_layers=len(PATTERN), ffn=48, layer_types=PATTERN, moe=moe or None)


def nemotron_moe(dtype: torch.dtype = torch.float32, *, seed: int = 5, exact: bool = True) -> Any:
    """The tiny model with random correction biases large enough to change the choice; `exact`: HF's norms and
    router in the model's dtype (the float64 oracle)."""
    return with_random_biases(nemotron_moe_config(), seed=seed, dtype=dtype, exact=exact)


def worst_vs_hf(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The worst relative error over HF's parameters; megatron's extra tensors are the frozen correction biases
    (HF's buffers), whose gradient is zero."""
    extra = set(got) - set(want)
    assert set(want) <= set(got) and extra and all(n.endswith("e_score_correction_bias") for n in extra)
    assert not any(got[n].any() for n in extra)
    return max((rel(got[n], w), n) for n, w in want.items())


# --- mapping --------------------------------------------------------------------------------------------------------
def test_mapping_round_trips_and_builds_megatrons_sigmoid_router() -> None:
    arch = ModelArch.from_hf_config(nemotron_moe_config())
    assert (arch.hybrid_override_pattern, arch.moe_layer_pattern) == (PATTERN, (0, 1, 0, 1, 0, 0))
    assert (arch.num_experts, arch.moe_top_k, arch.moe_num_groups, arch.moe_group_topk) == (12, 4, 4, 2)
    assert (arch.moe_ffn_hidden_size, arch.shared_expert_ffn_hidden_size, arch.shared_expert_gate) == (
        16,
        24,
        False,
    )
    assert (arch.moe_score_function, arch.moe_expert_bias, arch.moe_routed_scaling_factor) == (
        "sigmoid",
        True,
        2.5,
    )
    assert ModelArch.from_hf_config(arch.to_hf_config()) == arch
    with pytest.raises(ValueError, match="is not the 'E' layers of ME\\*E-M"):
        dataclasses.replace(arch, moe_layer_pattern=(0, 1, 0, 0, 1, 0))
    with pytest.raises(ValueError, match="has MoE layers \\('E'\\) but num_experts is 0"):
        dataclasses.replace(arch, num_experts=0, moe_layer_pattern=None, shared_expert_ffn_hidden_size=0)
    cfg = arch.to_transformer_config()
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk, cfg.moe_router_topk_scaling_factor) == (
        4,
        2,
        2.5,
    )
    assert cfg.moe_router_enable_expert_bias and not cfg.gated_linear_unit  # relu2 experts, no gate
    model = build_model(arch)
    routers = branch_routers(model)
    assert [r.layer_number for r in routers] == [2, 4]  # the "E" layers (1-based)
    assert all(
        isinstance(r.expert_bias, torch.nn.Parameter) and not r.expert_bias.requires_grad for r in routers
    )
    assert set(dict(model.named_parameters())) == set(mcore_names(arch))
    keys = {sh.key for sh in model.sharded_state_dict().values() if not sh.key.endswith("_extra_state")}
    assert keys == set(sharded_keys(arch))


@pytest.mark.parametrize(
    "change,words",
    [
        ({"moe_latent_size": 8}, "moe_latent_size=8 \\(the latent MoE\\) is not supported"),
        ({"norm_topk_prob": False}, "norm_topk_prob=False with num_experts_per_tok=4"),
        ({"topk_group": 1}, "HF ranks groups by their top-2 scores"),
        ({"layers_block_type": ["linear_attention", "cross", "full_attention"]}, "layer kind '\\?'"),
    ],
)
def test_refusals_are_one_line(change: dict, words: str) -> None:
    d = dict(nemotron_moe_config().to_dict(), **change)
    with pytest.raises(UserError, match=words) as e:
        ModelArch.from_hf_config(d)
    assert "\n" not in str(e.value) and "config.json" in str(e.value)


# --- conversion and the forward ---------------------------------------------------------------------------------------
def test_round_trip_is_bit_exact_and_logits_match_hf() -> None:
    hf = nemotron_moe(torch.float32, seed=3, exact=False)  # HF's own float32 router
    arch, model = megatron_of(hf, torch.float32)
    want = hf_state(hf)
    assert any(k.endswith("mixer.gate.e_score_correction_bias") for k in want)
    assert {n: tuple(t.shape) for n, t in want.items()} == hf_shapes(arch)
    back = mcore_to_hf_state(gather_full_state(model, None), arch)
    assert back.keys() == want.keys()
    assert all(torch.equal(back[n], want[n]) and back[n].dtype == want[n].dtype for n in want)
    ids = torch.randint(0, 37, (30,), generator=torch.Generator().manual_seed(2))
    mask = torch.triu(torch.ones(30, 30, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        got = model(ids[None], torch.arange(30)[None], mask)[0][:, :37]
    assert (got - ref).abs().max() <= 1e-6 * ref.abs().max()


def test_files_round_trip_and_verify(tmp_path: Any) -> None:
    """save_pretrained (one tensor per expert, `backbone.` names) -> convert -> verify-conversion -> export: every
    tensor bit-exact, the export's config the same layers and router."""
    arch, _, cfg = files_round_trip(nemotron_moe(torch.float32, seed=1, exact=False), tmp_path)
    assert arch["hybrid_override_pattern"] == PATTERN and arch["moe_layer_pattern"] == [0, 1, 0, 1, 0, 0]
    assert cfg["architectures"] == ["NemotronHForCausalLM"] and cfg["n_routed_experts"] == 12
    assert (cfg["n_group"], cfg["topk_group"], cfg["routed_scaling_factor"]) == (4, 2, 2.5)


# --- the policy gradient ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp64() -> Any:
    hf = nemotron_moe(torch.float64)
    arch, model = megatron_of(hf, torch.float64)
    rs = rollouts()
    return arch, model, rs, hf_grads(hf, rs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_every_exact_schedule_matches_hf(dtype: torch.dtype, fp64: Any) -> None:
    if dtype == torch.float64:
        arch, model, rs, want = fp64
    else:
        hf = nemotron_moe(torch.float32)
        arch, model = megatron_of(hf, torch.float32)
        rs = rollouts()
        want = hf_grads(hf, rs)
    cases = {
        "naive": ("naive", {}),
        "replay": ("replay", {"branch_micro_batch": 2}),
        "packed": ("packed", {}),
        "replay-full": ("replay", FULL),
    }
    got = {}
    for case, (schedule, kw) in cases.items():
        _, got[case] = step(model, arch, schedule, rs, **kw)
        err, name = worst_vs_hf(got[case], want)
        assert err <= BOUND, (case, dtype, err, name)
    # per-layer checkpointing rebuilds every layer, the MoE and MLP ones included (models/layer_checkpoint.py), and
    # changes nothing: the same float32 scan, the same routing
    tol = 1e-9 if dtype == torch.float64 else BOUND
    assert max(rel(got["replay-full"][n], g) for n, g in got["replay"].items()) <= tol


def _state_dropped(monkeypatch: pytest.MonkeyPatch, model: Any) -> None:
    plant_start_bug(monkeypatch, "zero_parent_state")


@pytest.mark.parametrize("plant", [_bias_ignored, _group_limit_ignored, _state_dropped])
def test_planted_bugs_fail(plant: Any, fp64: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The correction bias ignored in the top-k, the group limit ignored, a fork's SSM state not handed down:
    each far beyond the bound (checked within it first, unplanted)."""
    arch, model, rs, want = fp64
    plant(monkeypatch, model)
    _, grads = step(model, arch, "replay", rs, branch_micro_batch=1)
    err, name = worst_vs_hf(grads, want)
    assert err > 100 * BOUND, (plant.__name__, err, name)


def test_router_losses_by_multiplicity_replay_equals_packed_equals_naive(fp64: Any) -> None:
    """aux + seq-aux + z losses on megatron's sigmoid scores, weighted by multiplicity: the tree schedules equal
    naive, and the losses do move the gradient."""
    from megatron_branch.losses.router import MoEOptions, RouterLossConfig

    arch, model, rs, _ = fp64
    moe = MoEOptions(losses=RouterLossConfig(aux_loss_coeff=0.3, seq_aux_loss_coeff=0.2, z_loss_coeff=0.05))
    got = {s: step(model, arch, s, rs, moe=moe)[1] for s in ("naive", "packed", "replay")}
    # the checkpointed MoE layers' recomputation routes with the router context re-attached (the losses' weights)
    got["replay-full"] = step(model, arch, "replay", rs, moe=moe, **FULL)[1]
    for s in ("packed", "replay", "replay-full"):
        assert max(rel(got[s][n], g) for n, g in got["naive"].items()) <= BOUND, s
    plain = step(model, arch, "naive", rs)[1]
    assert max(rel(got["naive"][n], g) for n, g in plain.items() if g.any()) > 1e-3


def test_planted_recompute_without_the_router_context_fails(
    fp64: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An "E" layer's recomputation without its router context re-attached (models/layer_checkpoint.py) routes
    otherwise than its forward: torch's checkpoint sees other tensors saved and the step fails, not trains wrong."""
    from megatron_branch.losses.router import MoEOptions, RouterLossConfig

    arch, model, rs, _ = fp64
    moe = MoEOptions(losses=RouterLossConfig(aux_loss_coeff=0.3))
    monkeypatch.setattr(layer_checkpoint, "attached_to_layer", lambda layer, ctx: contextlib.nullcontext())
    with pytest.raises(CheckpointError):
        step(model, arch, "replay", rs, moe=moe, **FULL)


# --- the sampler ------------------------------------------------------------------------------------------------------
def test_sampler_greedy_equals_hf_generate_and_tree_logprobs_the_training_forward() -> None:
    """Greedy tokens through the Mamba states and the routed experts == HF `generate`. The tiny config's eos (2)
    is no stop token for the sampler: HF's min_new_tokens would mask it out of HF's greedy choice (this model's
    greedy path does reach token 2), so HF generates without one. Tree-sampled logprobs (forks after 2 and 4
    tokens) == the training forward (replay and naive) at the bound."""
    from sampler_helpers import assert_greedy_equals_hf_generate, tree_sample, tree_sampling_error

    hf = nemotron_moe(torch.float32, seed=8, exact=False)
    _, model = megatron_of(hf, torch.float32)
    hf.generation_config.eos_token_id = None
    assert_greedy_equals_hf_generate(hf, model.eval())
    assert tree_sampling_error(model, tree_sample(model)) <= BOUND
