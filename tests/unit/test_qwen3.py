"""Qwen3 dense (transformers' Qwen3ForCausalLM) on megatron-core: q/k norms, head_dim != hidden / heads, tied and
untied embeddings. Mapping and refusals, bit-exact conversion both ways (tensors and files, TP1; TP2 in
tests/distributed/test_models_tp.py), verify-conversion, the `grad` command, and every schedule against HF.

float64: <= 1e-9 relative per parameter (measured ~1e-15); float32: <= 1e-5 (measured ~6e-7).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conversion_helpers import assert_round_trip_and_logits, files_round_trip
from safetensors.torch import load_file

from megatron_branch.checkpoint import (
    hf_to_mcore_state,
    load_full_state,
    mcore_to_hf_state,
)
from megatron_branch.checkpoint.param_map import mcore_names
from megatron_branch.cli import main
from megatron_branch.data import PrefixTree, write_rollouts_jsonl
from megatron_branch.errors import UserError
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import SCHEDULES, ScheduleOptions, run_schedule
from megatron_branch.testing import (
    exact_hf_norms,
    hf_policy_gradient,
    random_tree_rollouts,
    tiny_hf_config,
    tiny_hf_model,
)

TOL = {torch.float64: 1e-9, torch.float32: 1e-5}
EXACT = ("naive", "packed", "replay", "naive-fused", "packed-nosharing")


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def qwen3(tie: bool = False, seed: int = 0, dtype: torch.dtype = torch.float32):  # noqa: ANN201
    cfg = tiny_hf_config("qwen3", tie=tie, ffn=48)  # hidden 32, 4 heads: head_dim 16 != 32 / 4
    return exact_hf_norms(tiny_hf_model(cfg, seed=seed, dtype=dtype)).eval()


def test_mapping_q_k_norms_and_head_dim() -> None:
    hf = qwen3()
    arch = ModelArch.from_hf_config(hf.config)
    assert (arch.family, arch.qk_norm, arch.head_dim, arch.qkv_bias) == ("qwen3", True, 16, False)
    assert arch.head_dim != arch.hidden_size // arch.num_attention_heads
    assert ModelArch.from_hf_config(arch.to_hf_config()) == arch  # the mapping round-trips
    cfg = arch.to_transformer_config()
    assert cfg.qk_layernorm and cfg.kv_channels == 16 and not cfg.add_qkv_bias
    model = build_model(arch)
    assert set(dict(model.named_parameters())) == set(mcore_names(arch))
    q_norm = model.decoder.layers[0].self_attention.q_layernorm
    assert isinstance(q_norm, torch.nn.RMSNorm) and q_norm.weight.shape == (16,)


@pytest.mark.parametrize(
    "change,words",
    [
        ({"attention_bias": True}, "attention_bias=true"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding windows"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope scaling"),
        ({"architectures": ["Qwen2ForCausalLM"]}, "does not match architectures"),
    ],
)
def test_refusals_are_one_line(change: dict, words: str) -> None:
    d = dict(tiny_hf_config("qwen3").to_dict(), **change)
    with pytest.raises(UserError, match=words) as e:
        ModelArch.from_hf_config(d)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_round_trip_is_bit_exact_and_logits_match(tie: bool) -> None:
    hf = qwen3(tie=tie)
    assert_round_trip_and_logits(
        hf, {k: v for k, v in hf.state_dict().items() if not (tie and k == "lm_head.weight")}
    )


def test_files_round_trip_and_verify(tmp_path: Path) -> None:
    arch, report, cfg = files_round_trip(qwen3(tie=False, seed=1), tmp_path)
    assert arch["qk_norm"] is True and report["max_abs_diff"] <= 1e-5
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]


def _grads(model: torch.nn.Module, arch: ModelArch, rollouts: list, schedule: str):  # noqa: ANN202
    from megatron_branch.checkpoint.tp import gather_full_grads

    tree = PrefixTree.build(rollouts, vocab_size=arch.vocab_size)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rollouts], tree.num_response_tokens_logical())
    model.zero_grad(set_to_none=True)
    res = run_schedule(
        schedule, model, tree, obj, ScheduleOptions(vocab_size=arch.vocab_size, chunk_tokens=None)
    )
    return res, mcore_to_hf_state(gather_full_grads(model, None), arch)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_every_exact_schedule_matches_hf(dtype: torch.dtype, tie: bool) -> None:
    assert set(EXACT) <= set(SCHEDULES)
    hf = qwen3(tie=tie, seed=2, dtype=dtype)
    arch = ModelArch.from_hf_config(hf.config)
    model = build_model(arch, dtype=dtype)
    load_full_state(model, hf_to_mcore_state(hf.state_dict(), arch, padded_vocab=37), None)
    rollouts = random_tree_rollouts(prompt_len=7, branches=3, levels=2, seed=202)
    hf_loss, hf_grads = hf_policy_gradient(hf, rollouts)
    for schedule in EXACT:
        res, grads = _grads(model, arch, rollouts, schedule)
        assert res.loss == pytest.approx(hf_loss, rel=10 * TOL[dtype])
        assert grads.keys() == hf_grads.keys()
        for n, g in hf_grads.items():
            assert _rel(grads[n], g) <= TOL[dtype], (schedule, n, _rel(grads[n], g))


def test_grad_command_float64(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The stable `grad` contract on a Qwen3 folder: HF names, float64, every schedule against HF."""
    hf = qwen3(tie=True, seed=3, dtype=torch.float64)
    hf.save_pretrained(tmp_path / "hf")
    rollouts = random_tree_rollouts(groups=2, prompt_len=6, branches=3, levels=2, seed=5)
    write_rollouts_jsonl(tmp_path / "r.jsonl", rollouts)
    _, want = hf_policy_gradient(hf, rollouts)
    for schedule in ("naive", "packed", "replay"):
        out = tmp_path / f"{schedule}.safetensors"
        argv = [
            "grad",
            "--hf",
            str(tmp_path / "hf"),
            "--rollouts",
            str(tmp_path / "r.jsonl"),
            "--out",
            str(out),
        ]
        assert main([*argv, "--schedule", schedule, "--dtype", "float64"]) == 0
        got = load_file(out)
        assert got.keys() == want.keys()
        assert max(_rel(got[n], want[n]) for n in want) <= 1e-9, schedule
    capsys.readouterr()


