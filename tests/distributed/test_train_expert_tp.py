"""`train` with every expert whole on each TP rank (TP2 + SP, parallel.etp=1) against the same run with the experts
split over TP (parallel.etp = parallel.tp), float64, on every rank.

    python tests/distributed/launch.py 2 -k expert_tp
    python tests/distributed/launch.py 4 -k expert_tp1_with_expert_parallel   # beside EP2 (two replicas)

A tiny Qwen3-MoE from one HF checkpoint (the same weights under both layouts) trained 4 steps with gradient clipping
active (optim.clip_grad below every step's norm), with megatron's plain (and a KL to the reference model) and
distributed optimizer: the same tokens,
loss and grad norm every step on every rank, the same parameters at the end (1e-9); a run stopped after 2 steps and
resumed equals the uninterrupted one. Planted: megatron's grad norm left as megatron-core 0.16.1 computes it for whole
experts (models/expert_tp.py count_whole_experts_in_grad_norm undone): TP rank 1 of the plain optimizer counts no
expert (its norm, and so its clipping, differ from rank 0's), the distributed optimizer drops TP rank 1's shards.
PPO's critic at etp=1 equals the critic at etp = tp (2 steps).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_helpers import shared_tmp
from train_helpers import KV_TASK, QUIET, run_steps

ARCH = (
    "model.arch={family: qwen3_moe, hidden_size: 16, num_layers: 2, num_attention_heads: 2, "
    "num_query_groups: 2, ffn_hidden_size: 32, num_experts: 4, moe_top_k: 2, moe_ffn_hidden_size: 8}"
)
TP2 = ["parallel.tp=2", "parallel.sequence_parallel=true"]
CLIP = 0.05  # every step with a gradient has a norm above it (measured 1.3 and 1.5): clipping scales each one


def _cfg(hf: Path | None, out: Path, *overrides: str):  # noqa: ANN202
    from megatron_branch.train.config_io import load_config

    model = f"model.hf_path={hf}" if hf is not None else ARCH
    base = [model, "model.dtype=float64", *KV_TASK, f"trainer.default_local_dir={out}", *QUIET,
            "checkpoint.hf_export=false", f"optim.clip_grad={CLIP}"]  # fmt: skip
    return load_config(None, [*base, *overrides])


@pytest.fixture(scope="module")
def hf_dir() -> tuple[Path, Path]:
    """(folder for the runs, a tiny Qwen3-MoE HF checkpoint with the task tokenizer's vocabulary) on every rank."""
    from megatron_branch.testing import tiny_hf_config, tiny_hf_model
    from megatron_branch.train.loop import Trainer

    d = shared_tmp("train_expert_tp_")
    vocab = Trainer(_cfg(None, d / "probe", "trainer.total_training_steps=1")).arch.vocab_size
    if dist.get_rank() == 0:
        cfg = tiny_hf_config(
            "qwen3_moe", vocab_size=vocab, hidden_size=16, num_layers=2, heads=2, kv_heads=2, ffn=32
        )
        tiny_hf_model(cfg, seed=5).save_pretrained(d / "hf")
    dist.barrier()
    return d, d / "hf"


def _run(cfg, save: bool = False) -> tuple[list[dict], dict[str, torch.Tensor], int]:  # noqa: ANN001
    """(per-step metrics, the full parameters, expert TP size) of a run; the parameters gathered now (the next
    Trainer lays the groups out anew)."""
    from megatron_branch.checkpoint.tp import gather_full_state
    from megatron_branch.train.models import unwrap

    tr, rows = run_steps(cfg)
    if save:
        tr.save()
    return rows, gather_full_state(unwrap(tr.policy), tr.groups.tp, tr.groups.ep), tr.groups.etp_size


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _norms(rows: list[dict]) -> list[float]:
    return [r["actor/grad_norm"] for r in rows]


def _same_run(got: tuple, want: tuple) -> None:
    (rows, a, _), (rows_w, b, _) = got, want
    assert [r["_tokens"] for r in rows] == [r["_tokens"] for r in rows_w]
    for r, w in zip(rows, rows_w):
        assert _rel(r["actor/grad_norm"], w["actor/grad_norm"]) <= 1e-9, (
            r["step"],
            _norms(rows),
            _norms(rows_w),
        )
        assert abs(r["actor/pg_loss"] - w["actor/pg_loss"]) <= 1e-9
    assert set(a) == set(b)
    for n in a:
        assert ((a[n] - b[n]).norm() / b[n].norm().clamp(min=1e-30)) <= 1e-9, n


@pytest.mark.world(2)
@pytest.mark.parametrize("optimizer", ["plain", "distributed"])
def test_train_with_whole_experts_equals_experts_split_over_tp(hf_dir, optimizer: str) -> None:
    d, hf = hf_dir
    opt = [f"optim.use_distributed_optimizer={optimizer == 'distributed'}"]
    if optimizer == "plain":  # with a KL to the reference model: a frozen copy built at the run's expert TP
        opt.append("actor.kl_loss_coef=0.01")
    steps = ["trainer.total_training_steps=4"]
    split = _run(_cfg(hf, d / f"split_{optimizer}", *TP2, *opt, *steps))
    whole = _run(_cfg(hf, d / f"whole_{optimizer}", *TP2, "parallel.etp=1", *opt, *steps))
    assert (whole[2], split[2]) == (1, 2)
    assert sum(n > CLIP for n in _norms(split[0])) >= 2  # clipping active on the steps that move the weights
    _same_run(whole, split)
    if optimizer == "distributed":  # stopped after 2 steps, saved, resumed to 4: the uninterrupted run
        _run(_cfg(hf, d / "part", *TP2, "parallel.etp=1", *opt, "trainer.total_training_steps=2"), save=True)
        again = _run(_cfg(hf, d / "part", *TP2, "parallel.etp=1", *opt, *steps, "trainer.resume_mode=auto"))
        _same_run(again, (whole[0][2:], whole[1], 1))


@pytest.mark.world(2)
def test_ppo_critic_with_whole_experts_equals_experts_split_over_tp(hf_dir) -> None:  # noqa: ANN001
    """PPO's critic (a MoE trunk like the policy's) built at the run's expert TP: 2 PPO steps at parallel.etp=1 equal
    the run at etp = tp (tokens, both losses and grad norms, every critic parameter; before: an AssertionError on
    every rank, the critic built for expert TP 2 in a world whose experts' TP group has 1 rank)."""
    from megatron_branch.checkpoint.tp import gather_full_state
    from megatron_branch.train.models import unwrap

    d, hf = hf_dir
    ppo = ["algorithm.name=ppo", "algorithm.lam=0.95", "trainer.total_training_steps=2"]
    runs = []
    for name, etp in (("split", []), ("whole", ["parallel.etp=1"])):
        tr, rows = run_steps(_cfg(hf, d / f"ppo_{name}", *TP2, *etp, *ppo))
        critic = gather_full_state(unwrap(tr.actor.critic.model), tr.groups.tp, tr.groups.ep)
        runs.append((rows, critic, tr.groups.etp_size))
    (split, a, e_split), (whole, b, e_whole) = runs
    assert (e_whole, e_split) == (1, 2)
    assert [r["_tokens"] for r in whole] == [r["_tokens"] for r in split]
    for r, w in zip(whole, split, strict=True):
        for k in ("actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
            assert _rel(r[k], w[k]) <= 1e-9, (r["step"], k)
        assert w["critic/grad_norm"] > 0
    assert set(a) == set(b)
    for n in a:
        assert ((b[n] - a[n]).norm() / a[n].norm().clamp(min=1e-30)) <= 1e-9, n


@pytest.mark.world(2)
@pytest.mark.parametrize("optimizer", ["plain", "distributed"])
def test_planted_grad_norm_without_the_whole_experts_fails(hf_dir, optimizer: str, monkeypatch) -> None:  # noqa: ANN001
    from megatron_branch.models import expert_tp

    d, hf = hf_dir
    monkeypatch.setattr(expert_tp, "count_whole_experts_in_grad_norm", lambda optimizer, model: None)
    opt = [f"optim.use_distributed_optimizer={optimizer == 'distributed'}", "trainer.total_training_steps=3"]
    split = _run(_cfg(hf, d / f"planted_split_{optimizer}", *TP2, *opt))
    whole = _run(_cfg(hf, d / f"planted_whole_{optimizer}", *TP2, "parallel.etp=1", *opt))
    worst = max(_rel(a, b) for a, b in zip(_norms(whole[0]), _norms(split[0])))
    rank0 = dist.get_rank() == 0
    if optimizer == "plain":  # rank 0 counts every expert; rank 1 none
        assert (worst <= 1e-9) if rank0 else (worst > 1e-3), (dist.get_rank(), worst)
    else:
        assert worst > 1e-3, (dist.get_rank(), worst)


@pytest.mark.world(4)
def test_train_expert_tp1_with_expert_parallel_world4(hf_dir, monkeypatch) -> None:  # noqa: ANN001
    """TP2 + SP, EP2 (two replicas), the distributed optimizer, 3 steps: expert TP 1 (EP over each replica's TP
    ranks) == expert TP 2 (EP across the replicas) step by step on every rank (tokens, loss, grad norm 1e-9) and
    in the parameters (1e-9). Planted: both EP ranks loading the first experts (the EP rank's offset ignored)
    fails, so the experts really are split over the TP ranks."""
    from megatron_branch.checkpoint import experts

    d, hf = hf_dir
    opt = ["optim.use_distributed_optimizer=true", "trainer.total_training_steps=3", "parallel.ep=2"]
    split = _run(_cfg(hf, d / "ep2_split", *TP2, *opt))
    whole = _run(_cfg(hf, d / "ep2_whole", *TP2, "parallel.etp=1", *opt))
    assert (whole[2], split[2]) == (1, 2)
    _same_run(whole, split)
    real = experts.local_name
    monkeypatch.setattr(experts, "local_name", lambda name, ep_rank, n: real(name, 0, n))
    planted = _run(_cfg(hf, d / "ep2_planted", *TP2, "parallel.etp=1", *opt))
    worst = max(float((planted[1][n] - t).norm() / t.norm().clamp(min=1e-30)) for n, t in split[1].items())
    assert worst > 1e-3, (dist.get_rank(), worst)
