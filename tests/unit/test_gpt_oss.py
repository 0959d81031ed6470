"""gpt-oss (`gpt_oss`, models/families/gpt_oss.py) on megatron-core: sliding-window layers alternating with full ones,
learned sinks, biases on every linear, the router's bias, the clamped GLU, HF's fused interleaved experts. Mapping
and refusals, bit-exact conversion (in memory and through files, verify-conversion), the policy gradient of every
exact schedule against Hugging Face's eager gpt_oss per rollout on a fork-heavy tree whose window (4 positions) ends
inside some branches' ancestors and short of others, float64 at 1e-9 and float32 at 1e-5, and planted bugs (the sink
gradient dropped, the window ignored for the tree's tokens) that each fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conversion_helpers import files_round_trip
from test_glm4_moe import _schedule_grads, megatron_of

from megatron_branch.attention import core_attention, executor
from megatron_branch.checkpoint import (
    gather_full_state,
    hf_to_mcore_state,
    load_full_state,
    mcore_to_hf_state,
)
from megatron_branch.checkpoint.param_map import mcore_names
from megatron_branch.data import PrefixTree
from megatron_branch.errors import UserError
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.testing import (
    exact_hf_norms,
    hf_policy_gradient,
    hf_state,
    random_tree_rollouts,
    tiny_hf_config,
    tiny_hf_model,
)

TOL = {torch.float64: 1e-9, torch.float32: 1e-5}
EXACT = ("naive", "packed", "replay", "naive-fused", "packed-nosharing")
WINDOW = 4


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def oss_hf(*, seed: int = 2, dtype: torch.dtype = torch.float64, exact: bool = True):  # noqa: ANN201
    """A tiny gpt-oss (layer 0 sliding window 4, layer 1 full; 4 experts, top-2; the clamp at 1.0); `exact`: HF's
    norms in the model's dtype (its router and experts already compute in it)."""
    hf = tiny_hf_model(tiny_hf_config("gpt_oss"), seed=seed, dtype=dtype)
    return (exact_hf_norms(hf) if exact else hf).eval()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def _worst(got: dict, want: dict) -> tuple[float, str]:
    assert got.keys() == want.keys(), set(got) ^ set(want)
    return max((_rel(got[n], g), n) for n, g in want.items())


# --- mapping --------------------------------------------------------------------------------------------------------
def test_mapping_round_trips_and_builds_megatrons_window_sinks_and_glu() -> None:
    hf = oss_hf(dtype=torch.float32)
    arch = ModelArch.from_hf_config(hf.config)
    assert (arch.sliding_window, arch.window_layers, arch.window_of(0), arch.window_of(1)) == (
        4,
        (1, 0),
        4,
        None,
    )
    assert (arch.attention_sinks, arch.linear_bias, arch.qkv_bias, arch.swiglu_limit) == (
        True,
        True,
        True,
        1.0,
    )
    assert (arch.num_experts, arch.moe_top_k, arch.moe_ffn_hidden_size, arch.moe_norm_topk_prob) == (
        4,
        2,
        16,
        True,
    )
    assert (arch.yarn_factor, arch.yarn_original_max_position_embeddings, arch.yarn_truncate) == (
        4.0,
        64,
        False,
    )
    assert ModelArch.from_hf_config(arch.to_hf_config()) == arch
    cfg = arch.to_transformer_config()
    assert (
        cfg.window_size == (3, 0) and cfg.window_attn_skip_freq == [1, 0] and cfg.softmax_type == "learnable"
    )
    assert cfg.add_bias_linear and cfg.glu_linear_offset == 1.0 and cfg.activation_func_clamp_value == 1.0
    model = build_model(arch)
    cores = [m for m in model.modules() if isinstance(m, core_attention.BranchCoreAttention)]
    assert [c.window for c in cores] == [4, None]
    assert all(c.sink is c.softmax_offset and c.stock.softmax_offset is c.sink for c in cores)  # one tensor
    assert set(dict(model.named_parameters())) == set(mcore_names(arch))


@pytest.mark.parametrize(
    "change,words",
    [
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 32.0, "rope_theta": 1.5e5, "mscale": 0.7}},
            "yarn mscale=0.7",
        ),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1.5e5}},
            "rope scaling 'llama3'",
        ),
        ({"swiglu_alpha": 1.5}, "swiglu_alpha=1.5"),
        ({"attention_bias": False}, "attention_bias=false"),
        ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types must be 2 of"),
        ({"sliding_window": None}, "need sliding_window"),
    ],
)
def test_refusals_are_one_line(change: dict, words: str) -> None:
    d = dict(tiny_hf_config("gpt_oss").to_dict(), **change)
    with pytest.raises(UserError, match=words) as e:
        ModelArch.from_hf_config(d)
    assert "\n" not in str(e.value)


