"""Qwen3.5 / Qwen3.6 text models (transformers' qwen3_5): megatron's GatedDeltaNet in the linear-attention layers,
gated full attention with q/k norms and partial RoPE, zero-centred norms, against HF.

Precision: megatron's GatedDeltaNet runs torch_chunk_gated_delta_rule in float32 whatever the model dtype, and
computes the decay g and both output gates (sigmoid in attention, silu in the gated norm) from float32 casts;
transformers' qwen3_5 computes its delta rule, g and gated norm in float32 too. A float64 run is therefore
float32-exact: measured <= 4e-6 relative per parameter gradient on these trees (float32: <= 2.1e-6), tested at
BOUND = 1e-5 for both dtypes. (Qwen3 dense, in test_qwen3.py, is float64-exact at 1e-9.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_branch.checkpoint import (
    convert_hf_to_mcore,
    convert_mcore_to_hf,
    gather_full_state,
    hf_to_mcore_state,
    layouts,
    load_full_state,
    mcore_to_hf_state,
)
from megatron_branch.checkpoint.hf_io import HFTensorReader
from megatron_branch.checkpoint.param_map import hf_shapes, mcore_names, sharded_keys
from megatron_branch.checkpoint.tp import gather_full_grads
from megatron_branch.checkpoint.verify import verify_conversion
from megatron_branch.cli import main
from megatron_branch.data import PrefixTree, Rollout, write_rollouts_jsonl
from megatron_branch.errors import UserError
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule
from megatron_branch.testing import (
    exact_hf_norms,
    hf_policy_gradient,
    random_tree_rollouts,
    tiny_hf_config,
    tiny_hf_model,
)

BOUND = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def hybrid(seed: int = 0, dtype: torch.dtype = torch.float32, **kw):  # noqa: ANN201
    """Layers [linear, linear, linear, full]: a GDN stack, then gated attention reading its output."""
    return exact_hf_norms(
        tiny_hf_model(tiny_hf_config("qwen3_5", num_layers=4, ffn=48, **kw), seed=seed, dtype=dtype)
    )


def megatron_of(hf: torch.nn.Module, dtype: torch.dtype = torch.float32):  # noqa: ANN201
    arch = ModelArch.from_hf_config(hf.config)
    model = build_model(arch, dtype=dtype)
    load_full_state(
        model, hf_to_mcore_state(hf.state_dict(), arch, padded_vocab=arch.padded_vocab_size(1)), None
    )
    return arch, model


def logits(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
    s = ids.shape[0]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        return model(ids[None], (torch.arange(s) if pos is None else pos)[None], mask)[0]


# --- the architecture -------------------------------------------------------------------------------------------------
def test_mapping_reads_every_hybrid_field() -> None:
    arch = ModelArch.from_hf_config(tiny_hf_config("qwen3_5", num_layers=4))
    assert arch.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (arch.num_linear_layers, arch.num_full_layers, arch.rotary_dim) == (3, 1, 8)
    assert arch.qk_norm and arch.zero_centered_norm and arch.attention_output_gate
    assert arch.gdn_in_proj_sections() == (16, 16, 32, 32, 4, 4)
    assert ModelArch.from_hf_config(arch.to_hf_config()) == arch
    cfg = arch.to_transformer_config()
    assert (
        cfg.linear_attention_freq == [1, 1, 1, 0] and cfg.experimental_attention_variant == "gated_delta_net"
    )
    assert cfg.layernorm_zero_centered_gamma and cfg.attention_output_gate and cfg.qk_layernorm
    assert cfg.deterministic_mode  # no CUDA here: torch conv1d + torch_chunk_gated_delta_rule
    # HF's rule when layer_types is absent: every full_attention_interval-th layer is full attention
    d = tiny_hf_config("qwen3_5", num_layers=8).to_dict()
    del d["layer_types"]
    d["full_attention_interval"] = 2
    assert ModelArch.from_hf_config(d).layer_types == ("linear_attention", "full_attention") * 4


def test_the_multimodal_config_maps_to_its_text_model() -> None:
    from transformers.models.qwen3_5 import Qwen3_5Config

    text = tiny_hf_config("qwen3_5", num_layers=4)
    mm = Qwen3_5Config(text_config=text.to_dict(), architectures=["Qwen3_5ForConditionalGeneration"])
    assert ModelArch.from_hf_config(mm.to_dict()) == ModelArch.from_hf_config(text)


@pytest.mark.parametrize(
    "change,words",
    [
        ({"attn_output_gate": False}, "always gates"),
        ({"output_gate_type": "sigmoid"}, "output_gate_type"),
        (
            {"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
            "layer type",
        ),
        ({"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
        ({"linear_num_value_heads": 3}, "not a multiple of linear_num_key_heads"),
        ({"attention_bias": True}, "attention_bias"),
        ({"head_dim": 15}, "RoPE needs an even number"),
    ],
)
def test_refusals_are_one_line(change: dict, words: str) -> None:
    d = dict(tiny_hf_config("qwen3_5", num_layers=4).to_dict(), **change)
    with pytest.raises(UserError, match=words) as e:
        ModelArch.from_hf_config(d)
    assert "\n" not in str(e.value) and "config.json" in str(e.value)


def test_tensor_parallel_must_split_the_gdn_heads() -> None:
    arch = ModelArch.from_hf_config(tiny_hf_config("qwen3_5", num_layers=4, heads=4, kv_heads=4))
    arch.check_tensor_parallel(2)
    with pytest.raises(UserError, match="does not divide linear_num_key_heads=2"):
        arch.check_tensor_parallel(4)  # 4 attention heads split, 2 GDN key heads do not


# --- the model against HF ---------------------------------------------------------------------------------------------
def test_text_positions_through_the_multimodal_rope_equal_1d_rope() -> None:
    """HF's three-section RoPE with equal text positions vs megatron's RoPE table over the rotated dims, at the
    positions a branch continuing from its parent has (not 0..s-1)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    hf = hybrid()
    arch, model = megatron_of(hf)
    pos = torch.tensor([0, 1, 2, 37, 38, 90, 91, 92])
    cos, sin = Qwen3_5TextRotaryEmbedding(hf.config)(torch.zeros(1, dtype=torch.float32), pos[None])
    rope = model.rotary_pos_emb
    rope.position_ids = pos
    emb = rope(len(pos))[:, 0, 0]  # [s, rotary_dim]
    rope.position_ids = None
    assert emb.shape[-1] == arch.rotary_dim == cos.shape[-1]
    torch.testing.assert_close(emb.cos(), cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(emb.sin(), sin[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "length", [14, 150], ids=["one_chunk", "three_chunks"]
)  # the delta rule's chunks: 64
def test_logits_match_hf(length: int) -> None:
    hf = hybrid(seed=1)
    arch, model = megatron_of(hf)
    ids = torch.randint(0, 37, (length,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    got = logits(model, ids)[:, :37]
    assert (got - ref).abs().max() <= 2e-5 * ref.abs().max()


def test_planted_in_proj_layout_bug_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """z (the output gate) placed where megatron expects v: the same shapes, the wrong model."""
    hf = hybrid(seed=1)
    wrong = (
        lambda ts, arch, pv: torch.cat([ts[0][:32], ts[1], ts[0][32:], ts[2], ts[3]]),
        layouts._gdn_in_proj_to_hf,
    )
    monkeypatch.setitem(layouts.TRANSFORMS, "gdn_in_proj", wrong)
    _, model = megatron_of(hf)
    ids = torch.randint(0, 37, (14,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (logits(model, ids)[:, :37] - ref).abs().max() > 1e-2


def test_megatrons_te_hybrid_spec_puts_the_norms_where_the_map_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron's own hybrid block spec (TE only; built here with the named stand-ins of test_param_map_te.py):
    GDN layers fuse the input norm into in_proj, attention layers into linear_qkv, the MLP's into fc1; GDN's
    out_norm and the q/k norms are modules of their own. The map's TE names say the same."""
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as hybrid_specs
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.identity_op import IdentityOp
    from test_param_map_te import FakeTESpecProvider, TELayerNormColumnParallelLinear, TENorm

    monkeypatch.setattr(hybrid_specs, "TESpecProvider", FakeTESpecProvider, raising=False)
    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", FakeTESpecProvider, raising=False)
    arch = ModelArch.from_hf_config(tiny_hf_config("qwen3_5", num_layers=4))
    block = hybrid_specs.get_transformer_block_with_experimental_attention_variant_spec(
        arch.to_transformer_config()
    )
    gdn, attn = block.layer_specs[0].submodules, block.layer_specs[3].submodules
    assert (
        gdn.input_layernorm is IdentityOp
        and gdn.self_attention.submodules.in_proj is TELayerNormColumnParallelLinear
    )
    assert gdn.self_attention.submodules.out_norm is TENorm
    assert attn.input_layernorm is IdentityOp
    assert attn.self_attention.submodules.linear_qkv is TELayerNormColumnParallelLinear
    assert attn.self_attention.submodules.q_layernorm is TENorm
    te = set(mcore_names(arch, "te"))
    assert "decoder.layers.0.self_attention.in_proj.layer_norm_weight" in te
    assert "decoder.layers.0.self_attention.out_norm.weight" in te
    assert "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.3.self_attention.q_layernorm.weight" in te
    assert not any(".input_layernorm." in n or ".pre_mlp_layernorm." in n for n in te)


# --- conversion -------------------------------------------------------------------------------------------------------
def test_round_trip_is_bit_exact() -> None:
    hf = hybrid(seed=3)
    arch = ModelArch.from_hf_config(hf.config)
    hf_sd = hf.state_dict()
    assert set(hf_sd) == set(hf_shapes(arch))
    state = hf_to_mcore_state(hf_sd, arch, padded_vocab=arch.padded_vocab_size(4))
    assert set(state) == set(mcore_names(arch))
    back = mcore_to_hf_state(state, arch)
    assert back.keys() == hf_sd.keys() and all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    model = build_model(arch)
    load_full_state(model, state, None)
    full = mcore_to_hf_state(gather_full_state(model, None), arch)
    assert all(torch.equal(full[k], hf_sd[k]) for k in hf_sd)
    # TE names: GDN layers fuse their input norm into in_proj, attention layers into linear_qkv
    te = mcore_names(arch, "te")
    assert "decoder.layers.0.self_attention.in_proj.layer_norm_weight" in te
    assert "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.2.self_attention.in_proj.weight" in sharded_keys(
        arch
    )  # hybrids keep layer indices


def _multimodal_folder(tmp_path: Path, hf: torch.nn.Module) -> Path:
    """The published Qwen3.5/3.6 layout: Qwen3_5ForConditionalGeneration's config, the text model under
    model.language_model., a vision tower and an MTP head beside it (stand-in tensors)."""
    from transformers.models.qwen3_5 import Qwen3_5Config

    d = tmp_path / "mm"
    d.mkdir()
    tensors = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v.contiguous()
        for k, v in hf.state_dict().items()
    }
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = Qwen3_5Config(text_config=hf.config.to_dict(), architectures=["Qwen3_5ForConditionalGeneration"])
    cfg.save_pretrained(str(d))
    return d


def test_files_round_trip_verify_and_the_multimodal_checkpoint(tmp_path: Path) -> None:
    hf = hybrid(seed=4)
    hf.save_pretrained(tmp_path / "hf")
    convert_hf_to_mcore(tmp_path / "hf", tmp_path / "mc", progress=False)
    meta = json.loads((tmp_path / "mc" / "megatron_branch.json").read_text())
    assert meta["arch"]["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    report = verify_conversion(tmp_path / "hf", tmp_path / "mc")
    assert report["ok"] and report["max_abs_diff"] <= 1e-5 and report["argmax_agreement"] == 1.0
    convert_mcore_to_hf(tmp_path / "mc", tmp_path / "out")
    src, dst = HFTensorReader(tmp_path / "hf"), HFTensorReader(tmp_path / "out")
    assert sorted(src.keys()) == sorted(dst.keys()) and all(
        torch.equal(src.get(k), dst.get(k)) for k in src.keys()
    )
    # the multimodal container converts to the same checkpoint: text model renamed, vision tower and MTP dropped
    mm = _multimodal_folder(tmp_path, hf)
    convert_hf_to_mcore(mm, tmp_path / "mc_mm", progress=False)
    assert verify_conversion(mm, tmp_path / "mc_mm")["ok"]
    convert_mcore_to_hf(tmp_path / "mc_mm", tmp_path / "out_mm")
    out = load_file(tmp_path / "out_mm" / "model.safetensors")
    assert out.keys() == hf.state_dict().keys()  # Qwen3_5ForCausalLM: the text model only
    assert all(torch.equal(out[k], v) for k, v in hf.state_dict().items())
    assert json.loads((tmp_path / "out_mm" / "config.json").read_text())["model_type"] == "qwen3_5_text"


# --- gradients --------------------------------------------------------------------------------------------------------
def _rollouts() -> list[Rollout]:
    """Forks at two depths, a 1-token response, a response that is a prefix of another, and a 70-token prompt
    (two of the delta rule's 64-token chunks)."""
    rs = random_tree_rollouts(prompt_len=7, branches=3, levels=2, seed=202)
    long_prompt = [int(x) for x in torch.randint(0, 37, (70,), generator=torch.Generator().manual_seed(7))]
    rs += [
        Rollout(prompt=long_prompt, response=[5], advantage=0.7),
        Rollout(prompt=long_prompt, response=[5, 9, 11], advantage=-1.1),
    ]
    return rs


def _grads(model: torch.nn.Module, arch: ModelArch, rollouts: list[Rollout], schedule: str):  # noqa: ANN202
    tree = PrefixTree.build(rollouts, vocab_size=arch.vocab_size)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rollouts], tree.num_response_tokens_logical())
    model.zero_grad(set_to_none=True)
    res = run_schedule(
        schedule,
        model,
        tree,
        obj,
        ScheduleOptions(vocab_size=arch.vocab_size, keep_logprobs=True, chunk_tokens=None),
    )
    return res, mcore_to_hf_state(gather_full_grads(model, None), arch)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_naive_and_naive_fused_match_hf_per_parameter(dtype: torch.dtype) -> None:
    hf = hybrid(seed=5, dtype=dtype)
    arch, model = megatron_of(hf, dtype)
    rollouts = _rollouts()
    hf_loss, hf_grads = hf_policy_gradient(hf, rollouts)
    results = {}
    for schedule in ("naive", "naive-fused"):
        res, grads = _grads(model, arch, rollouts, schedule)
        assert res.loss == pytest.approx(hf_loss, rel=BOUND)
        assert grads.keys() == hf_grads.keys()
        worst = max((_rel(grads[n], g), n) for n, g in hf_grads.items())
        assert worst[0] <= BOUND, (schedule, worst)
        results[schedule] = res
    torch.testing.assert_close(
        results["naive-fused"].target_logprobs,
        results["naive"].target_logprobs,
        rtol=0,
        atol=1e-5,
        equal_nan=True,
    )


def test_what_a_hybrid_cannot_run_is_refused_before_any_work() -> None:
    from megatron_branch.models.arch import check_schedule_supports

    hf = hybrid()
    arch, model = megatron_of(hf)
    tree = PrefixTree.build(_rollouts()[:3], vocab_size=arch.vocab_size)
    obj = PolicyGradientObjective.grpo([1.0, -1.0, 0.5], tree.num_response_tokens_logical())
    with pytest.raises(
        UserError, match="^schedule=replay-stopgrad cannot run a hybrid model .*; use schedule naive, "
    ) as e:
        run_schedule(
            "replay-stopgrad",
            model,
            tree,
            obj,
            ScheduleOptions(vocab_size=arch.vocab_size, chunk_tokens=None),
        )
    assert "\n" not in str(e.value)
    assert all(p.grad is None for p in model.parameters())  # nothing ran
    check_schedule_supports(arch, "replay", cp=2)  # 2 key / 4 value GDN heads split over CP2 (head exchange)
    with pytest.raises(UserError, match=r"--cp 3 cannot split the hybrid's gated delta net heads") as e:
        check_schedule_supports(arch, "replay", cp=3)
    assert "\n" not in str(e.value)


def test_a_wrapped_hybrid_without_its_arch_is_refused_from_its_config() -> None:
    """The library path checks a hybrid under megatron's wrappers (DDP -> Float16Module -> GPTModel, as the drop-in
    integration hands it over) and one built without `build_model`'s ModelArch: hybrid-ness from megatron's
    TransformerConfig."""
    import copy

    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.module import Float16Module

    from megatron_branch.parallel.ddp import wrap_megatron_ddp
    from megatron_branch.schedule import check_model_supports, unwrap_model

    arch, model = megatron_of(hybrid())
    del model.arch  # a GPTModel built elsewhere: only its TransformerConfig says it is a hybrid
    config = copy.copy(model.config)
    config.bf16 = True
    wrapped = wrap_megatron_ddp(
        Float16Module(config, model),
        dtype=torch.bfloat16,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    assert unwrap_model(wrapped) is model and wrapped.module.module is model
    tree = PrefixTree.build(_rollouts()[:3], vocab_size=arch.vocab_size)
    obj = PolicyGradientObjective.grpo([1.0, -1.0, 0.5], tree.num_response_tokens_logical())
    with pytest.raises(UserError, match="^schedule=replay-stopgrad cannot run a hybrid model") as e:
        run_schedule(
            "replay-stopgrad",
            wrapped,
            tree,
            obj,
            ScheduleOptions(vocab_size=arch.vocab_size, chunk_tokens=None),
        )
    assert "\n" not in str(e.value)
    assert all(p.grad is None for p in model.parameters())  # nothing ran
    check_model_supports(wrapped, "replay", cp=2)
    with pytest.raises(UserError, match=r"--cp 3 cannot split the hybrid's gated delta net heads"):
        check_model_supports(wrapped, "replay", cp=3)


@pytest.mark.slow
def test_grad_command_naive_and_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = hybrid(seed=6)
    hf.save_pretrained(tmp_path / "hf")
    rollouts = _rollouts()[:6]
    write_rollouts_jsonl(tmp_path / "r.jsonl", rollouts)
    _, want = hf_policy_gradient(hf, rollouts)
    base = ["grad", "--hf", str(tmp_path / "hf"), "--rollouts", str(tmp_path / "r.jsonl")]
    assert main([*base, "--out", str(tmp_path / "g.safetensors"), "--schedule", "naive"]) == 0
    got = load_file(tmp_path / "g.safetensors")
    assert got.keys() == want.keys() and max(_rel(got[n], want[n]) for n in want) <= BOUND
    capsys.readouterr()
    assert main([*base, "--out", str(tmp_path / "bad.safetensors"), "--schedule", "replay", "--cp", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--cp 3 cannot split the hybrid's gated delta net heads" in err and "\n" not in err
    assert not (tmp_path / "bad.safetensors").exists()
    for schedule in ("replay",):  # the tree schedule through the GDN state, from the HF folder
        out = tmp_path / f"{schedule}.safetensors"
        assert main([*base, "--out", str(out), "--schedule", schedule]) == 0
        got = load_file(out)
        assert got.keys() == want.keys() and max(_rel(got[n], want[n]) for n in want) <= BOUND


def test_train_config_takes_a_hybrid_policy_from_its_hf_folder(tmp_path: Path) -> None:
    from megatron_branch.train.config_io import load_config
    from megatron_branch.train.validate import model_arch

    hybrid().save_pretrained(tmp_path / "hf")
    (tmp_path / "c.yaml").write_text(
        f"model:\n  hf_path: {tmp_path / 'hf'}\ndata:\n  task: kv_retrieval\ntokenizer:\n  type: hf\n"
    )
    assert model_arch(load_config(tmp_path / "c.yaml", [])).num_linear_layers == 3
    with pytest.raises(
        UserError,
        match="schedule.name=replay-stopgrad cannot run a hybrid model .*; use schedule.name naive, ",
    ) as e:
        load_config(tmp_path / "c.yaml", ["schedule.name=replay-stopgrad"])
    assert "\n" not in str(e.value)
