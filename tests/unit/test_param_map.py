"""HF <-> megatron parameter map, TP1 loading, file conversion round trips and refusals (tiny random models)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from megatron_branch.checkpoint import (
    convert_hf_to_mcore,
    convert_mcore_to_hf,
    gather_full_state,
    hf_to_mcore_state,
    load_full_state,
    mcore_to_hf_state,
)
from megatron_branch.checkpoint.hf_io import HFTensorReader, load_hf_config
from megatron_branch.errors import UserError
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.testing import tiny_hf_config, tiny_hf_model

CASES = {
    "llama_gqa_untied": ("llama", False),
    "llama_gqa_tied": ("llama", True),
    "qwen2_bias_tied": ("qwen2", True),
    "qwen2_bias_untied": ("qwen2", False),
}


def tiny_hf(family: str, tied: bool, *, vocab: int = 37, seed: int = 0) -> torch.nn.Module:
    return tiny_hf_model(tiny_hf_config(family, vocab_size=vocab, tie=tied, ffn=48), seed=seed).eval()


@pytest.fixture(scope="module")
def groups():
    return initialize_parallel(ParallelConfig(tp=1))


def _logits(model: torch.nn.Module, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    s = ids.shape[0]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        return model(ids[None], torch.arange(s)[None], mask)[0][:, :vocab]


def _greedy(step, ids: torch.Tensor, n: int) -> list[int]:
    out = ids.clone()
    for _ in range(n):
        out = torch.cat([out, step(out)[-1].argmax()[None]])
    return out[ids.shape[0] :].tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_roundtrip_and_logits_tp1(case: str, groups) -> None:
    family, tied = CASES[case]
    hf = tiny_hf(family, tied)
    hf_sd = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    arch = ModelArch.from_hf_config(hf.config)
    mstate = hf_to_mcore_state(hf_sd, arch, padded_vocab=arch.padded_vocab_size(4))  # padding kept as zeros
    assert mstate["embedding.word_embeddings.weight"].shape[0] == 40
    back = mcore_to_hf_state(mstate, arch)
    assert set(back) == set(hf_sd)
    for k, v in hf_sd.items():
        assert torch.equal(back[k], v), k

    model = build_model(arch, tp=1)
    load_full_state(model, mstate, groups.tp)  # re-pads 40 -> 37 rows
    for k, v in mcore_to_hf_state(gather_full_state(model, groups.tp), arch).items():
        assert torch.equal(v, hf_sd[k]), k
    ids = torch.randint(0, 37, (12,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (ref - _logits(model, ids, 37)).abs().max() <= 1e-4
    with torch.no_grad():
        hf_next = _greedy(lambda x: hf(x[None]).logits[0], ids, 5)
    assert hf_next == _greedy(lambda x: _logits(model, x, 37), ids, 5)


def _save_hf(tmp_path: Path, family: str = "llama", tied: bool = False, name: str = "hf", **kw) -> Path:
    d = tmp_path / name
    tiny_hf(family, tied).save_pretrained(str(d), **kw)
    return d


def test_file_roundtrip_sharded_with_tokenizer(tmp_path: Path) -> None:
    hf_dir = _save_hf(tmp_path, "qwen2", False, max_shard_size="20KB")
    assert (hf_dir / "model.safetensors.index.json").is_file()
    for n in ("tokenizer.json", "tokenizer_config.json"):
        (hf_dir / n).write_text(json.dumps({"name": n}))
    convert_hf_to_mcore(hf_dir, tmp_path / "mc", progress=False)
    meta = json.loads((tmp_path / "mc" / "megatron_branch.json").read_text())
    assert meta["arch"]["family"] == "qwen2" and meta["dtype"] == "float32"
    convert_mcore_to_hf(tmp_path / "mc", tmp_path / "out", max_shard_size="10KB")
    out = tmp_path / "out"
    assert (out / "model.safetensors.index.json").is_file()
    assert (out / "tokenizer.json").read_text() == (hf_dir / "tokenizer.json").read_text()
    src, dst = HFTensorReader(hf_dir), HFTensorReader(out)
    assert sorted(src.keys()) == sorted(dst.keys())
    for k in src.keys():
        assert torch.equal(src.get(k), dst.get(k)), k
    assert load_hf_config(out).to_dict()["num_key_value_heads"] == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left


# --- refusals -------------------------------------------------------------------------------------------------------
def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_refuses_unsupported_architectures() -> None:
    from transformers import GPT2Config, LlamaConfig, MistralConfig

    for cfg in (GPT2Config(), MistralConfig(architectures=["MistralForCausalLM"])):
        with pytest.raises(UserError, match="unsupported architecture") as e:
            ModelArch.from_hf_config(cfg)
        _one_line(e)
    for rope in (
        {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5},
        {"rope_type": "yarn", "factor": 4.0},
    ):
        cfg = dict(LlamaConfig(architectures=["LlamaForCausalLM"]).to_dict(), rope_parameters=rope)
        with pytest.raises(UserError, match="rope") as e:
            ModelArch.from_hf_config(cfg)
        _one_line(e)


def test_refuses_tp_not_dividing_heads(tmp_path: Path) -> None:
    hf_dir = _save_hf(tmp_path)
    with pytest.raises(UserError, match="does not divide num_attention_heads") as e:
        convert_hf_to_mcore(hf_dir, tmp_path / "mc", tp=3, progress=False)
    _one_line(e)
    assert not (tmp_path / "mc").exists()


def test_refuses_missing_and_misshaped_tensors(groups) -> None:
    hf = tiny_hf("llama", False)
    arch = ModelArch.from_hf_config(hf.config)
    sd = dict(hf.state_dict())
    missing = {k: v for k, v in sd.items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(UserError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'") as e:
        hf_to_mcore_state(missing, arch, padded_vocab=37)
    _one_line(e)
    extra = dict(sd, **{"model.layers.9.foo.weight": torch.zeros(1)})
    with pytest.raises(UserError, match="unexpected tensor 'model.layers.9.foo.weight'"):
        hf_to_mcore_state(extra, arch, padded_vocab=37)
    bad = dict(sd, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 32)})
    with pytest.raises(
        UserError, match=r"k_proj.weight' has shape \[8, 32\] but the config implies \[16, 32\]"
    ):
        hf_to_mcore_state(bad, arch, padded_vocab=37)


def test_refuses_broken_files(tmp_path: Path) -> None:
    # Sharded folder whose index names a missing shard.
    hf_dir = _save_hf(tmp_path, max_shard_size="20KB")
    shards = sorted(hf_dir.glob("model-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(UserError, match="index names shard") as e:
        convert_hf_to_mcore(hf_dir, tmp_path / "mc", progress=False)
    assert shards[-1].name in _one_line(e)
    # Truncated single-file checkpoint.
    hf_dir = _save_hf(tmp_path, name="hf_trunc")
    f = hf_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[: os.path.getsize(f) // 2])
    with pytest.raises(UserError, match="model.safetensors") as e:
        convert_hf_to_mcore(hf_dir, tmp_path / "mc", progress=False)
    _one_line(e)
    # No folder / no config.
    with pytest.raises(UserError, match="does not exist"):
        convert_hf_to_mcore(tmp_path / "nope", tmp_path / "mc", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        convert_hf_to_mcore(tmp_path / "empty", tmp_path / "mc", progress=False)
    # Config disagreeing with the tensors.
    hf_dir = _save_hf(tmp_path, name="hf_cfg")
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["intermediate_size"] = 64
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="gate_proj.weight' has shape .* config implies") as e:
        convert_hf_to_mcore(hf_dir, tmp_path / "mc", progress=False)
    _one_line(e)
    assert not (tmp_path / "mc").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_refuses_checkpoint_meta_disagreeing_with_tensors(tmp_path: Path) -> None:
    convert_hf_to_mcore(_save_hf(tmp_path), tmp_path / "mc", progress=False)
    meta_f = tmp_path / "mc" / "megatron_branch.json"
    meta = json.loads(meta_f.read_text())
    meta["arch"]["ffn_hidden_size"] = 64
    meta_f.write_text(json.dumps(meta))
    with pytest.raises(UserError, match="linear_fc1.weight' has shape") as e:
        convert_mcore_to_hf(tmp_path / "mc", tmp_path / "out")
    _one_line(e)
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="pipeline-parallel"):
        convert_hf_to_mcore(tmp_path / "hf", tmp_path / "mc2", pp=2)