def test_tensor_parallel_needs_whole_experts() -> None:
    """megatron-core allows expert biases only at expert tensor parallel size 1: TP2 with the experts split over TP
    is refused in one line, TP2 with ETP 1 is accepted (run at world 2: tests/distributed/test_gpt_oss_parallel.py)."""
    arch = ModelArch.from_hf_config(tiny_hf_config("gpt_oss"))
    arch.check_tensor_parallel(2, etp=1)
    with pytest.raises(UserError, match="expert tensor parallel size 2 with gpt_oss's expert biases") as e:
        arch.check_tensor_parallel(2)
    assert "\n" not in str(e.value)


# --- conversion ---------------------------------------------------------------------------------------------------
def test_round_trip_is_bit_exact_and_logits_match() -> None:
    """HF's fused, interleaved experts and the sinks convert both ways bit for bit; megatron's forward (its own
    DotProductAttention: the sliding-window mask and SoftmaxOne) equals HF's eager gpt_oss on 14 tokens (> W)."""
    hf = oss_hf(dtype=torch.float32, exact=False)
    arch = ModelArch.from_hf_config(hf.config)
    sd = hf_state(hf)
    assert sd["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 32)  # [E, h, 2e] interleaved
    state = hf_to_mcore_state(sd, arch, padded_vocab=arch.padded_vocab_size(4))
    fc1 = state["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]  # [gate; up] rows
    assert torch.equal(fc1[:16], sd["model.layers.0.mlp.experts.gate_up_proj"][1][:, 0::2].t())
    back = mcore_to_hf_state(state, arch)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    model = build_model(arch)
    load_full_state(model, state, None)
    assert all(
        torch.equal(v, sd[k]) for k, v in mcore_to_hf_state(gather_full_state(model, None), arch).items()
    )
    ids = torch.randint(0, 37, (1, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(ids, torch.arange(14)[None], None)[0, :, :37] - hf(ids).logits[0]).abs().max() <= 1e-5


def test_files_round_trip_and_verify(tmp_path: Path) -> None:
    arch, _, cfg = files_round_trip(oss_hf(seed=1, dtype=torch.float32, exact=False), tmp_path)
    assert arch["family"] == "gpt_oss" and arch["window_layers"] == [1, 0]
    assert cfg["architectures"] == ["GptOssForCausalLM"] and cfg["layer_types"] == [
        "sliding_attention",
        "full_attention",
    ]
    assert (cfg["sliding_window"], cfg["swiglu_limit"], cfg["num_local_experts"]) == (4, 1.0, 4)


# --- the policy gradient ------------------------------------------------------------------------------------------
def _tree_rollouts() -> list:
    """Two groups, three levels, segments of 1 to 6 tokens: short branches whose window reaches back into their
    parent and grandparent, long ones whose later tokens see none of their ancestors."""
    return random_tree_rollouts(groups=2, prompt_len=6, branches=3, levels=3, seg_len=(1, 6), seed=1)


def test_the_tree_has_windows_that_cross_and_windows_that_stop() -> None:
    tree = PrefixTree.build(_tree_rollouts(), vocab_size=37)
    children = [s for s in tree.segments if s.parent is not None]
    assert any(s.length < WINDOW - 1 for s in children)  # its last token's window crosses into its ancestors
    assert any(s.length > WINDOW for s in children)  # its later tokens see none of them


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_every_exact_schedule_matches_hf(dtype: torch.dtype) -> None:
    hf = oss_hf(dtype=dtype)
    arch, model = megatron_of(hf, dtype)
    rollouts = _tree_rollouts()
    _, want = hf_policy_gradient(hf, rollouts)
    assert want["model.layers.0.self_attn.sinks"].abs().max() > 0  # the sinks do get a gradient
    for schedule in EXACT if dtype == torch.float64 else ("packed", "replay"):  # fp32: the two tree schedules
        worst = _worst(_schedule_grads(model, arch, rollouts, schedule), want)
        print(f"{schedule} {dtype}: worst vs HF {worst[0]:.1e} ({worst[1]})")
        assert worst[0] <= TOL[dtype], (schedule, worst)
    # replay's chunks (on by default; _schedule_grads walks segment by segment): with a budget of 12 tokens small
    # subtrees run as packed chunks against their cached ancestors, the window and sinks applied across the two
    worst = _worst(_schedule_grads(model, arch, rollouts, "replay", chunk_tokens=12), want)
    assert worst[0] <= TOL[dtype], ("replay chunks", worst)


# --- planted bugs: each breaks the gradient against HF --------------------------------------------------------------
def _sink_grad_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(executor, "sink_grad", lambda dout, out, lse, sink: torch.zeros_like(sink))


def _window_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tree path attends without the window (megatron's own per-rollout path keeps it)."""
    real = core_attention.BranchCoreAttention.forward

    def forward(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        monkeypatch.setattr(self, "window", None)
        return real(self, *a, **kw)

    monkeypatch.setattr(core_attention.BranchCoreAttention, "forward", forward)


@pytest.mark.parametrize("plant", [_sink_grad_dropped, _window_ignored])
def test_planted_bugs_fail(plant, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    hf = oss_hf()
    arch, model = megatron_of(hf, torch.float64)
    rollouts = _tree_rollouts()
    _, want = hf_policy_gradient(
        hf, rollouts
    )  # replay without the plant: test_every_exact_schedule_matches_hf
    plant(monkeypatch)
    assert _worst(_schedule_grads(model, arch, rollouts, "replay"), want)[0] > 1e-3


# --- the sampler ----------------------------------------------------------------------------------------------------
def test_sampler_greedy_equals_hf_generate() -> None:
    """Prompts of 9 and 4 tokens, 6 new per branch: the decode steps' windows leave the longer prompt's first tokens
    and, later, the branch's own first tokens (both parts of the decode attention masked), the sinks in every row."""
    from test_glm4_moe_use import check_greedy_equals_generate

    hf = oss_hf(seed=3, dtype=torch.float32, exact=False)
    _, model = megatron_of(hf, torch.float32)
    check_greedy_equals_generate(hf, model)


# --- train ----------------------------------------------------------------------------------------------------------
OSS_ARCH = (  # a config-defined tiny gpt-oss: a window of 3 on layer 0 (sequences of ~11 tokens), sinks, biases
    "model.arch={family: gpt_oss, hidden_size: 16, num_layers: 2, num_attention_heads: 2, num_query_groups: 1, "
    "head_dim: 8, ffn_hidden_size: 8, num_experts: 4, moe_top_k: 2, moe_ffn_hidden_size: 8, qkv_bias: true, "
    "linear_bias: true, attention_sinks: true, sliding_window: 3, window_layers: [1, 0], swiglu_limit: 1.0, "
    "max_position_embeddings: 64}"
)


def test_train_runs_a_gpt_oss_policy_and_resumes_exactly(tmp_path: Path) -> None:
    """Routing replay (R3) and router losses on, float64: the sampler decodes through the window and sinks, replay
    computes fewer positions than logical, a run resumed after step 1 equals the uninterrupted one (tokens, losses,
    parameters at 1e-9: test_glm4_moe_use's check); the sinks do train."""
    from test_glm4_moe_use import train_and_resume

    p_full, p_first, _ = train_and_resume(tmp_path, OSS_ARCH, expert_bias=False)
    sinks = [k for k in p_full if k.endswith("core_attention.softmax_offset")]
    assert len(sinks) == 2 and any(not torch.equal(p_full[k], p_first[k]) for k in sinks)


def test_yarn_rope_equals_hf_and_a_plain_rope_would_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron's YaRN (its frequencies through models/rotary.py, its concentration factor in attention) equals
    transformers' on 30 positions (float64 logits); planted: the plain frequencies instead."""
    from megatron_branch.models import rotary

    hf = oss_hf(dtype=torch.float64)
    _, model = megatron_of(hf, torch.float64)
    ids = torch.randint(0, 37, (1, 30), generator=torch.Generator().manual_seed(1))

    def gap() -> float:
        with torch.no_grad():
            return (
                (model(ids, torch.arange(30)[None], None)[0, :, :37] - hf(ids).logits[0]).abs().max().item()
            )

    assert gap() <= 1e-12
    monkeypatch.setattr(rotary, "yarn_inv_freq", lambda inner: inner.inv_freq)
    assert gap() > 1e-3
