"""`megatron-branch train` under torchrun: DP2 resume equals an uninterrupted DP2 run; GRPO runs under TP2 and
DP2 with every rank seeing the same metrics."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_branch.train.config import load_config
from megatron_branch.train.loop import Trainer
from megatron_branch.train.metrics import read_metrics
from megatron_branch.train.models import unwrap


def shared_tmp() -> Path:
    box = [tempfile.mkdtemp(prefix="train-dist-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _cfg(out: Path, *overrides: str):
    base = [
        "model.arch={hidden_size: 16, num_layers: 2, num_attention_heads: 2, num_query_groups: 2, "
        "ffn_hidden_size: 32, max_position_embeddings: 64}",
        "data.task=kv_retrieval",
        "data.task_args={num_pairs: 2, value_len: 2, value_chars: abcd}",
        "data.num_prompts=16",
        "data.train_batch_size=2",
        "rollout.n=2",
        "rollout.response_length=3",
        "optim.lr=0.01",
        f"trainer.default_local_dir={out}",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.plot=false",
        "checkpoint.hf_export=false",
    ]
    return load_config(None, [*base, *overrides])


def _run(cfg) -> tuple[Trainer, list[dict]]:
    tr = Trainer(cfg)
    rows = []
    while tr.step < cfg.trainer.total_training_steps:
        m = tr.train_step()
        m["_tokens"] = [r.response for r in tr.last_batch]
        rows.append(m)
    return tr, rows


def _params(tr: Trainer) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().clone()
        for k, v in unwrap(tr.policy).state_dict().items()
        if isinstance(v, torch.Tensor)
    }


def _agree(value: object) -> None:
    """Every rank holds the same value."""
    got: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(got, value)
    assert all(g == got[0] for g in got), got


@pytest.mark.world(2)
def test_dp2_resume_equals_uninterrupted() -> None:
    tmp = shared_tmp()
    try:
        f64 = "model.dtype=float64"
        full, mfull = _run(_cfg(tmp / "full", f64, "trainer.total_training_steps=4"))
        part, m1 = _run(_cfg(tmp / "part", f64, "trainer.total_training_steps=2"))
        part.save()
        again, m2 = _run(
            _cfg(tmp / "part", f64, "trainer.total_training_steps=4", "trainer.resume_mode=auto")
        )
        assert again.groups.dp_size == 2 and again.step == 4
        for x, y in zip(mfull, m1 + m2, strict=True):
            assert x["_tokens"] == y["_tokens"], x["step"]
            for k in ("reward_mean", "loss"):
                assert abs(x[k] - y[k]) <= 1e-6, (x["step"], k)
        a, b = _params(full), _params(again)
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
    tmp = shared_tmp()
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
