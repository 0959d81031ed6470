"""Dist-checkpoint I/O: the sharding check raises (on every rank) instead of hanging, the synchronous writer makes
a checkpoint megatron loads, and a model built without random init carries megatron's tensor-parallel attributes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_branch.checkpoint.dist_ckpt import CheckpointError, check_sharding, load_sharded, save_sharded
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel


def _arch(tie: bool) -> ModelArch:
    return ModelArch(
        family="qwen2",
        vocab_size=37,
        hidden_size=16,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=24,
        qkv_bias=True,
        tie_word_embeddings=tie,
    )


def _tp_attrs(model: torch.nn.Module) -> dict[str, dict]:
    return {
        n: {k: v for k, v in vars(p).items() if not k.startswith("_")} for n, p in model.named_parameters()
    }


@pytest.mark.parametrize("tie", [False, True])
def test_model_without_init_has_megatrons_tp_attributes(tie: bool) -> None:
    initialize_parallel(ParallelConfig(tp=1))
    with_init = build_model(_arch(tie))
    without = build_model(_arch(tie), init_weights=False)
    ref = _tp_attrs(with_init)
    assert ref["decoder.layers.0.mlp.linear_fc1.weight"]["partition_stride"] == 2  # what we mirror
    assert _tp_attrs(without) == ref


def test_sharding_check_raises_instead_of_hanging() -> None:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    initialize_parallel(ParallelConfig(tp=1))
    # Half of a [4, 2] tensor with no rank holding the other half: megatron raises on rank 0 only.
    half = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 2), (0, 0, 2), replica_id=0)
    with pytest.raises(CheckpointError, match="invalid sharding"):
        check_sharding({"w": half})
    check_sharding({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 2), replica_id=0)})


def test_sync_writer_roundtrip(tmp_path: Path) -> None:
    initialize_parallel(ParallelConfig(tp=1))
    src = build_model(_arch(False))
    save_sharded(src.sharded_state_dict(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "common.pt",
        "metadata.json",
    ]
    dst = build_model(_arch(False), init_weights=False)
    dst.load_state_dict(load_sharded(dst.sharded_state_dict(), tmp_path), strict=True)
    for (n, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items(), strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), n


def test_ctrl_c_while_saving_or_loading_stays_a_keyboard_interrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's checkpoint collectives wrap every rank's BaseException into a CheckpointException: a Ctrl-C while a
    shard is written (or read) must come out as the KeyboardInterrupt it was (the command's interrupted line, exit
    130), not as torch's traceback (exit 1) or a "cannot load" user error (exit 2)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from megatron_branch.checkpoint import integrity

    initialize_parallel(ParallelConfig(tp=1))
    src = build_model(_arch(False))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()

    def interrupted(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(integrity.HashingStream, "write", interrupted)
        with pytest.raises(KeyboardInterrupt):
            save_sharded(src.sharded_state_dict(), tmp_path / "a")
    save_sharded(src.sharded_state_dict(), tmp_path / "b")
    monkeypatch.setattr(FileSystemReader, "read_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_sharded(build_model(_arch(False), init_weights=False).sharded_state_dict(), tmp_path / "b")


def test_file_record_hashed_while_writing_and_checked_on_load(tmp_path: Path) -> None:
    """The record save_sharded returns equals the files on disk; load_sharded refuses a file that differs."""
    import hashlib

    from megatron_branch.errors import UserError

    initialize_parallel(ParallelConfig(tp=1))
    src = build_model(_arch(False))
    files = save_sharded(src.sharded_state_dict(), tmp_path)
    on_disk = {
        p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in tmp_path.iterdir()
    }
    assert files == on_disk
    dst = build_model(_arch(False), init_weights=False)
    load_sharded(dst.sharded_state_dict(), tmp_path, files=files)
    shard = tmp_path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"__0_0.distcp is damaged: its sha256 differs"):
        load_sharded(dst.sharded_state_dict(), tmp_path, files=files)


def test_rng_states_as_sharded_objects_load_safely(tmp_path: Path) -> None:
    """What a training checkpoint holds (torch, Python and numpy RNG states as a ShardedObject): accepted by the
    weights_only=True check of byte items and loaded back equal."""
    import random

    import numpy as np
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    initialize_parallel(ParallelConfig(tp=1))
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}

    def sd(obj):
        w = ShardedTensor.from_rank_offsets("w", torch.arange(6.0).reshape(2, 3), replica_id=0)
        return {"w": w, "rng": ShardedObject("rng", obj, (1,), (0,), replica_id=0)}

    files = save_sharded(sd(state), tmp_path)
    got = load_sharded(sd(None), tmp_path, files=files)
    assert torch.equal(got["rng"]["torch"], state["torch"]) and got["rng"]["python"] == state["python"]
    assert np.array_equal(got["rng"]["numpy"][1], state["numpy"][1])
    assert torch.equal(got["w"], torch.arange(6.0).reshape(2, 3))
