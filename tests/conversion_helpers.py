"""The conversion checks the family tests share (tests/unit/test_qwen3.py, test_moe.py, test_glm4_moe.py): HF ->
megatron-core -> HF in memory, bit-exact, with the logits equal to HF's; and through files, with
`verify-conversion` and the export read back tensor by tensor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from megatron_branch.checkpoint import (
    convert_hf_to_mcore,
    convert_mcore_to_hf,
    gather_full_state,
    hf_to_mcore_state,
    load_full_state,
    mcore_to_hf_state,
)
from megatron_branch.checkpoint.hf_io import HFTensorReader
from megatron_branch.checkpoint.verify import verify_conversion
from megatron_branch.models import ModelArch, build_model


def assert_round_trip_and_logits(hf: Any, sd: dict[str, torch.Tensor]) -> None:
    """`sd` (the HF model's tensors under the checkpoint's names) -> megatron (vocabulary padded to 4 ranks) -> HF
    bit-exact, also through a model loaded with it; its logits on 14 tokens within 1e-5 of HF's (float32)."""
    arch = ModelArch.from_hf_config(hf.config)
    state = hf_to_mcore_state(sd, arch, padded_vocab=arch.padded_vocab_size(4))
    back = mcore_to_hf_state(state, arch)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    model = build_model(arch)
    load_full_state(model, state, None)
    assert all(
        torch.equal(v, sd[k]) for k, v in mcore_to_hf_state(gather_full_state(model, None), arch).items()
    )
    ids = torch.randint(0, 37, (1, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.triu(torch.ones(14, 14, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        got = model(ids, torch.arange(14)[None], mask)[0, :, :37]
        assert (got - hf(ids).logits[0]).abs().max() <= 1e-5


def files_round_trip(hf: Any, tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """`hf` saved, converted to megatron-core, verified (`verify-conversion`: ok, every argmax agreeing), exported
    back: every stored tensor bit-exact. Returns (megatron_branch.json's arch, the verify report, the exported
    config.json) for the family's own checks."""
    hf_dir = tmp_path / "hf"
    hf.save_pretrained(hf_dir)
    convert_hf_to_mcore(hf_dir, tmp_path / "mc", progress=False)
    meta = json.loads((tmp_path / "mc" / "megatron_branch.json").read_text())
    report = verify_conversion(hf_dir, tmp_path / "mc")
    assert report["ok"] and report["argmax_agreement"] == 1.0, report
    convert_mcore_to_hf(tmp_path / "mc", tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    src, dst = HFTensorReader(hf_dir), HFTensorReader(tmp_path / "out")
    assert sorted(src.keys()) == sorted(dst.keys())
    assert all(torch.equal(src.get(k), dst.get(k)) for k in src.keys())
    return meta["arch"], report, cfg
