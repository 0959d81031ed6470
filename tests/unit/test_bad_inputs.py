"""Every bad input of issue 13's list, through the CLI: exit status 2, ONE stderr line naming what and where, no
traceback, and the output folder unchanged. Plus: pickle payloads in any file of an HF folder or a checkpoint
never run, even with torch's `weights_only` default forced off (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1).
The torchrun cases are in tests/distributed/test_cli_errors.py.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from megatron_branch.checkpoint import convert_hf_to_mcore
from megatron_branch.checkpoint.integrity import SafeMetadataUnpickler
from megatron_branch.cli import main
from megatron_branch.data import Rollout, write_rollouts_jsonl
from megatron_branch.testing import random_tree_rollouts, tiny_hf_config, tiny_hf_model

# a module fixture converts a tiny model to every format (~10 s): the whole file is slow
pytestmark = pytest.mark.slow


def tree(d: Path) -> dict[str, tuple[int, int, int]]:
    return {
        str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_mode)
        for p in sorted(d.rglob("*"))
    }


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bad_inputs")
    tiny_hf_model(tiny_hf_config("qwen2"), seed=0).save_pretrained(d / "hf")  # max_position_embeddings 512
    tiny_hf_model(tiny_hf_config("llama"), seed=1).save_pretrained(d / "llama")
    write_rollouts_jsonl(d / "r.jsonl", random_tree_rollouts(groups=1, levels=1, branches=2, seed=0))
    long = Rollout(prompt=[1] * 500, response=[2] * 20, advantage=1.0)  # 520 tokens > 512 positions
    write_rollouts_jsonl(d / "long.jsonl", [*random_tree_rollouts(groups=1, branches=2, seed=1), long])
    convert_hf_to_mcore(d / "hf", d / "mc", progress=False)
    return d


def refused(argv: list[str], out_dir: Path, capsys: pytest.CaptureFixture[str], *expect: str) -> str:
    """Run the CLI; assert status 2, one stderr line (containing `expect`), no traceback, `out_dir` unchanged."""
    out_dir.mkdir(exist_ok=True)
    before = tree(out_dir)
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("megatron-branch: error: ")
    assert "Traceback" not in err
    for e in expect:
        assert e in lines[0], lines[0]
    assert tree(out_dir) == before
    return lines[0]


def copy_ckpt(assets: Path, tmp_path: Path, name: str = "mc") -> Path:
    dst = tmp_path / name
    shutil.copytree(assets / "mc", dst)
    return dst


def rerecord(ckpt: Path) -> None:
    """Rewrite the file record as a crafted checkpoint would (so only the content checks can catch it)."""
    meta_f = ckpt / "megatron_branch.json"
    meta = json.loads(meta_f.read_text())
    for name in meta["files"]:
        data = (ckpt / name).read_bytes()
        meta["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    meta_f.write_text(json.dumps(meta))


# --- rollouts -----------------------------------------------------------------------------------------------------
def test_rollout_longer_than_context(assets: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    argv = ["grad", "--hf", str(assets / "hf"), "--rollouts", str(assets / "long.jsonl")]
    refused([*argv, "--out", str(out / "g.safetensors")], out, capsys, "long.jsonl:3", "520", "512")
    # the explicit override accepts it
    assert main([*argv, "--out", str(out / "g.safetensors"), "--allow-longer-context"]) == 0
    assert (out / "g.safetensors").is_file()


@pytest.mark.parametrize(
    ("mask", "expect"),
    [("[1, 2]", "value 1 is 2"), ("[1]", "has 1 values"), ('{"a": 1}', "got dict"), ("[1, null]", "is null")],
)
def test_malformed_loss_mask(mask: str, expect: str, assets: Path, tmp_path: Path, capsys) -> None:
    bad = tmp_path / "mask.jsonl"
    bad.write_text(f'{{"prompt": [1], "response": [2, 3], "advantage": 1, "loss_mask": {mask}}}\n')
    out = tmp_path / "out"
    argv = ["grad", "--hf", str(assets / "hf"), "--rollouts", str(bad), "--out", str(out / "g.safetensors")]
    refused(
        [*argv, "--logprobs-out", str(out / "lp.jsonl")], out, capsys, "mask.jsonl:1", "loss_mask", expect
    )


# --- damaged checkpoints --------------------------------------------------------------------------------------------
def _delete(ck: Path) -> None:
    (ck / "__0_0.distcp").unlink()


def _truncate(ck: Path) -> None:
    f = ck / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:1000])


def _flip(ck: Path) -> None:
    f = ck / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF
    f.write_bytes(bytes(data))


def _truncate_rerecorded(ck: Path) -> None:  # a truncated shard whose record was rewritten to match
    _truncate(ck)
    rerecord(ck)


@pytest.mark.parametrize(
    ("damage", "expect"),
    [
        (_delete, ("__0_0.distcp is missing",)),
        (_truncate, ("__0_0.distcp is truncated", "1000 bytes")),
        (_flip, ("__0_0.distcp is damaged", "sha256")),
        (_truncate_rerecorded, ("__0_0.distcp is truncated", ".metadata places data up to byte")),
    ],
    ids=["deleted", "truncated", "bit-flip", "truncated-record-rewritten"],
)
@pytest.mark.parametrize("command", ["mcore-to-hf", "verify-conversion"])
def test_damaged_checkpoint_named_before_loading(
    damage, expect, command: str, assets: Path, tmp_path: Path, capsys
) -> None:
    ck = copy_ckpt(assets, tmp_path)
    damage(ck)
    out = tmp_path / "out"
    if command == "mcore-to-hf":
        argv = ["convert", "mcore-to-hf", "--mcore", str(ck), "--out", str(out / "hf")]
    else:
        argv = ["verify-conversion", "--hf", str(assets / "hf"), "--mcore", str(ck)]
    refused(argv, out, capsys, *expect)


# --- pickle payloads ---------------------------------------------------------------------------------------------
class Payload:
    """Unpickling this creates `marker` (builtins.open(marker, "w")): the marker proves code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (builtins.open, (self.marker, "w"))


