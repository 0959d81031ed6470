"""DeepSeek-V3 (`deepseek_v3`, models/families/deepseek_v3.py): multi-latent attention on megatron-core's
MLASelfAttention (models/mla.py) with the DeepSeek MoE block (glm4_moe's router, reused). Mapping and refusals,
q_lora_rank set and None, bit-exact conversion (in memory and through files, verify-conversion), the policy
gradient of every exact schedule against Hugging Face on a fork-heavy tree, and planted bugs that each fail: MLA's
RoPE positions restarting at 0 on a branch, the correction bias ignored in the top-k.

Bounds (glm4_moe's, test_glm4_moe.py): the router's scores are float32 in megatron whatever the dtype, so float64
is held at FP64_SIGMOID_BOUND; float32 at 1e-5 relative.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conversion_helpers import assert_round_trip_and_logits, files_round_trip
from test_glm4_moe import (
    EXACT,
    FP64_SIGMOID_BOUND,
    TOL,
    _bias_ignored,
    _schedule_grads,
    _worst,
    megatron_of,
    with_random_biases,
)

from megatron_branch.checkpoint.param_map import check_hf_names, mcore_names, sharded_keys
from megatron_branch.errors import UserError
from megatron_branch.models import ModelArch, build_model
from megatron_branch.models.mla_latent import MLA_LATENT, BranchMLASelfAttention
from megatron_branch.models.rotary import PositionRotaryEmbedding
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule.prefix_cache import PrefixCache
from megatron_branch.testing import (
    hf_policy_gradient,
    hf_state,
    random_tree_rollouts,
    tiny_hf_config,
)


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def ds_config(*, q_lora: bool = True):  # noqa: ANN201
    cfg = tiny_hf_config("deepseek_v3", ffn=48)
    if not q_lora:
        cfg.q_lora_rank = None
    return cfg


def ds_hf(*, seed: int = 2, dtype: torch.dtype = torch.float64, q_lora: bool = True, exact: bool = True):  # noqa: ANN201
    """A tiny DeepSeek-V3 (MLA with distinct widths; glm4_moe's tiny MoE: 12 experts in 3 groups, top-4 within 2,
    a shared expert, layer 0 dense) whose correction biases are random, large enough to change the choice."""
    return with_random_biases(ds_config(q_lora=q_lora), seed=seed, dtype=dtype, exact=exact)


# --- mapping --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "q_proj"])
def test_mapping_round_trips_and_builds_megatrons_mla(q_lora: bool) -> None:
    arch = ModelArch.from_hf_config(ds_config(q_lora=q_lora))
    assert (arch.kv_lora_rank, arch.q_lora_rank, arch.head_dim, arch.qk_rope_head_dim, arch.v_head_dim) == (
        16,
        24 if q_lora else None,
        6,
        4,
        12,
    )
    assert arch.multi_latent and arch.num_query_groups == 4 and arch.rotary_dim == 4
    assert (arch.moe_num_groups, arch.moe_group_topk, arch.moe_layer_pattern) == (3, 2, (0, 1))
    assert ModelArch.from_hf_config(arch.to_hf_config()) == arch
    assert arch.to_hf_config().num_nextn_predict_layers == 0
    cfg = arch.to_transformer_config()
    assert cfg.multi_latent_attention and (cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == (
        6,
        4,
        12,
    )
    assert cfg.rope_type == "rope" and cfg.moe_router_enable_expert_bias
    model = build_model(arch)
    ropes = [m for m in model.modules() if isinstance(m, PositionRotaryEmbedding)]
    assert len(ropes) == arch.num_layers  # every MLA layer's own RoPE follows the position ids
    assert set(dict(model.named_parameters())) == set(mcore_names(arch))
    keys = {sh.key for sh in model.sharded_state_dict().values() if not sh.key.endswith("_extra_state")}
    assert keys == set(sharded_keys(arch))


def test_the_mla_shim_is_what_builds_megatrons_mla_without_te(monkeypatch: pytest.MonkeyPatch) -> None:
    """compat/mla.py: without TransformerEngine megatron's MLA module believes TE is there (its mocks import) and
    its constructor's isinstance check raises; the shim's HAVE_TE = False is what lets it build."""
    import megatron.core.transformer.multi_latent_attention as mla

    from megatron_branch.compat.moe import needs_te_shim

    if not needs_te_shim():
        pytest.skip("TransformerEngine is installed: megatron's own import decides")
    arch = ModelArch.from_hf_config(ds_config())
    build_model(arch)
    assert mla.HAVE_TE is False
    monkeypatch.setattr(mla, "HAVE_TE", True)  # what megatron sets without the shim (applied once: not again)
    with pytest.raises(TypeError, match="isinstance"):
        build_model(arch)


@pytest.mark.parametrize(
    "change,words",
    [
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 40.0, "rope_theta": 1e4}},
            "rope scaling 'yarn'",
        ),
        ({"rope_interleave": False}, "rope_interleave=false"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2 with multi-latent attention"),
        ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05"),
        ({"qk_rope_head_dim": 3}, "qk_rope_head_dim must be positive and even"),
        ({"topk_group": 1}, "HF ranks groups by their top-2 scores"),
    ],
)
def test_refusals_are_one_line(change: dict, words: str) -> None:
    d = dict(ds_config().to_dict(), **change)
    with pytest.raises(UserError, match=words) as e:
        ModelArch.from_hf_config(d)
    assert "\n" not in str(e.value)


# --- conversion ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "q_proj"])
def test_round_trip_is_bit_exact_and_logits_match(q_lora: bool) -> None:
    hf = ds_hf(dtype=torch.float32, q_lora=q_lora, exact=False)  # HF's own float32 router and norms
    assert_round_trip_and_logits(hf, hf_state(hf))


def test_files_round_trip_and_verify(tmp_path: Path) -> None:
    arch, _, cfg = files_round_trip(ds_hf(seed=1, dtype=torch.float32, exact=False), tmp_path)
    assert arch["family"] == "deepseek_v3" and arch["kv_lora_rank"] == 16
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["q_lora_rank"] == 24
    assert (cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["rope_interleave"]) == (
        16,
        6,
        12,
        True,
    )


def test_a_checkpoint_with_its_mtp_layer_is_refused_in_one_line() -> None:
    arch = ModelArch.from_hf_config(ds_config())
    names = list(hf_state(ds_hf(dtype=torch.float32, exact=False))) + ["model.layers.2.eh_proj.weight"]
    with pytest.raises(UserError, match="unexpected tensor 'model.layers.2.eh_proj.weight'") as e:
        check_hf_names(names, arch)
    assert "\n" not in str(e.value)


# --- the policy gradient ------------------------------------------------------------------------------------------
def _tree_rollouts() -> list:
    return random_tree_rollouts(prompt_len=7, branches=3, levels=2, seed=202)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_every_exact_schedule_matches_hf(dtype: torch.dtype) -> None:
    hf = ds_hf(dtype=dtype)
    arch, model = megatron_of(hf, dtype)
    rollouts = _tree_rollouts()
    _, want = hf_policy_gradient(hf, rollouts)
    got = {s: _schedule_grads(model, arch, rollouts, s) for s in EXACT}
    # replay's chunks (on by default; _schedule_grads walks segment by segment): with a budget of 12 tokens small
    # subtrees run as packed chunks against their ancestors' cached latent
    got["replay chunks"] = _schedule_grads(model, arch, rollouts, "replay", chunk_tokens=12)
    for schedule, grads in got.items():
        assert set(want) <= set(grads)  # + the frozen correction biases (no gradient)
        worst = _worst(grads, want)
        print(f"{schedule} {dtype}: worst vs HF {worst[0]:.1e} ({worst[1]})")
        assert worst[0] <= TOL[dtype], (schedule, worst)


def test_q_proj_without_query_latent_matches_hf() -> None:
    hf = ds_hf(q_lora=False)
    arch, model = megatron_of(hf, torch.float64)
    rollouts = _tree_rollouts()
    _, want = hf_policy_gradient(hf, rollouts)
    for schedule in ("replay", "packed"):
        worst = _worst(_schedule_grads(model, arch, rollouts, schedule), want)
        assert worst[0] <= FP64_SIGMOID_BOUND, (schedule, worst)
    # replay's segment recompute and per-layer checkpointing re-run MLA (its RoPE, its decompression) in backward
    got = _schedule_grads(model, arch, rollouts, "replay", recompute=True, recompute_layers=True)
    assert _worst(got, want)[0] <= FP64_SIGMOID_BOUND


# --- planted bugs: each breaks the gradient against HF --------------------------------------------------------------
def _rope_restarts_on_a_branch(monkeypatch: pytest.MonkeyPatch, model) -> None:  # noqa: ANN001
    """Every chunk's MLA RoPE positions restart at 0: a replayed branch rotates as if it began the sequence."""
    real = PositionRotaryEmbedding.forward

    def planted(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        if self.position_ids is not None:
            self.position_ids = self.position_ids - self.position_ids[0]
        return real(self, *a, **kw)

    monkeypatch.setattr(PositionRotaryEmbedding, "forward", planted)


def _latent_gradient_dropped(monkeypatch: pytest.MonkeyPatch, model) -> None:  # noqa: ANN001
    """A chunk decompresses its ancestors' cached latent outside the graph: their rows' dK/dV never reach the
    prefix (the latent leaves' gradient stays empty)."""
    real = BranchMLASelfAttention.decompress
    monkeypatch.setattr(
        BranchMLASelfAttention, "decompress", lambda self, c, kr: real(self, c.detach(), kr.detach())
    )


@pytest.mark.parametrize("plant", [_rope_restarts_on_a_branch, _bias_ignored, _latent_gradient_dropped])
def test_planted_bugs_fail(plant, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    hf = ds_hf()
    arch, model = megatron_of(hf, torch.float64)
    rollouts = _tree_rollouts()
    _, want = hf_policy_gradient(hf, rollouts)
    assert _worst(_schedule_grads(model, arch, rollouts, "replay"), want)[0] <= FP64_SIGMOID_BOUND
    plant(monkeypatch, model)
    assert _worst(_schedule_grads(model, arch, rollouts, "replay"), want)[0] > 1e-3


# --- the compact latent cache (models/mla_latent.py) ----------------------------------------------------------------
def _replay_cache_entries(monkeypatch: pytest.MonkeyPatch, model, arch, rollouts) -> tuple[list, dict]:  # noqa: ANN001
    """Replay's gradient, and what its prefix cache held: per pushed segment (cached rows, layer -> entry)."""
    pushed, real = [], PrefixCache.push

    def push(self, seg_id, captured, rows, **kw):  # noqa: ANN001, ANN003, ANN202
        real(self, seg_id, captured, rows, **kw)
        pushed.append((rows, dict(self.entries[seg_id])))

    with monkeypatch.context() as m:
        m.setattr(PrefixCache, "push", push)
        grads = _schedule_grads(model, arch, rollouts, "replay")
    return pushed, grads


def test_replay_caches_the_compressed_latent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cached segment's MLA layers hold c_kv + k_rope: (kv_lora_rank + qk_rope_head_dim) values per row
    (16 + 4 = 20 here), not the per-head K/V (4 heads x (6 + 4 + 12) = 88), and the gradient stays HF's.
    Planted: megatron's own MLA forward (per-head K/V handed down) is exact too but fails the byte count."""
    hf = ds_hf()
    arch, model = megatron_of(hf, torch.float64)
    rollouts = _tree_rollouts()
    _, want = hf_policy_gradient(hf, rollouts)
    latent = arch.kv_lora_rank + arch.qk_rope_head_dim

    def holds_latent(pushed: list) -> bool:
        return all(
            e.kind is MLA_LATENT and sum(t.numel() * t.element_size() for t in e.read) == rows * latent * 8
            for rows, entries in pushed
            for e in entries.values()
        )

    pushed, grads = _replay_cache_entries(monkeypatch, model, arch, rollouts)
    assert pushed and all(len(entries) == arch.num_layers for _, entries in pushed)
    assert holds_latent(pushed)
    assert _worst(grads, want)[0] <= FP64_SIGMOID_BOUND
    monkeypatch.setattr(BranchMLASelfAttention, "forward", BranchMLASelfAttention.__mro__[1].forward)
    pushed, grads = _replay_cache_entries(monkeypatch, model, arch, rollouts)
    assert _worst(grads, want)[0] <= FP64_SIGMOID_BOUND and not holds_latent(pushed)
    per_head = arch.num_attention_heads * (arch.head_dim + arch.qk_rope_head_dim + arch.v_head_dim)
    assert all(sum(t.numel() for t in e.read) == rows * per_head for rows, es in pushed for e in es.values())
