"""`megatron-branch train` under torchrun: DP2 resume equals an uninterrupted DP2 run; GRPO runs under TP2 and
DP2 with every rank seeing the same metrics; a CP2 GRPO run (with a checkpoint and resume in the middle) equals
the single-process run of the same config, and so does a CP2 run of a config-defined hybrid (gated delta net
layers); schedule.name=naive is refused under CP."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_helpers import shared_tmp, single_process_env
from train_helpers import KV_TASK, QUIET, TINY_ARCH, params, run_steps

from megatron_branch.cli import main
from megatron_branch.train.config_io import load_config
from megatron_branch.train.loop import Trainer
from megatron_branch.train.metrics import read_metrics
from megatron_branch.train.models import unwrap


def _cfg_overrides(out: Path) -> list[str]:
    return [TINY_ARCH, *KV_TASK, f"trainer.default_local_dir={out}", *QUIET, "checkpoint.hf_export=false"]


def _cfg(out: Path, *overrides: str):
    return load_config(None, [*_cfg_overrides(out), *overrides])


def _agree(value: object) -> None:
    """Every rank holds the same value."""
    got: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(got, value)
    assert all(g == got[0] for g in got), got


@pytest.mark.world(2)
def test_dp2_resume_equals_uninterrupted() -> None:
    tmp = shared_tmp("train-dist-")
    try:
        f64 = "model.dtype=float64"
        full, mfull = run_steps(_cfg(tmp / "full", f64, "trainer.total_training_steps=4"))
        part, m1 = run_steps(_cfg(tmp / "part", f64, "trainer.total_training_steps=2"))
        part.save()
        again, m2 = run_steps(
            _cfg(tmp / "part", f64, "trainer.total_training_steps=4", "trainer.resume_mode=auto")
        )
        assert again.groups.dp_size == 2 and again.step == 4
        for x, y in zip(mfull, m1 + m2, strict=True):
            assert x["_tokens"] == y["_tokens"], x["step"]
            for k in ("reward_mean", "loss"):
                assert abs(x[k] - y[k]) <= 1e-6, (x["step"], k)
        a, b = params(full), params(again)
        assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-9
        _agree([m["reward_mean"] for m in mfull])
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)


def _pairs_file(tmp: Path) -> Path:
    import json

    f = tmp / "pairs.jsonl"
    if dist.get_rank() == 0:
        rows = [{"prompt": f"k{i}:ab ? k{i}:", "chosen": "ab", "rejected": "ba"} for i in range(8)]
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dist.barrier()
    return f


ALGOS = {
    "grpo": [],
    "ppo": ["algorithm.name=ppo", "algorithm.lam=0.95", "critic.cliprange_value=0.5"],
    "dpo": ["algorithm.name=dpo"],
}


@pytest.mark.world(2)
@pytest.mark.parametrize("algo", sorted(ALGOS))
@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.tp=1"], ids=["tp2", "dp2"])
def test_algorithms_run_tp2_and_dp2(layout: str, algo: str) -> None:
    tmp = shared_tmp("train-dist-")
    try:
        extra = list(ALGOS[algo])
        if algo == "dpo":
            extra += [f"data.pairs_file={_pairs_file(tmp)}", "data.task=null"]
        tr = Trainer(
            _cfg(tmp / "run", layout, "trainer.total_training_steps=3", "trainer.save_freq=2", *extra)
        )
        summary = tr.run()  # the command's whole path: steps, metrics, save_freq, final checkpoint, curves
        dist.barrier()
        assert (tr.groups.tp_size, tr.groups.dp_size) == ((2, 1) if layout.endswith("2") else (1, 2))
        assert tr.store.steps() == [2, 3]  # one shared folder: every rank sees rank 0's checkpoints
        rows = read_metrics(summary["metrics"])
        assert [m["step"] for m in rows] == [1, 2, 3]
        assert all(torch.isfinite(torch.tensor(m["loss"])) for m in rows)
        want = {"grpo": "actor/pg_clipfrac", "ppo": "critic/vf_loss", "dpo": "rewards/margins"}[algo]
        assert all(want in m for m in rows)
        _agree([r.response for r in tr.last_batch])  # every rank trained on the same global batch
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)


# The single-process reference, run by rank 0 in a fresh interpreter with no torchrun environment (a world of one):
# the sampled tokens and rewards of every step and the final parameters.
_SINGLE = """
import json, sys, torch
from megatron_branch.train.config_io import load_config
from megatron_branch.train.loop import Trainer
from megatron_branch.train.models import unwrap
cfg = load_config(None, json.loads(sys.argv[1]))
tr, rows = Trainer(cfg), []
while tr.step < cfg.trainer.total_training_steps:
    tr.train_step()
    rows.append(([r.response for r in tr.last_batch], tr.last_rewards))
