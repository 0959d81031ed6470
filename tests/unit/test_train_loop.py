"""`megatron-branch train`: schedules give the same run, resume equals an uninterrupted run, a crash mid-save keeps
the previous checkpoint, and bad config or data is one line with no run folder left behind.

Tiny everything: a 2-layer width-16 policy, a character tokenizer trained at start-up, 2 prompts x G=2 per step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_helpers import QUIET
from train_helpers import max_rel as _max_rel
from train_helpers import params as _params  # noqa: F401 (tests beside it import these names)
from train_helpers import run_steps as _run

from megatron_branch.errors import UserError
from megatron_branch.train.config_io import load_config
from megatron_branch.train.loop import Trainer

REWARD_MODULE = '''
def reward(prompt, response, row):
    """Fraction of the answer's characters in place."""
    want = row["answer"]
    return sum(a == b for a, b in zip(response, want)) / len(want)
'''


@pytest.fixture
def task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A JSONL of copy prompts and an importable reward module."""
    import random

    (tmp_path / "copy_reward.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    rng = random.Random(0)
    rows = []
    for _ in range(16):
        w = "".join(rng.choice("abcd") for _ in range(3))
        rows.append({"prompt": f"copy {w} :", "answer": w})
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def _cfg(task: Path, out: Path, *overrides: str):
    base = [
        "model.arch={hidden_size: 16, num_layers: 2, num_attention_heads: 2, num_query_groups: 1, "
        "ffn_hidden_size: 32, max_position_embeddings: 64}",
        f"data.train_files={task}",
        "data.reward=copy_reward:reward",
        "data.train_batch_size=2",
        "rollout.n=2",
        "rollout.response_length=4",
        "optim.lr=0.01",
        "optim.clip_grad=0",
        f"trainer.default_local_dir={out}",
        *QUIET,
        "checkpoint.hf_export=false",
    ]
    return load_config(None, [*base, *overrides])


@pytest.mark.slow
def test_naive_and_replay_same_run_float64(task: Path, tmp_path: Path) -> None:
    runs = {}
    full = ("schedule.recompute=true", "schedule.enable_gradient_checkpointing=true")  # the planner's `full`
    for name, sched, extra in (("naive", "naive", ()), ("replay", "replay", ()), ("full", "replay", full)):
        cfg = _cfg(task, tmp_path / name, "model.dtype=float64", "trainer.total_training_steps=10",
                   f"schedule.name={sched}", *extra)  # fmt: skip
        runs[name] = _run(cfg)
    (a, ma), (b, mb) = runs["naive"], runs["replay"]
    assert _max_rel(_params(a), _params(runs["full"][0])) < 1e-9
    for x, y in zip(ma, mb, strict=True):
        assert x["_tokens"] == y["_tokens"], x["step"]
        assert x["_rewards"] == y["_rewards"], x["step"]
    assert len({tuple(m["_rewards"]) for m in ma}) > 1  # the policy moved: not a trivially constant run
    assert _max_rel(_params(a), _params(b)) < 1e-9
    assert ma[-1]["positions_computed"] == ma[-1]["positions_logical"]  # naive computes every position
    assert mb[-1]["positions_computed"] < mb[-1]["positions_logical"]  # replay shares each prompt


def test_naive_and_replay_losses_float32(task: Path, tmp_path: Path) -> None:
    losses = {}
    for sched in ("naive", "replay"):
        cfg = _cfg(task, tmp_path / sched, "trainer.total_training_steps=5", f"schedule.name={sched}")
        losses[sched] = [m["loss"] for m in _run(cfg)[1]]
    for x, y in zip(losses["naive"], losses["replay"], strict=True):
        assert abs(x - y) <= 1e-5 * max(1.0, abs(x))


@pytest.mark.slow
def test_resume_equals_uninterrupted(task: Path, tmp_path: Path) -> None:
    full, mfull = _run(_cfg(task, tmp_path / "full", "model.dtype=float64", "trainer.total_training_steps=4"))
    first, m1 = _run(_cfg(task, tmp_path / "part", "model.dtype=float64", "trainer.total_training_steps=2"))
    first.save()
    again, m2 = _run(
        _cfg(task, tmp_path / "part", "model.dtype=float64", "trainer.total_training_steps=4",
             "trainer.resume_mode=auto")
    )  # fmt: skip
    assert again.step == 4 and len(m2) == 2
    for x, y in zip(mfull, m1 + m2, strict=True):
        assert x["_tokens"] == y["_tokens"]
        for k in ("reward_mean", "loss"):
            assert abs(x[k] - y[k]) <= 1e-6, (x["step"], k)
    assert _max_rel(_params(full), _params(again)) < 1e-9


@pytest.mark.slow
def test_distributed_and_offloaded_optimizer_train_the_same_run(task: Path, tmp_path: Path) -> None:
    """optim.use_distributed_optimizer and optim.optimizer_cpu_offload (half the state on the host; a world of
    one, so the shards are whole) train the plain optimizer's run, through a checkpoint and resume."""
    f64 = "model.dtype=float64"
    plain, mplain = _run(_cfg(task, tmp_path / "plain", f64, "trainer.total_training_steps=3"))
    offload = [f"optim.{k}=true" for k in ("use_distributed_optimizer", "use_precision_aware_optimizer",
                                           "optimizer_cpu_offload")] + ["optim.optimizer_offload_fraction=0.5"]  # fmt: skip
    part, m1 = _run(_cfg(task, tmp_path / "off", f64, "trainer.total_training_steps=2", *offload))
    part.save()
    again, m2 = _run(
        _cfg(
            task,
            tmp_path / "off",
            f64,
            "trainer.total_training_steps=3",
            "trainer.resume_mode=auto",
            *offload,
        )
    )
    assert (
        again.step == 3
        and type(again.actor.policy.optimizer.chained_optimizers[0]).__name__ == "DistributedOptimizer"
    )
    for x, y in zip(mplain, m1 + m2, strict=True):
        assert x["_tokens"] == y["_tokens"], x["step"]
    assert _max_rel(_params(plain), _params(again)) < 1e-9


def test_crash_mid_save_keeps_previous_checkpoint(task: Path, tmp_path: Path, monkeypatch) -> None:
    import megatron_branch.checkpoint.store as store_mod

    tr, _ = _run(_cfg(task, tmp_path / "run", "trainer.total_training_steps=1"))
    good = tr.save()
    saved = _params(tr)
    tr.train_step()
    real = store_mod.save_sharded

    def crash(sd, path):  # writes the shards, then dies before the state file and the rename
        real(sd, path)
        raise RuntimeError("planted crash")

    monkeypatch.setattr(store_mod, "save_sharded", crash)
    with pytest.raises(RuntimeError, match="planted"):
        tr.save()
    monkeypatch.setattr(store_mod, "save_sharded", real)
    assert tr.store.newest_verified(print) == good and tr.store.steps() == [1]
    resumed = Trainer(
        _cfg(task, tmp_path / "run", "trainer.total_training_steps=3", "trainer.resume_mode=auto")
    )
    assert resumed.step == 1
    assert _max_rel(_params(resumed), saved) == 0
    resumed.save()
    assert not list((tmp_path / "run" / "checkpoints").glob(".step_*"))  # the next save cleared the debris


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda t: t.write_text('{"prompt": "ok"}\n{"prompt": 3}\n'),
            r"prompts\.jsonl:2: 'prompt' must be a non-empty string",
        ),
        (lambda t: t.write_text('{"prompt": "ok"}\nnot json\n'), r"prompts\.jsonl:2: invalid JSON"),
        (lambda t: t.write_text('{"prompt": "' + "x" * 80 + '"}\n'), r"exceeds the model's context of 64"),
    ],
)
def test_bad_data_leaves_no_run_folder(task: Path, tmp_path: Path, mutate, message: str) -> None:
    mutate(task)
    out = tmp_path / "out"
    with pytest.raises(UserError, match=message) as e:
        Trainer(_cfg(task, out))
    assert "\n" not in str(e.value)
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.slow
def test_command_line_error_is_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {arch: {}}\ndata: {task: x}\nrollout: {nn: 3}\n")
    p = subprocess.run(
        [sys.executable, "-m", "megatron_branch", "train", str(cfg), "optim.lr=1e-5"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if "error" in ln]
    assert lines == [
        f"megatron-branch: error: {cfg}: unknown config key rollout.nn (did you mean rollout.n?)"
    ]


@pytest.mark.slow
def test_ppo_with_critic_resumes_exactly(task: Path, tmp_path: Path) -> None:
    """PPO: the critic (weights, optimizer, scheduler) is checkpointed too, so 2 + resume + 1 == 3 steps."""
    ppo = ("algorithm.name=ppo", "algorithm.lam=0.95", "model.dtype=float64", "actor.kl_loss_coef=0.01")
    full, mfull = _run(_cfg(task, tmp_path / "full", *ppo, "trainer.total_training_steps=3"))
    part, _ = _run(_cfg(task, tmp_path / "part", *ppo, "trainer.total_training_steps=2"))
    part.save()
    again, m2 = _run(
        _cfg(task, tmp_path / "part", *ppo, "trainer.total_training_steps=3", "trainer.resume_mode=auto")
    )
    assert all("critic/vf_loss" in m and "actor/kl_loss" in m for m in mfull)
    for k in ("loss", "critic/vf_loss", "actor/kl_loss"):
        assert abs(mfull[-1][k] - m2[-1][k]) <= 1e-9 * max(1.0, abs(mfull[-1][k])), k
    assert _max_rel(_params(full), _params(again)) < 1e-9

    def crit(tr: Trainer) -> dict[str, torch.Tensor]:
        return {k: v for k, v in tr.actor.critic.model.state_dict().items() if isinstance(v, torch.Tensor)}

    assert _max_rel(crit(full), crit(again)) < 1e-9


@pytest.mark.slow
def test_dpo_from_pairs(tmp_path: Path) -> None:
    """DPO on a JSONL of pairs: no sampling; the implicit reward margin grows on pairs the policy keeps seeing."""
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"say {c}:", "chosen": c * 2, "rejected": "x" + c} for c in "abcd"]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _cfg(pairs, tmp_path / "dpo", "algorithm.name=dpo", f"data.pairs_file={pairs}", "data.train_files=null",
               "data.reward=null", "data.train_batch_size=4", "trainer.total_training_steps=4")  # fmt: skip
    _, m = _run(cfg)
    assert [x["step"] for x in m] == [1, 2, 3, 4]
    assert m[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at the start
    assert m[-1]["rewards/margins"] > 0 and m[-1]["loss"] < m[0]["loss"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "p", "chosen": "a"}\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:1: field 'rejected'"):
        Trainer(
            _cfg(bad, tmp_path / "x", "algorithm.name=dpo", f"data.pairs_file={bad}", "data.train_files=null")
        )
    assert not (tmp_path / "x").exists()