def payload_bytes(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker))


def _byte_item_slot(ck: Path) -> tuple[str, int, int]:
    """(file, offset, length) of the first byte item (a megatron ShardedObject) in the shards."""
    with open(ck / ".metadata", "rb") as f:
        md = SafeMetadataUnpickler(f).load()
    for index, info in md.storage_data.items():
        if type(md.state_dict_metadata[index.fqn]).__name__ == "BytesStorageMetadata":
            return info.relative_path, info.offset, info.length
    raise AssertionError("no byte item")


def _tensor_item_slot(ck: Path) -> tuple[str, int, int]:
    with open(ck / ".metadata", "rb") as f:
        md = SafeMetadataUnpickler(f).load()
    for index, info in md.storage_data.items():
        if type(md.state_dict_metadata[index.fqn]).__name__ == "TensorStorageMetadata":
            return info.relative_path, info.offset, info.length
    raise AssertionError("no tensor item")


def _place(ck: Path, where: str, marker: Path) -> None:
    data = payload_bytes(marker)
    if where in ("byte-item", "tensor-item"):
        rel, off, length = (_byte_item_slot if where == "byte-item" else _tensor_item_slot)(ck)
        assert len(data) <= length
        f = ck / rel
        buf = bytearray(f.read_bytes())
        buf[off : off + length] = data + b"\0" * (length - len(data))
        f.write_bytes(bytes(buf))
    else:
        (ck / where).write_bytes(data)
    if where != "megatron_branch.json":
        rerecord(ck)  # a crafted checkpoint: the record matches, only the content checks stand