params = {k: v for k, v in unwrap(tr.policy).state_dict().items() if isinstance(v, torch.Tensor)}
torch.save({"rows": rows, "params": params, "world": torch.distributed.get_world_size()}, sys.argv[2])
"""


def _single_process(overrides: list[str], out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _SINGLE, json.dumps(overrides), str(out)], env=single_process_env()
    )


@pytest.mark.world(2)
def test_cp2_grpo_with_resume_equals_single_process() -> None:
    tmp = shared_tmp("train-dist-")
    try:
        common = ["model.dtype=float64", "schedule.name=replay"]
        single = [*_cfg_overrides(tmp / "single"), *common, "trainer.total_training_steps=3"]
        ref_proc = _single_process(single, tmp / "single.pt") if dist.get_rank() == 0 else None
        cp2 = [*common, "parallel.cp=2"]
        part, m1 = run_steps(_cfg(tmp / "cp2", *cp2, "trainer.total_training_steps=2"))
        assert (part.groups.cp_size, part.groups.dp_size, part.groups.tp_size) == (2, 1, 1)
        part.save()
        again, m2 = run_steps(
            _cfg(tmp / "cp2", *cp2, "trainer.total_training_steps=3", "trainer.resume_mode=auto")
        )
        assert again.step == 3 and len(m2) == 1
        rc = [ref_proc.wait(timeout=600) if ref_proc is not None else 0]
        dist.broadcast_object_list(rc, src=0)
        assert rc == [0], "the single-process reference run failed"
        ref = torch.load(tmp / "single.pt", weights_only=False)
        assert ref["world"] == 1
        got = [(m["_tokens"], m["_rewards"]) for m in m1 + m2]
        assert got == ref["rows"]  # the same sampled tokens and rewards at every step (both CP ranks)
        assert len({tuple(map(tuple, t)) for t, _ in got}) == 3  # the steps sampled different batches
        mine = params(again)
        assert sorted(mine) == sorted(ref["params"])
        err = max(float((mine[k] - ref["params"][k]).abs().max()) for k in mine)
        assert err < 1e-9, err
        _agree([m["reward_mean"] for m in m1 + m2])
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)


HYBRID = (
    "model.arch={family: qwen3_5, hidden_size: 16, num_layers: 2, num_attention_heads: 2, num_query_groups: 1, "
    "head_dim: 8, ffn_hidden_size: 32, max_position_embeddings: 64, rotary_percent: 0.5, "
    "layer_types: [linear_attention, full_attention], linear_key_head_dim: 4, linear_value_head_dim: 4, "
    "linear_num_key_heads: 1, linear_num_value_heads: 2}"
)
"""tests/unit/test_gdn_train.py's config-defined hybrid: 1 key / 2 value GDN heads, so under CP2 each rank runs one
value head, the key head shared (the head exchange, models/gdn_heads.py)."""


NEMOTRON_H = (
    "model.arch={family: nemotron_h, hidden_size: 16, num_layers: 3, num_attention_heads: 2, num_query_groups: 1, "
    "head_dim: 8, ffn_hidden_size: 32, max_position_embeddings: 64, hybrid_override_pattern: 'M*-', "
    "mlp_activation: relu2, position_embedding: none, mamba_num_heads: 2, mamba_head_dim: 8, mamba_state_dim: 4, "
    "mamba_num_groups: 1, mamba_chunk_size: 8, mamba_dt_min: 0.001, rms_norm_eps: 1.0e-5}"
)
"""tests/unit/test_nemotron_h_train.py's config-defined Nemotron-H: 2 Mamba heads in 1 group, so under CP2 each rank
runs one head, the group's B / C on both (the head exchange, models/mamba_heads.py)."""


@pytest.mark.world(2)
@pytest.mark.parametrize("model", [HYBRID, NEMOTRON_H], ids=["qwen3_5", "nemotron_h"])
def test_cp2_hybrid_grpo_equals_single_process(model: str) -> None:
    """A config-defined hybrid (Qwen3.5-style, Nemotron-H) trains with parallel.cp=2 (the ring for its attention
    layer, the head exchange for its gated delta net or Mamba-2 layer) and equals the single-process run: the same
    sampled tokens and rewards, parameters within the float32 rounding of the delta rule / SSD scan (both compute in
    float32 whatever the model dtype)."""
    tmp = shared_tmp("train-dist-")
    try:
        common = [model, "model.dtype=float64", "schedule.name=replay", "trainer.total_training_steps=2"]
        single = [*_cfg_overrides(tmp / "single"), *common]
        ref_proc = _single_process(single, tmp / "single.pt") if dist.get_rank() == 0 else None
        tr, rows = run_steps(_cfg(tmp / "cp2", *common, "parallel.cp=2"))
        arch = unwrap(tr.policy).arch
        assert (tr.groups.cp_size, tr.groups.dp_size) == (2, 1) and (
            arch.is_hybrid or arch.hybrid_override_pattern
        )
        rc = [ref_proc.wait(timeout=600) if ref_proc is not None else 0]
        dist.broadcast_object_list(rc, src=0)
        assert rc == [0], "the single-process reference run failed"
        ref = torch.load(tmp / "single.pt", weights_only=False)
        assert [(m["_tokens"], m["_rewards"]) for m in rows] == ref["rows"]
        mine = params(tr)
        assert sorted(mine) == sorted(ref["params"])
        err = max(float((mine[k] - ref["params"][k]).abs().max()) for k in mine)
        assert err < 1e-6, err
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.world(2)
def test_naive_schedule_refused_under_cp(capsys) -> None:
    tmp = shared_tmp("train-dist-")
    try:
        cfg_file = tmp / "empty.yaml"
        if dist.get_rank() == 0:
            cfg_file.write_text("{}\n")
        dist.barrier()
        capsys.readouterr()
        rc = main(
            ["train", str(cfg_file), *_cfg_overrides(tmp / "run"), "schedule.name=naive", "parallel.cp=2"]
        )
        err = capsys.readouterr().err
        rcs: list[int | None] = [None] * dist.get_world_size()
        dist.all_gather_object(rcs, rc)
        assert rcs == [2, 2]
        lines = [ln for ln in err.splitlines() if ln.strip()]
        if dist.get_rank() == 0:
            assert len(lines) == 1 and "schedule.name=naive has no context parallelism" in lines[0], err
        else:
            assert lines == [], err
        assert not (tmp / "run").exists()  # refused before anything was written
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