def test_sampler_greedy_equals_hf_generate_and_training_logprobs() -> None:
    """Qwen3 through the engine's sampler (prompt prefilled once, branches decoded against its cached K/V, q/k
    norms before the cache): greedy == transformers' generate; recorded logprobs == the training forward."""
    from megatron_branch.generation import BranchSampler, SamplingParams

    hf = qwen3(seed=4)
    arch = ModelArch.from_hf_config(hf.config)
    model = build_model(arch)
    load_full_state(model, hf_to_mcore_state(hf.state_dict(), arch, padded_vocab=37), None)
    prompts = [
        [int(x) for x in torch.randint(0, 37, (n,), generator=torch.Generator().manual_seed(n))]
        for n in (9, 4)
    ]
    out = BranchSampler(model.eval(), vocab_size=37).generate(
        prompts, SamplingParams(n=2, max_new_tokens=6, temperature=0)
    )
    samples = []
    for p, prompt in enumerate(prompts):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6)
        for s in out.samples[p]:
            assert list(s.response) == want[0, len(prompt) :].tolist()
            samples.append(s)
    rollouts = [s.to_rollout(advantage=1.0) for s in samples]
    tree = PrefixTree.build(rollouts, vocab_size=37)
    obj = PolicyGradientObjective.grpo([1.0] * len(rollouts), tree.num_response_tokens_logical())
    res = run_schedule(
        "replay", model, tree, obj, ScheduleOptions(vocab_size=37, keep_logprobs=True, chunk_tokens=None)
    )
    for i, s in enumerate(samples):
        got, want_lp = res.rollout_logprobs(tree, i).double(), torch.tensor(s.logprobs, dtype=torch.float64)
        torch.testing.assert_close(got, want_lp, rtol=1e-5, atol=1e-5)


def test_config_defined_qwen3_policy() -> None:
    from megatron_branch.train.config_io import load_config
    from megatron_branch.train.validate import model_arch

    cfg = load_config(None, ["model.arch.family=qwen3", "data.task=kv_retrieval"])
    arch = model_arch(cfg, vocab_size=50)
    assert arch.family == "qwen3" and arch.qk_norm and not arch.qkv_bias
