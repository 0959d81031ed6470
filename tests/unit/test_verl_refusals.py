"""verl's engine path refuses the models it cannot run, in one line, before it changes anything: interleaved RoPE,
multimodal RoPE (a vision-language wrapper), a CP size a hybrid's gated delta net heads cannot split over, the MoE
settings not wired (rules.check_verl_model, read off the TransformerConfig verl built, by `refuse_unsupported`); and
`patch_verl_model` itself refuses a model it cannot patch without touching it, and makes a hybrid's GatedDeltaNet
layers branch-aware without changing a parameter. Needs no verl: these run before any of verl's code.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megatron_branch.errors import SettingError
from megatron_branch.integration.verl import VerlBranchError, refuse_unsupported
from megatron_branch.integration.verl_model import BranchFallbackAttention, patch_verl_model
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.rules import check_verl_model
from megatron_branch.testing import tiny_hf_config

ENGINE = SimpleNamespace(
    context_parallel_size=1,
    dynamic_context_parallel=False,
    pipeline_model_parallel_size=1,
    virtual_pipeline_model_parallel_size=None,
    expert_model_parallel_size=1,
    use_fused_kernels=False,
    use_remove_padding=True,
)
"""The fields of verl's McoreEngineConfig that refuse_unsupported reads, at values it accepts."""


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def _model(family: str, **kw: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelArch.from_hf_config(tiny_hf_config(family, **kw)))


def test_hybrid_runs_and_its_cp_split_is_checked() -> None:
    """A hybrid runs with the switch (tests/unit/test_verl_hybrid.py); under CP its gated delta net heads must split
    over the CP ranks (rules.check_gdn_context_parallel: 2 key / 4 value heads here, so CP 3 is refused)."""
    hybrid = _model("qwen3_5", layer_types=["linear_attention", "full_attention"])
    refuse_unsupported(ENGINE, hybrid.config)
    refuse_unsupported(SimpleNamespace(**{**vars(ENGINE), "context_parallel_size": 2}), hybrid.config)
    with pytest.raises(VerlBranchError, match=r"cannot split the hybrid's gated delta net heads") as e:
        refuse_unsupported(SimpleNamespace(**{**vars(ENGINE), "context_parallel_size": 3}), hybrid.config)
    assert "\n" not in str(e.value)
    refuse_unsupported(ENGINE, _model("qwen3").config)  # a dense model passes


@pytest.mark.parametrize(
    "setting, message",
    [
        (dict(position_embedding="mrope"), r"multimodal RoPE \(position_embedding_type=mrope"),
        (
            dict(attention_variant="dsa"),
            r"softmax attention layers only, not experimental_attention_variant=dsa",
        ),
        (dict(rotary_interleaved=True), r"interleaved RoPE \(rotary_interleaved=True\)"),
        (dict(moe_reason="token dropping"), r"cannot run this MoE model: token dropping"),
    ],
)
def test_rule_refuses_each_model_kind(setting: dict, message: str) -> None:
    with pytest.raises(SettingError, match=message) as e:
        check_verl_model(**setting)
    assert str(e.value).startswith("branch replay in verl's engine") and "\n" not in str(e.value)
    config = SimpleNamespace(
        calculate_per_token_loss=False,
        experimental_attention_variant=setting.get("attention_variant"),
        rotary_interleaved=setting.get("rotary_interleaved", False),
        position_embedding_type=setting.get("position_embedding", "rope"),
        num_moe_experts=8 if setting.get("moe_reason") else None,
        moe_router_load_balancing_type="aux_loss",
        moe_expert_capacity_factor=1.0,  # token dropping: the one MoE setting refused in this config
        moe_router_fusion=False,
    )
    with pytest.raises(VerlBranchError, match=message):  # the entry point reads each off the config
        refuse_unsupported(ENGINE, config)


