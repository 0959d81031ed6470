"""Hybrid (gated delta net) models inside verl's MegatronEngine with the branch-replay switch, through verl's real
TrainingWorker on CPU (one process, fp32, dynamic batch size): Qwen3.5 (dense; Qwen3.6 has its architecture),
Qwen3-Next and Qwen3.5-MoE (MoE layers with the gated shared expert).

verl's own path cannot run a hybrid on CPU: megatron-core's GatedDeltaNet has no packed-sequence support, and verl's
remove-padding path packs every micro-batch (THD). The reference is therefore per-rollout training of the same
batch through verl's loss: the same worker with the switch's `naive` schedule (each rollout alone through
megatron's own layers: GatedDeltaNet's forward on one sequence, no tree state), and Hugging Face in float64 for
the logprobs and entropies. Compared: compute_log_prob's logprobs and entropies, every parameter's main_grad
(fp32 1e-5 relative: megatron's delta rule computes in float32, tests/unit/test_gdn_replay.py), verl's metrics.
Planted: a shared token's GDN state taken from the wrong rollout fails.

    PYTHONPATH=$PWD:tests .venv/bin/python -m pytest tests/unit/test_verl_hybrid.py -q

TP2 + SP and CP2: tests/distributed/test_verl_hybrid_parallel.py.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")

from gdn_helpers import plant_wrong_rollout_state  # noqa: E402
from verl_helpers import (  # noqa: E402
    StepOut,
    actor_config,
    grpo_batch,
    make_worker,
    max_rel_grad_error,
    one_rank,
    run_step,
    set_switch,
)

BOUND = 1e-5
METRICS = ("actor/pg_loss", "actor/entropy_loss", "actor/ppo_kl", "kl_loss", "loss", "grad_norm")


@pytest.fixture(scope="module")
def policies() -> Any:
    """A one-rank world and the tiny hybrids (4 layers: 3 gated delta net, 1 gated attention)."""
    root = Path(tempfile.mkdtemp(prefix="verl-hybrid-"))
    with one_rank(root / "qwen3_5", family="qwen3_5", num_layers=4) as qwen3_5:
        from verl_helpers import write_tiny_policy

        from megatron_branch.integration.verl_cpu import register_cpu_engine, use_cpu_platform

        use_cpu_platform()
        register_cpu_engine()
        yield {
            "qwen3_5": qwen3_5,
            **{f: write_tiny_policy(root / f, family=f, num_layers=4) for f in ("qwen3_next", "qwen3_5_moe")},
        }


def _batch() -> Any:
    return grpo_batch(seed=3)


def _step(hf: str, schedule: str) -> StepOut:
    from megatron_branch.integration.verl import BranchOptions

    # replay walked segment by segment (chunks off): the planted fork-state bugs below live in the hand-off between
    # a cached parent and its children, which the default chunks would run as one packed chunk on this tiny batch
    set_switch(True, BranchOptions(schedule=schedule, schedule_options={"chunk_tokens": None}))
    try:
        worker = make_worker(hf, dynamic_bsz=True)
        return run_step(worker, _batch, actor=actor_config(use_dynamic_bsz=True))
    finally:
        set_switch(False)


def _hf_float64(hf: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face, float64, rollout by rollout: (logprobs, entropies) of the response tokens, [B, R] (0 past
    each response's end)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float64).eval()
    td = _batch()
    P = td["prompts"].shape[1]
    ids_all, mask = torch.cat([td["prompts"], td["responses"]], 1), td["attention_mask"].bool()
    lp, ent = (
        torch.zeros(td["responses"].shape, dtype=torch.float64),
        torch.zeros(td["responses"].shape, dtype=torch.float64),
    )
    with torch.no_grad():
        for i in range(len(ids_all)):
            ids = ids_all[i][mask[i]]
            plen, rlen = int(mask[i, :P].sum()), int(mask[i, P:].sum())
            logits = model(ids[None]).logits[0].log_softmax(-1)[plen - 1 : plen + rlen - 1]
            lp[i, :rlen] = logits.gather(-1, ids[plen:, None])[:, 0]
            ent[i, :rlen] = -(logits.exp() * logits).sum(-1)
    return lp, ent


def _compare(tree: StepOut, ref: StepOut, what: str) -> None:
    assert tree.engine.startswith("BranchReplay") and ref.engine.startswith("BranchReplay")
    torch.testing.assert_close(tree.log_probs, ref.log_probs, rtol=BOUND, atol=BOUND)
    torch.testing.assert_close(tree.entropy, ref.entropy, rtol=BOUND, atol=BOUND)
    err, name = max_rel_grad_error(ref.grads, tree.grads)
    assert err <= BOUND, f"{what}: {name} {err:.2e}"
    for key in METRICS:
        assert float(tree.metrics[key][0]) == pytest.approx(
            float(ref.metrics[key][0]), rel=BOUND, abs=1e-6
        ), key
    assert tree.metrics["tree/positions_computed"][0] < tree.metrics["tree/positions_logical"][0]
    assert tree.metrics["tree/update_passes"][0] == 1.0


def test_qwen3_5_switch_equals_per_rollout_training(policies: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3.5: the tree (replay, one pass) == per-rollout training (naive) == HF float64 per rollout; planted:
    a shared token's GDN state from the wrong rollout breaks the gradients and the logprobs."""
    from megatron_branch.models.gdn import BranchGatedDeltaNet

    hf = policies["qwen3_5"]
    ref = _step(hf, "naive")
    tree = _step(hf, "replay")
    _compare(tree, ref, "qwen3_5")
    lp, ent = _hf_float64(hf)
    valid = tree.log_probs != 0
    torch.testing.assert_close(tree.log_probs[valid].double(), lp[valid], rtol=BOUND, atol=BOUND)
    torch.testing.assert_close(tree.entropy[valid].double(), ent[valid], rtol=BOUND, atol=BOUND)
    assert any(n.endswith("self_attention.A_log") for n in tree.grads)  # the GDN layers were trained

    calls = []
    start = BranchGatedDeltaNet._start
    monkeypatch.setattr(BranchGatedDeltaNet, "_start", lambda *a: calls.append(1) or start(*a))
    plant_wrong_rollout_state(monkeypatch)
    bad = _step(hf, "replay")
    assert calls, "the tree step ran the branch-aware gated delta net"
    err, _ = max_rel_grad_error(ref.grads, bad.grads)
    assert err > 1e-3, f"the planted wrong-rollout GDN state went unnoticed ({err:.2e})"
    assert (bad.log_probs - ref.log_probs).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_moe_hybrid_switch_equals_per_rollout_training(policies: Any, family: str) -> None:
    """Qwen3-Next and Qwen3.5-MoE (gated delta nets, MoE layers with the gated shared expert; verl's default, no
    router loss): the tree == per-rollout training."""
    hf = policies[family]
    _compare(_step(hf, "replay"), _step(hf, "naive"), family)
