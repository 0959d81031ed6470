"""The drop-in get_forward_backward_func and `megatron_branch.patched()` (single process).

TP2 parity is in tests/distributed/test_integration_tp.py.
"""

from __future__ import annotations

import pytest
import torch
from dropin_helpers import (
    VOCAB,
    build_patched_gpt,
    dropin_step,
    megatron_naive_step,
    reduce_like_megatron,
    tiny_arch,
)
from megatron.core.models.gpt import gpt_layer_specs, gpt_model
from megatron.core.transformer.spec_utils import ModuleSpec

import megatron_branch
import megatron_branch.integration.patching as patching
from megatron_branch.attention.core_attention import BranchCoreAttention
from megatron_branch.errors import UserError
from megatron_branch.integration import BranchForwardBackward
from megatron_branch.models.rotary import PositionRotaryEmbedding
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.testing import random_tree_rollouts


@pytest.fixture(autouse=True)
def _single_rank() -> None:
    initialize_parallel(ParallelConfig())


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("schedule", ["replay", "packed"])
def test_dropin_matches_megatrons_own_naive_step(schedule: str) -> None:
    rollouts = random_tree_rollouts(vocab_size=VOCAB, groups=2, prompt_len=9, branches=3, levels=2, seed=3)
    model = build_patched_gpt(tiny_arch())
    ref_losses = megatron_naive_step(model, rollouts)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    losses = dropin_step(model, rollouts, schedule)
    got = grads(model)
    assert len(losses) == len(ref_losses) // 2 + len(ref_losses) % 2  # one dict per micro-batch
    # megatron's reduction of the per-micro-batch dicts: the reference sums the rollouts' terms, ours is the total
    ref_total = sum(float(d["lm loss"][0]) for d in ref_losses)
    assert reduce_like_megatron(losses) == pytest.approx(ref_total, rel=1e-5)
    assert ref.keys() == got.keys() and ref
    for name in ref:
        err = ((got[name] - ref[name]).norm() / ref[name].norm()).item()
        assert err <= 1e-5, f"{schedule} {name}: {err:.2e}"


def test_dropin_loss_mask_matches_megatrons_masked_step() -> None:
    """Rollouts with loss_mask (context tokens inside responses), given as dicts: the drop-in equals megatron's own
    schedule with the mask in its loss_func (T = trained tokens of the step)."""
    import dataclasses
    import random

    rng = random.Random(7)
    rollouts = [
        dataclasses.replace(r, loss_mask=[int(rng.random() > 0.4) for _ in r.response[:-1]] + [1])
        for r in random_tree_rollouts(vocab_size=VOCAB, groups=2, prompt_len=9, branches=3, levels=2, seed=5)
    ]
    assert any(r.loss_mask is not None for r in rollouts)
    model = build_patched_gpt(tiny_arch())
    ref_total = sum(float(d["lm loss"][0]) for d in megatron_naive_step(model, rollouts))
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    as_dicts = [
        {
            "prompt": list(r.prompt),
            "response": list(r.response),
            "advantage": r.advantage,
            "loss_mask": list(r.loss_mask or [1] * len(r.response)),
        }  # fmt: skip
        for r in rollouts
    ]
    losses = dropin_step(model, as_dicts, "replay")  # type: ignore[arg-type]
    assert reduce_like_megatron(losses) == pytest.approx(ref_total, rel=1e-5)
    got = grads(model)
    for name in ref:
        assert ((got[name] - ref[name]).norm() / ref[name].norm()).item() <= 1e-5, name


def test_dropin_forward_only_runs_no_backward() -> None:
    rollouts = random_tree_rollouts(vocab_size=VOCAB, prompt_len=9, branches=3, seed=4)
    model = build_patched_gpt(tiny_arch())
    model.zero_grad(set_to_none=True)
    losses = dropin_step(model, rollouts)
    model.zero_grad(set_to_none=True)
    fb = megatron_branch.integration.get_forward_backward_func(vocab_size=VOCAB)
    fwd = fb(forward_step_func=None, data_iterator=iter([rollouts]), model=model, num_microbatches=1,
             seq_length=0, micro_batch_size=1, forward_only=True)  # fmt: skip
    assert all(p.grad is None for p in model.parameters())
    assert reduce_like_megatron(fwd) == pytest.approx(reduce_like_megatron(losses), rel=1e-6)