def _moe_config(**kw: Any) -> SimpleNamespace:
    base = dict(
        calculate_per_token_loss=False,
        num_moe_experts=8,
        moe_router_load_balancing_type="none",
        moe_expert_capacity_factor=None,
        moe_router_enable_expert_bias=False,
        moe_router_fusion=False,
    )
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    "setting, message",
    [
        (
            dict(moe_router_load_balancing_type="global_aux_loss"),
            r"moe_router_load_balancing_type=global_aux_loss",
        ),
        (dict(moe_router_load_balancing_type=["aux_loss", "sinkhorn"]), r"=sinkhorn \(supported"),
        (dict(moe_expert_capacity_factor=1.25), r"token dropping \(moe_expert_capacity_factor\)"),
        (dict(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3), r"expert bias update"),
        (dict(moe_router_fusion=True), r"moe_router_fusion=True"),
    ],
)
def test_moe_settings_not_wired_are_refused(setting: dict, message: str) -> None:
    """A MoE model runs with the switch (verl's none / aux_loss / seq_aux_loss balancing, z-loss); what is not
    wired is refused in one line."""
    with pytest.raises(VerlBranchError, match=message) as e:
        refuse_unsupported(ENGINE, _moe_config(**setting))
    assert "\n" not in str(e.value)
    for ok in ("none", "aux_loss", "seq_aux_loss", ["aux_loss", "seq_aux_loss"]):
        refuse_unsupported(ENGINE, _moe_config(moe_router_load_balancing_type=ok))
    refuse_unsupported(ENGINE, _moe_config(multi_latent_attention=True, expert_model_parallel_size=2))  # runs


def test_patch_makes_gated_delta_nets_branch_aware() -> None:
    """megatron's GatedDeltaNet, as verl's bridge builds it, becomes BranchGatedDeltaNet in place: the same
    parameters (names and tensors), megatron's forward while no tree is attached; the attention layers keep a
    branch-aware core attention."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from megatron_branch.attention.core_attention import BranchCoreAttention
    from megatron_branch.models.gdn import BranchGatedDeltaNet

    hybrid = _model("qwen3_5", layer_types=["full_attention", "linear_attention"])
    gdn = hybrid.decoder.layers[1].self_attention
    gdn.__class__ = GatedDeltaNet  # what the bridge builds (build_model builds the branch-aware class)
    del gdn._head_blocks
    params = dict(hybrid.named_parameters())
    x = torch.randn(5, 1, hybrid.config.hidden_size)
    with torch.no_grad():
        before = gdn(x, None)[0]
    patch_verl_model(hybrid)
    assert type(gdn) is BranchGatedDeltaNet and gdn.context is None
    assert isinstance(hybrid.decoder.layers[0].self_attention.core_attention, BranchCoreAttention)
    assert dict(hybrid.named_parameters()).keys() == params.keys()
    assert all(p is params[n] for n, p in hybrid.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(gdn(x, None)[0], before, rtol=0, atol=0)
    patch_verl_model(hybrid)  # idempotent
    assert type(gdn) is BranchGatedDeltaNet


@pytest.mark.parametrize("mixer", ["Linear", "ForeignGatedDeltaNet"])
def test_patch_refuses_an_unknown_mixer_without_changing_it(mixer: str) -> None:
    """Before: an AttributeError traceback half-way through the layers. Now: one line, the model untouched. A
    GatedDeltaNet subclass from elsewhere is not swapped for ours (its forward would be dropped)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    hybrid = _model("qwen3_5", layer_types=["full_attention", "linear_attention"])  # a full layer comes first
    layer = hybrid.decoder.layers[1]
    if mixer == "Linear":  # neither attention nor a gated delta net
        layer.self_attention = torch.nn.Linear(2, 2)
    else:
        layer.self_attention.__class__ = type(mixer, (GatedDeltaNet,), {})
    before = [(name, type(m)) for name, m in hybrid.named_modules()]
    with pytest.raises(ValueError, match=rf"layer 2: {mixer} has no core attention") as e:
        patch_verl_model(hybrid)
    assert "\n" not in str(e.value)
    assert not any(isinstance(m, BranchFallbackAttention) for m in hybrid.modules())
    assert [(name, type(m)) for name, m in hybrid.named_modules()] == before


def test_context_parallel_runs_and_dynamic_cp_is_refused() -> None:
    """context_parallel_size > 1 runs the tree under megatron-branch's ring (tests/distributed/
    test_verl_engine_cp.py); dynamic_context_parallel (a CP group per micro-batch) is refused in one line."""
    refuse_unsupported(SimpleNamespace(**{**vars(ENGINE), "context_parallel_size": 2}))
    dynamic = SimpleNamespace(
        **{**vars(ENGINE), "context_parallel_size": 2, "dynamic_context_parallel": True}
    )
    with pytest.raises(VerlBranchError, match=r"does not support dynamic_context_parallel") as e:
        refuse_unsupported(dynamic)
    assert "\n" not in str(e.value)


