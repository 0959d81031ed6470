"""Nemotron-H (transformers' nemotron_h): Mamba-2, attention and MLP layers per hybrid_override_pattern, megatron's
MambaMixer in a GPT layer (models/mamba.py), against HF; branch replay through the SSM state and conv tail.

Precision: transformers' SSD scan (the reference, and the CPU path here) computes in float32 whatever the model
dtype (its `hidden_states.float()`), in chunks of `chunk_size` (8 in the tiny model) that start at each segment's
first token in a tree schedule and at the rollout's in naive: the same math in a different float32 rounding.
Measured on test_gdn_replay's `rollouts()` (worst parameter, relative): tree schedules vs naive float32 <= 1.8e-6,
float64 <= 6.0e-7; naive vs HF float32 9.2e-7, float64 1.3e-6; logits vs HF <= 2.5e-7 of their max. Tested at
BOUND = 1e-5 (gradients) for both dtypes, as the gated delta net's (tests/unit/test_gdn_replay.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from gdn_helpers import rollouts
from test_gdn_replay import step, worst

from megatron_branch.checkpoint import (
    gather_full_state,
    hf_to_mcore_state,
    load_full_state,
    mcore_to_hf_state,
)
from megatron_branch.checkpoint.param_map import hf_shapes
from megatron_branch.compat import mamba as compat_mamba
from megatron_branch.compat.cpu import CompatError
from megatron_branch.errors import UserError
from megatron_branch.models import ModelArch, build_model
from megatron_branch.models.mamba import BranchMambaMixer
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.testing import hf_policy_gradient, hf_state, tiny_hf_config, tiny_hf_model

BOUND = 1e-5
START_BUGS = ("zero_parent_state", "drop_parent_tail")


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def nemotron(dtype: torch.dtype = torch.float32, seed: int = 5, **kw: Any) -> Any:
    """Layers M * - M - (Mamba, attention, MLP, Mamba, MLP); 4 Mamba heads in 2 groups, state 8, chunk 8."""
    return tiny_hf_model(tiny_hf_config("nemotron_h", num_layers=5, ffn=48, **kw), seed=seed, dtype=dtype)


def megatron_of(hf: Any, dtype: torch.dtype = torch.float32) -> tuple[ModelArch, torch.nn.Module]:
    arch = ModelArch.from_hf_config(hf.config)
    model = build_model(arch, dtype=dtype)
    state = hf_state(
        hf
    )  # the checkpoint's names and per-expert tensors (an "E" layer's: test_nemotron_h_moe.py)
    load_full_state(model, hf_to_mcore_state(state, arch, padded_vocab=arch.padded_vocab_size(1)), None)
    return arch, model


def hf_grads(hf: Any, rs: list) -> dict[str, torch.Tensor]:
    """HF's per-rollout gradient under the checkpoint's names (`backbone.`; `model.` in memory)."""
    _, grads = hf_policy_gradient(hf, rs)
    return {n.replace("model.", "backbone.", 1): g for n, g in grads.items()}


# --- the architecture ---------------------------------------------------------------------------------------------------
def test_config_maps_both_ways() -> None:
    arch = ModelArch.from_hf_config(tiny_hf_config("nemotron_h", num_layers=5, ffn=48))
    assert (arch.hybrid_override_pattern, arch.mlp_activation, arch.position_embedding) == (
        "M*-M-",
        "relu2",
        "none",
    )
    assert (arch.mamba_num_heads, arch.mamba_head_dim, arch.mamba_state_dim, arch.mamba_num_groups) == (
        4,
        8,
        8,
        2,
    )
    assert arch.mamba_dt_min == 0.001 and arch.rms_norm_eps == 1e-5
    assert ModelArch.from_hf_config(arch.to_hf_config()) == arch
    cfg = arch.to_transformer_config()
    assert not cfg.gated_linear_unit and cfg.activation_func(torch.tensor([-2.0, 3.0])).tolist() == [0.0, 9.0]
    assert (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_num_groups, cfg.mamba_state_dim) == (
        4,
        8,
        2,
        8,
    )
    # an older config.json: the pattern string (transformers reads it into layers_block_type)
    d = {k: v for k, v in arch.to_hf_config().to_dict().items() if k != "layers_block_type"}
    assert (
        ModelArch.from_hf_config({**d, "hybrid_override_pattern": "M-M*-"}).hybrid_override_pattern == "M-M*-"
    )


@pytest.mark.parametrize(
    "change,words",
    [
        ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_bias": True}, "use_bias"),
        ({"sliding_window": 16}, "sliding_window"),
        ({"n_groups": 3}, "not a multiple of n_groups"),
    ],
)
def test_refusals_are_one_line(change: dict, words: str) -> None:
    d = dict(tiny_hf_config("nemotron_h", num_layers=5).to_dict(), **change)
    with pytest.raises(UserError, match=words) as e:
        ModelArch.from_hf_config(d)
    assert "\n" not in str(e.value) and "config.json" in str(e.value)


def test_the_pattern_and_the_family_go_together() -> None:
    arch = ModelArch.from_hf_config(tiny_hf_config("nemotron_h", num_layers=5, ffn=48))
    with pytest.raises(ValueError, match="family nemotron_h needs hybrid_override_pattern"):
        dataclasses.replace(arch, hybrid_override_pattern=None)
    with pytest.raises(ValueError, match="needs a Mamba hybrid family"):
        dataclasses.replace(arch, family="llama")


def test_tensor_parallel_must_split_the_mamba_groups() -> None:
    arch = ModelArch.from_hf_config(tiny_hf_config("nemotron_h", num_layers=5, heads=8, kv_heads=8, ffn=48))
    arch.check_tensor_parallel(2)
    with pytest.raises(UserError, match="does not divide mamba_num_groups=2"):
        arch.check_tensor_parallel(4)


# --- the model against HF -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_logits_match_hf(dtype: torch.dtype) -> None:
    """30 tokens: four of the scan's 8-position chunks, the attention layer without RoPE, relu2 MLPs."""
    hf = nemotron(dtype, seed=1)
    _, model = megatron_of(hf, dtype)
    ids = torch.randint(0, 37, (30,), generator=torch.Generator().manual_seed(2))
    mask = torch.triu(torch.ones(30, 30, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        got = model(ids[None], torch.arange(30)[None], mask)[0][:, :37]
    assert (got - ref).abs().max() <= 1e-6 * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_conversion_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    hf = nemotron(dtype, seed=3)
    arch, model = megatron_of(hf, dtype)
    want = hf_state(hf)  # the checkpoint's names: `backbone.` (megatron_of read the in-memory `model.` names)
    assert {n: tuple(t.shape) for n, t in want.items()} == hf_shapes(arch)
    back = mcore_to_hf_state(gather_full_state(model, None), arch)
    assert back.keys() == want.keys()
    assert all(torch.equal(back[n], want[n]) and back[n].dtype == want[n].dtype for n in want)
    mc = hf_to_mcore_state(want, arch, padded_vocab=arch.padded_vocab_size(1))
    assert all(torch.equal(t, gather_full_state(model, None)[n]) for n, t in mc.items())


def test_the_shims_are_needed_and_guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without mamba_ssm megatron's MambaMixer refuses to build (the flag compat/mamba.py sets); a flag megatron
    renames is a CompatError, not a silent no-op."""
    from megatron.core.ssm import mamba_mixer

    arch = ModelArch.from_hf_config(tiny_hf_config("nemotron_h", num_layers=5, ffn=48))
    build_model(arch)  # applies the shims
    monkeypatch.setattr(mamba_mixer, "HAVE_MAMBA_SSM", False)
    with pytest.raises(ImportError, match="MambaSSM"):
        build_model(arch)
    monkeypatch.delattr(mamba_mixer, "HAVE_EINOPS")
    with pytest.raises(CompatError, match="HAVE_EINOPS"):
        compat_mamba._shim_no_einops()


# --- branch replay through the SSM state and conv tail -----------------------------------------------------------------
@pytest.fixture(scope="module")
def fp32() -> Any:
    hf = nemotron(torch.float32)
    arch, model = megatron_of(hf, torch.float32)
    rs = rollouts()
    return hf, arch, model, rs, step(model, arch, "naive", rs)


def test_naive_matches_hf_per_parameter(fp32: Any) -> None:
    hf, _, _, rs, (_, naive) = fp32
    err, name = worst(naive, hf_grads(hf, rs))
    assert err <= BOUND, (err, name)


@pytest.mark.parametrize(
    "schedule,kw",
    [
        ("replay", {}),
        ("packed", {}),
        ("replay", {"branch_micro_batch": 1}),
        ("replay", {"recompute": True, "recompute_layers": True}),
        ("replay", {"chunk_tokens": 12}),
    ],
    ids=["replay", "packed", "replay-mb1", "replay-recompute", "replay-chunk-tokens"],
)
def test_tree_schedules_equal_naive_fp32(fp32: Any, schedule: str, kw: dict) -> None:
    _, arch, model, rs, (naive_res, naive) = fp32
    res, grads = step(model, arch, schedule, rs, **kw)
    err, name = worst(grads, naive)
    assert err <= BOUND, (schedule, err, name)
    assert abs(res.loss - naive_res.loss) <= BOUND * abs(naive_res.loss)


def test_fp64_replay_matches_naive_and_hf() -> None:
    hf = nemotron(torch.float64)
    arch, model = megatron_of(hf, torch.float64)
    rs = rollouts()
    _, naive = step(model, arch, "naive", rs)
    _, grads = step(model, arch, "replay", rs)
    assert worst(grads, naive)[0] <= BOUND
    assert worst(grads, hf_grads(hf, rs))[0] <= BOUND


def plant_start_bug(monkeypatch: pytest.MonkeyPatch, bug: str) -> None:
    """Break `BranchMambaMixer._start` for every segment with a parent (in the chunk, cached, or a decode row):
    zero_parent_state starts it from a zero SSM state, drop_parent_tail without its parent's conv inputs."""
    assert bug in START_BUGS, bug
    original = BranchMambaMixer._start

    def planted(self: BranchMambaMixer, parent: int | None, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        S, tail = original(self, parent, *args)
        if parent is None:
            return S, tail
        return (torch.zeros_like(S), tail) if bug == "zero_parent_state" else (S, torch.zeros_like(tail))

    monkeypatch.setattr(BranchMambaMixer, "_start", planted)


@pytest.mark.parametrize("bug", START_BUGS)
def test_planted_state_bugs_fail(fp32: Any, bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child starting from a zero SSM state, or without its parent's conv inputs: far beyond rounding."""
    _, arch, model, rs, (_, naive) = fp32
    plant_start_bug(monkeypatch, bug)
    _, grads = step(model, arch, "replay", rs, branch_micro_batch=1)
    err, name = worst(grads, naive)
    assert err > 100 * BOUND, (bug, err, name)


def test_an_unsplittable_cp_size_and_non_recurrent_schedules_are_refused_in_one_line() -> None:
    from megatron_branch.errors import SettingError
    from megatron_branch.models.arch import check_schedule_supports

    arch = ModelArch.from_hf_config(tiny_hf_config("nemotron_h", num_layers=5, ffn=48))
    check_schedule_supports(arch, "replay", cp=1)
    check_schedule_supports(arch, "replay", cp=2)  # the head exchange (tests/unit/test_mamba_heads.py)
    for schedule, cp, words in (("replay", 3, "--cp 3 cannot split the Mamba-2 heads"),
                                ("replay-stopgrad", 1, "cannot run a hybrid model (nemotron_h, 2 of 5 layers")):  # fmt: skip
        with pytest.raises(SettingError) as e:
            check_schedule_supports(arch, schedule, cp=cp)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