@pytest.mark.parametrize(
    "where",
    [".metadata", "common.pt", "metadata.json", "megatron_branch.json", "byte-item", "tensor-item", "obj.pt"],
)
def test_checkpoint_pickle_never_runs(
    where: str, assets: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # torch's default would be weights_only=False
    ck = copy_ckpt(assets, tmp_path)
    marker = tmp_path / "PWNED"
    _place(ck, where, marker)
    out = tmp_path / "out"
    refused(["convert", "mcore-to-hf", "--mcore", str(ck), "--out", str(out / "hf")], out, capsys)
    assert not marker.exists()


def test_plain_torch_load_would_run_the_payload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted check: the payload does run under torch.load when weights_only is not passed and the
    environment forces the default off (what megatron's common.pt loader would do)."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    marker = tmp_path / "PWNED"
    with pytest.warns(UserWarning), pytest.raises(Exception):  # noqa: B017 (the legacy loader then fails)
        torch.load(io.BytesIO(payload_bytes(marker)))
    assert marker.exists()


@pytest.mark.parametrize(
    ("where", "expect_rc"),
    [
        ("pytorch_model.bin", 0),  # beside the safetensors: never opened
        ("model.safetensors", 2),
        ("config.json", 2),
        ("generation_config.json", 0),  # never read
        ("bin-only", 2),  # only pickled weights: refused, not opened
    ],
)
def test_hf_folder_pickle_never_runs(
    where: str, expect_rc: int, assets: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    hf = tmp_path / "hf"
    shutil.copytree(assets / "hf", hf)
    marker = tmp_path / "PWNED"
    if where == "bin-only":
        (hf / "model.safetensors").unlink()
        (hf / "pytorch_model.bin").write_bytes(payload_bytes(marker))
    else:
        (hf / where).write_bytes(payload_bytes(marker))
    out = tmp_path / "out"
    argv = ["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(out / "mc")]
    if expect_rc == 2:
        refused(argv, out, capsys)
        refused(["verify-conversion", "--hf", str(hf), "--mcore", str(assets / "mc")], out, capsys)
    else:
        out.mkdir()
        assert main(argv) == 0
    assert not marker.exists()


# --- verify-conversion -------------------------------------------------------------------------------------------
def _edit_config(hf: Path, **changes: object) -> None:
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(changes)
    (hf / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("case", "expect"),
    [
        ("fake-safetensors", ("model.safetensors", "cannot read safetensors file")),
        ("hidden-size", ("hidden_size is 64", "describe different models")),
        ("gpt2", ("unsupported architecture 'GPT2LMHeadModel'",)),
        ("family", ("architecture mismatch", "is llama (LlamaForCausalLM)", "is qwen2 (Qwen2ForCausalLM)")),
        ("ffn-vs-tensors", ("gate_proj.weight' has shape",)),
    ],
)
def test_verify_conversion_refuses_bad_hf(case: str, expect, assets: Path, tmp_path: Path, capsys) -> None:
    hf = tmp_path / "hf"
    shutil.copytree(assets / ("llama" if case == "family" else "hf"), hf)
    mc = assets / "mc"
    if case == "fake-safetensors":
        (hf / "model.safetensors").write_bytes(b"not a safetensors file at all")
    elif case == "hidden-size":
        _edit_config(hf, hidden_size=64)
    elif case == "gpt2":
        _edit_config(hf, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    elif case == "ffn-vs-tensors":  # the config and the checkpoint agree, the HF tensors do not
        _edit_config(hf, intermediate_size=48)
        mc = tmp_path / "mc"
        shutil.copytree(assets / "mc", mc)
        meta = json.loads((mc / "megatron_branch.json").read_text())
        meta["arch"]["ffn_hidden_size"] = 48
        (mc / "megatron_branch.json").write_text(json.dumps(meta))
    out = tmp_path / "out"
    refused(["verify-conversion", "--hf", str(hf), "--mcore", str(mc)], out, capsys, *expect)


def test_verify_conversion_bf16_passes_by_default(assets: Path, tmp_path: Path, capsys) -> None:
    convert_hf_to_mcore(assets / "hf", tmp_path / "bf16", dtype="bfloat16", progress=False)
    capsys.readouterr()
    rc = main(["verify-conversion", "--hf", str(assets / "hf"), "--mcore", str(tmp_path / "bf16")])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0, report
    assert report["checkpoint_dtype"] == "bfloat16" and report["max_abs_diff"] <= 1e-4
    assert report["rounding_max_abs_diff"] > report["max_abs_diff"]  # the rounding is real, and reported


# --- outputs -------------------------------------------------------------------------------------------------------
def test_hf_to_mcore_outputs(assets: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "nonempty").mkdir()
    (out / "nonempty" / "keep.txt").write_text("mine")
    (out / "plainfile").write_text("x")
    base = ["convert", "hf-to-mcore", "--hf", str(assets / "hf"), "--out"]
    refused([*base, str(out / "nonempty")], out, capsys, "not empty; pass --overwrite")
    refused([*base, str(out / "nonempty"), "--overwrite"], out, capsys, "has no megatron_branch.json")
    refused([*base, str(out / "plainfile")], out, capsys, "is a file, not a folder")
    refused([*base, str(out / "no" / "such" / "mc")], out, capsys, "missing folders are not created")
    # an existing checkpoint is replaced with --overwrite only
    shutil.copytree(assets / "mc", out / "mc")
    refused([*base, str(out / "mc")], out, capsys, "pass --overwrite")
    old = os.umask(0o027)
    try:
        assert main([*base, str(out / "mc"), "--overwrite"]) == 0
    finally:
        os.umask(old)
    assert sorted(p.name for p in out.iterdir()) == ["mc", "nonempty", "plainfile"]  # no temp folders left
    assert (out / "mc").stat().st_mode & 0o777 == 0o750  # the umask's, not mkdtemp's 0700
    assert {p.stat().st_mode & 0o777 for p in (out / "mc").iterdir()} == {0o640}


def test_grad_outputs(assets: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "g.safetensors").write_bytes(b"old")
    base = ["grad", "--hf", str(assets / "hf"), "--rollouts", str(assets / "r.jsonl"), "--out"]
    refused([*base, str(out / "g.safetensors")], out, capsys, "already exists; pass --overwrite")
    refused([*base, str(out / "new.safetensors"), "--logprobs-out", str(out / "g.safetensors")], out, capsys)
    refused([*base, str(out / "missing" / "g.safetensors")], out, capsys, "does not exist")
    old = os.umask(0o022)
    try:
        assert main([*base, str(out / "g.safetensors"), "--overwrite"]) == 0
    finally:
        os.umask(old)
    assert (out / "g.safetensors").stat().st_size > 100
    assert (out / "g.safetensors").stat().st_mode & 0o777 == 0o644  # safetensors alone writes 0600


# --- flags and folders -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "expect"),
    [
        (["--sequence-parallel"], ("--sequence-parallel does nothing at --tp 1",)),
        (["--recompute", "--schedule", "naive"], ("--recompute applies to --schedule replay only",)),
        (
            ["--recompute-layers", "--schedule", "naive"],
            ("--recompute-layers applies to --schedule replay or packed",),
        ),
        (["--recompute", "--schedule", "packed"], ("--schedule packed ignores it",)),
    ],
)
def test_idle_flags_refused(extra: list[str], expect, assets: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    argv = ["grad", "--hf", str(assets / "hf"), "--rollouts", str(assets / "r.jsonl")]
    refused([*argv, "--out", str(out / "g.safetensors"), *extra], out, capsys, *expect)


def test_hf_pointing_at_a_file(assets: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    f = str(assets / "hf" / "config.json")
    argv = ["grad", "--hf", f, "--rollouts", str(assets / "r.jsonl"), "--out", str(out / "g.safetensors")]
    refused(argv, out, capsys, "is a file; give the Hugging Face model folder")
    refused(["convert", "hf-to-mcore", "--hf", f, "--out", str(out / "mc")], out, capsys, "is a file")
    refused(["verify-conversion", "--hf", f, "--mcore", str(assets / "mc")], out, capsys, "is a file")


@pytest.mark.parametrize(
    ("changes", "expect"),
    [
        ({"model_type": "mistral"}, "model_type 'mistral' (architectures says Qwen2ForCausalLM)"),
        ({"architectures": ["LlamaForCausalLM"]}, "model_type 'qwen2' does not match architectures"),
    ],
)
def test_model_type_named_right(changes, expect: str, assets: Path, tmp_path: Path, capsys) -> None:
    hf = tmp_path / "hf"
    shutil.copytree(assets / "hf", hf)
    _edit_config(hf, **changes)
    out = tmp_path / "out"
    argv = [
        "grad",
        "--hf",
        str(hf),
        "--rollouts",
        str(assets / "r.jsonl"),
        "--out",
        str(out / "g.safetensors"),
    ]
    refused(argv, out, capsys, expect)