def test_cp_loss_scaling_follows_megatrons_schedule() -> None:
    """verl_cp.scale_micro_batch_loss = megatron's forward_step_calc_loss: a 2-tuple times the CP size over the
    micro-batches (DDP averages over dp x cp), a per-token 3-tuple unscaled with its token count."""
    from megatron_branch.integration.verl_cp import scale_micro_batch_loss

    loss = torch.tensor(3.0)
    got, out, tokens = scale_micro_batch_loss(
        (loss, {"m": 1}), num_microbatches=4, cp_size=2, per_token_loss=False
    )
    assert float(got) == 3.0 * 2 / 4 and out == {"m": 1} and tokens is None
    got, _, tokens = scale_micro_batch_loss((loss, 6, {}), num_microbatches=4, cp_size=2, per_token_loss=True)
    assert float(got) == 3.0 and int(tokens) == 6
    got, _, tokens = scale_micro_batch_loss(
        (loss, 6, {}), num_microbatches=4, cp_size=2, per_token_loss=False
    )
    assert float(got) == 3.0 / 6 / 4 and tokens is None


@pytest.mark.parametrize(
    "engine, options, model, message",
    [
        (
            dict(virtual_pipeline_model_parallel_size=2),
            {},
            None,
            r"virtual_pipeline_model_parallel_size=2: interleaved \(virtual\) pipeline stages are not supported",
        ),
        ({}, dict(schedule="naive"), None, r"BranchOptions.schedule=naive has no pipeline parallelism"),
        ({}, {}, dict(num_layers=3), r"pipeline_model_parallel_size=2 does not divide the model's 3 layers"),
        (
            dict(expert_model_parallel_size=2),
            {},
            dict(moe=True),
            r"pipeline_model_parallel_size=2 with actor_rollout_ref.actor.megatron.expert_model_parallel_size=2: "
            r"expert parallelism under pipeline parallelism is not shown",
        ),
    ],
)
def test_pipeline_refusals_in_verls_names(
    engine: dict, options: dict, model: dict | None, message: str
) -> None:
    """PP2 runs (tests/distributed/test_verl_engine_pp.py); what the pipelined tree schedules cannot run is
    refused at engine start, one line in verl's names (integration/verl_pp.py)."""
    from megatron_branch.integration.verl import BranchOptions
    from megatron_branch.integration.verl_pp import refuse_pipeline

    config = SimpleNamespace(**{**vars(ENGINE), "pipeline_model_parallel_size": 2, **engine})
    kw: dict[str, Any] = {}
    tf_config = None
    if model is not None:
        tf_config = SimpleNamespace(
            num_layers=model.get("num_layers", 2), experimental_attention_variant=model.get("variant")
        )
        kw = dict(moe=model.get("moe", False))
    with pytest.raises(VerlBranchError, match=message) as e:
        refuse_pipeline(config, BranchOptions(**options), tf_config, **kw)
    assert str(e.value).startswith("branch replay in verl's engine: ") and "\n" not in str(e.value)


def test_pipeline_runs_a_moe_model_at_ep1_and_a_hybrid() -> None:
    """A mixture-of-experts policy at PP2 and EP1 is not refused (tests/distributed/test_verl_pp_moe.py runs it
    against verl's own PP path; the same at EP2 is, the case above), nor a gated-delta-net hybrid
    (tests/distributed/test_verl_hybrid_parallel.py)."""
    from megatron_branch.integration.verl import BranchOptions
    from megatron_branch.integration.verl_pp import refuse_pipeline

    config = SimpleNamespace(**{**vars(ENGINE), "pipeline_model_parallel_size": 2})
    tf_config = SimpleNamespace(num_layers=2, experimental_attention_variant=None)
    refuse_pipeline(config, BranchOptions(), tf_config, moe=True)
    hybrid = SimpleNamespace(num_layers=2, experimental_attention_variant="gated_delta_net")
    refuse_pipeline(config, BranchOptions(), hybrid)
    ok = SimpleNamespace(**{**vars(ENGINE), "pipeline_model_parallel_size": 2})
    # the default (auto) is checked as replay, with root pieces too
    for fine in (BranchOptions(), BranchOptions(schedule_options={"root_pieces": 4})):
        refuse_pipeline(ok, fine, SimpleNamespace(num_layers=2, experimental_attention_variant=None))
    refuse_pipeline(ENGINE, BranchOptions(schedule="naive"))  # no pipeline: nothing to refuse here
