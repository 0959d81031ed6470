"""The tiny training runs the train-loop, lifecycle and resume tests share: one spelling of the tiny model, the
kv-retrieval task, the quiet logging, and the step loop."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatron_branch.train.loop import Trainer
from megatron_branch.train.models import unwrap

TINY_ARCH = (
    "model.arch={hidden_size: 16, num_layers: 2, num_attention_heads: 2, num_query_groups: 2, "
    "ffn_hidden_size: 32, max_position_embeddings: 64}"
)
"""A 2-layer, 16-wide model (train config override)."""

KV_TASK = [
    "data.task=kv_retrieval",
    "data.task_args={num_pairs: 2, value_len: 2, value_chars: abcd}",
    "data.num_prompts=16",
    "data.train_batch_size=2",
    "rollout.n=2",
    "rollout.response_length=3",
    "optim.lr=0.01",
]
"""A built-in task small enough for a few CPU steps: 2 prompts x 2 rollouts of 3 tokens per step."""

QUIET = ["logging.progress_bar=false", "logging.tensorboard=false", "logging.plot=false"]
"""No progress bar, TensorBoard or plots (test output stays readable, nothing is spawned)."""


def run_steps(cfg) -> tuple[Trainer, list[dict]]:  # noqa: ANN001
    """A Trainer of `cfg` run to cfg.trainer.total_training_steps; its per-step metrics with the step's response
    tokens (`_tokens`) and rewards (`_rewards`)."""
    tr = Trainer(cfg)
    rows = []
    while tr.step < cfg.trainer.total_training_steps:
        m = tr.train_step()
        m["_tokens"] = [r.response for r in tr.last_batch]
        m["_rewards"] = list(tr.last_rewards)
        rows.append(m)
    return tr, rows


def params(tr: Trainer) -> dict[str, torch.Tensor]:
    """The policy's tensors (a copy), by megatron name."""
    return {
        k: v.detach().clone()
        for k, v in unwrap(tr.policy).state_dict().items()
        if isinstance(v, torch.Tensor)
    }


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The worst tensor's max |a - b| relative to its max |a|."""
    return max(float((a[k] - b[k]).abs().max() / (a[k].abs().max() + 1e-30)) for k in a)


def assert_resumes_exactly(cfg_of: Callable[..., Any], tmp_path: Path) -> tuple[Trainer, list[dict]]:
    """A 3-step run of `cfg_of(out, *overrides)` against 2 steps, a save and a resume to 3 (a float64 config):
    the same tokens, reward mean and loss every step (1e-9), one step after the resume, the same parameters at the
    end (1e-9), and replay sharing each prompt. Returns the uninterrupted run and its metrics."""
    full, mfull = run_steps(cfg_of(tmp_path / "full", "trainer.total_training_steps=3"))
    first, m1 = run_steps(cfg_of(tmp_path / "part", "trainer.total_training_steps=2"))
    first.save()
    again, m2 = run_steps(
        cfg_of(tmp_path / "part", "trainer.total_training_steps=3", "trainer.resume_mode=auto")
    )
    assert again.step == 3 and len(m2) == 1
    for x, y in zip(mfull, m1 + m2, strict=True):
        assert x["_tokens"] == y["_tokens"]
        for k in ("reward_mean", "loss"):
            assert abs(x[k] - y[k]) <= 1e-9, (x["step"], k)
    assert mfull[-1]["positions_computed"] < mfull[-1]["positions_logical"]  # replay shares each prompt
    assert max_rel(params(full), params(again)) < 1e-9
    return full, mfull