def test_dropin_bad_input_is_a_user_error() -> None:
    model = build_patched_gpt(tiny_arch())
    fb = megatron_branch.integration.get_forward_backward_func(vocab_size=VOCAB)
    with pytest.raises(UserError, match="ran out after 1 of 2"):
        fb(forward_step_func=None, data_iterator=iter([[{"prompt": [1], "response": [2], "advantage": 1.0}]]),
           model=model, num_microbatches=2, seq_length=0, micro_batch_size=1)  # fmt: skip
    with pytest.raises(UserError, match="lacks field 'response'"):
        fb(forward_step_func=None, data_iterator=iter([[{"prompt": [1]}]]), model=model, num_microbatches=1,
           seq_length=0, micro_batch_size=1)  # fmt: skip
    with pytest.raises(UserError, match="pipeline"):
        megatron_branch.integration.get_forward_backward_func(pp_size=2, vp_size=2)


# --- patched() ----------------------------------------------------------------------------------------------------
def _state() -> dict[str, object]:
    import megatron.core.pipeline_parallel as pp
    import megatron.core.pipeline_parallel.schedules as schedules

    return {
        "local": vars(gpt_layer_specs)["get_gpt_layer_local_spec"],
        "te": vars(gpt_layer_specs)["get_gpt_layer_with_transformer_engine_spec"],
        "pp": pp.get_forward_backward_func,
        "schedules": schedules.get_forward_backward_func,
        "init": vars(gpt_model.GPTModel)["__init__"],
    }


def test_patched_patches_and_restores_everything() -> None:
    import megatron.core.pipeline_parallel as pp

    before = _state()
    with megatron_branch.patched(schedule="packed", vocab_size=VOCAB):
        assert all(_state()[k] is not v for k, v in before.items())
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
        assert spec.submodules.self_attention.submodules.core_attention is BranchCoreAttention
        fb = pp.get_forward_backward_func()
        assert isinstance(fb, BranchForwardBackward) and fb.schedule == "packed"
        model = build_patched_gpt(tiny_arch())  # GPTModel.__init__ is patched: RoPE follows position ids
        assert isinstance(model.rotary_pos_emb, PositionRotaryEmbedding)
    assert _state() == before
    plain = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    assert plain.submodules.self_attention.submodules.core_attention is not BranchCoreAttention


def test_patched_restores_after_an_exception() -> None:
    before = _state()
    with pytest.raises(RuntimeError, match="boom"), megatron_branch.patched():
        raise RuntimeError("boom")
    assert _state() == before


def test_patched_refuses_an_untested_version_and_patches_nothing() -> None:
    before = _state()
    with pytest.raises(UserError) as e, megatron_branch.patched(version="0.99.0"):
        pytest.fail("the block must not run")
    msg = str(e.value)
    assert "0.99.0" in msg and "0.16.1" in msg and "\n" not in msg
    assert _state() == before
    assert patching.megatron_core_version() in patching.TESTED_MEGATRON_CORE


def test_patched_te_spec_gets_our_core_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """TE is not installed here: a stand-in with the TE spec's structure (megatron's gpt_layer_specs: the attention
    submodules linear_qkv=TELayerNormColumnParallelLinear, core_attention=TEDotProductAttention) is patched."""

    class TEDotProductAttention:  # stand-ins named like TE's
        pass

    class TELayerNormColumnParallelLinear:
        pass

    def fake_te_spec(**_: object) -> ModuleSpec:
        from megatron.core.transformer.attention import SelfAttentionSubmodules

        attn = ModuleSpec(
            module=object,
            submodules=SelfAttentionSubmodules(
                linear_qkv=TELayerNormColumnParallelLinear, core_attention=TEDotProductAttention
            ),
        )
        from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

        return ModuleSpec(module=object, submodules=TransformerLayerSubmodules(self_attention=attn))

    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", fake_te_spec)
    with megatron_branch.patched():
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    sub = spec.submodules.self_attention.submodules
    assert sub.core_attention is BranchCoreAttention
    assert sub.linear_qkv is TELayerNormColumnParallelLinear  # the fused norm + QKV stays TE's
    assert gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec is fake_te_spec
