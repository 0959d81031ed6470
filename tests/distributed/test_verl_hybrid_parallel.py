"""A Qwen3.5 hybrid (gated delta net layers) inside verl's MegatronEngine with the branch-replay switch at TP2 + SP,
at CP2 and at PP2 (gloo, CPU), through verl's TrainingWorker with dynamic batch size.

verl's own path cannot run a hybrid on CPU (megatron-core's GatedDeltaNet has no packed-sequence support; verl's
remove-padding path packs), so the reference is per-rollout training of the same batch through verl's loss: the
switch's `naive` schedule (each rollout alone through megatron's own layers), here at TP2 + SP (naive has no
context parallelism: rules, `naive has no context parallelism`). Compared with it: the tree at TP2 + SP (every
gradient shard) and the tree at CP2 (the GDN heads split over the CP ranks by the head exchange,
models/gdn_heads.py; attention on megatron-branch's ring; megatron's default loss regime), whose full gradients
are compared with the reference's shards gathered over TP (checkpoint/tp.py). Both layouts hold one DP replica and
the whole batch. (Under calculate_per_token_loss, Megatron-Bridge's setting at CP > 1, the CP2 update's gradients
came out exactly twice the TP2 reference's, every parameter; verl's own path without the switch gives the same
factor for a dense model (CP2 per-token vs TP2, measured by hand), and test_verl_engine_cp.py shows the tree equal
to verl's CP2 path in that regime: verl's per-token normalisation at CP.) Also compute_log_prob's logprobs and
entropies of every rollout. fp32, 1e-5 relative per parameter (megatron's delta rule computes in float32).

    python tests/distributed/launch.py 2 -k verl_hybrid

Skipped (on every rank alike) without the verl extra.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")

from verl_helpers import (  # noqa: E402
    StepOut,
    actor_config,
    grpo_batch,
    make_worker,
    max_rel_grad_error,
    run_step,
    set_switch,
    shared_policy_dir,
)

BOUND = 1e-5


def _step(
    hf: str, schedule: str, *, tp: int = 1, cp: int = 1, pp: int = 1, walk: dict | None = None
) -> tuple[StepOut, dict[str, torch.Tensor]]:
    """One compute_log_prob + update through the switch with `schedule`; also every parameter's full gradient
    (gathered over TP) at the optimizer step."""
    from megatron.core import parallel_state as ps

    from megatron_branch.checkpoint.tp import gather_full_grads
    from megatron_branch.integration.verl import BranchOptions
    from megatron_branch.integration.verl_cpu import register_cpu_engine, use_cpu_platform
    from megatron_branch.integration.verl_model import unwrap

    use_cpu_platform()
    register_cpu_engine()  # the switch subclasses the engine registered for this device
    set_switch(True, BranchOptions(schedule=schedule, schedule_options=walk or {}))
    try:
        worker = make_worker(hf, tp=tp, cp=cp, pp=pp, dynamic_bsz=True)
        engine, full = worker.engine, {}
        step = engine.optimizer_step

        def gather_then_step() -> Any:
            model = unwrap(engine.module[0])
            full.update(gather_full_grads(model, ps.get_tensor_model_parallel_group()))
            return step()

        engine.optimizer_step = gather_then_step
        out = run_step(worker, lambda: grpo_batch(seed=13), actor=actor_config(use_dynamic_bsz=True))
    finally:
        set_switch(False)
    assert out.engine.startswith("BranchReplay") and full
    return out, full


def _collected(out: StepOut) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_probs, entropy) of every rollout, as the collecting ranks hold them (each CP rank under CP, equal)."""
    box: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(box, None if out.log_probs is None else (out.log_probs, out.entropy))
    held = [b for b in box if b is not None]
    for other in held[1:]:
        torch.testing.assert_close(other, held[0], rtol=0, atol=0)
    return held[0]


def _max_rel(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> tuple[float, str]:
    """max_rel_grad_error over full gradients; a vocabulary padded differently per TP size compares its rows."""
    rows = {k: min(ref[k].shape[0], got[k].shape[0]) for k in ref}
    return max_rel_grad_error(
        {k: v[: rows[k]] for k, v in ref.items()}, {k: v[: rows[k]] for k, v in got.items()}
    )


@pytest.mark.world(2)
def test_verl_hybrid_switch_equals_per_rollout_tp2_sp_and_cp2() -> None:
    os.environ.setdefault("MASTER_PORT", "0")  # verl's Worker reads it; the process group already exists
    hf = shared_policy_dir(family="qwen3_5", num_layers=2, layer_types=["linear_attention", "full_attention"])
    (ref, ref_full), (tp2, _), (cp2, cp2_full) = (
        _step(hf, "naive", tp=2),
        _step(hf, "replay", tp=2),
        _step(hf, "replay", cp=2),
    )
    want = _collected(ref)
    for name, tree in (("tp2_sp", tp2), ("cp2", cp2)):
        got = _collected(tree)
        torch.testing.assert_close(got[0], want[0], rtol=BOUND, atol=BOUND, msg=name)
        torch.testing.assert_close(got[1], want[1], rtol=BOUND, atol=BOUND, msg=name)
        if tree.metrics:
            assert tree.metrics["tree/positions_computed"][0] < tree.metrics["tree/positions_logical"][0]
    err, name = max_rel_grad_error(ref.grads, tp2.grads)  # this rank's shards
    assert err <= BOUND, f"tp2_sp rank {dist.get_rank()} {name}: {err:.2e}"
    err, name = _max_rel(ref_full, cp2_full)
    assert err <= BOUND, f"cp2 rank {dist.get_rank()} {name}: {err:.2e}"
    assert any(n.endswith("self_attention.A_log") for n in cp2_full)


def _global_names(grads: dict[str, torch.Tensor], offset: int) -> dict[str, torch.Tensor]:
    """A stage's gradients under the model's layer numbers (megatron numbers a stage's layers from 0)."""
    out = {}
    for name, g in grads.items():
        parts = name.split(".")
        if "layers" in parts:
            i = parts.index("layers") + 1
            parts[i] = str(int(parts[i]) + offset)
        out[".".join(parts)] = g
    return out


@pytest.mark.world(2)
def test_verl_hybrid_pp2_equals_per_rollout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3.5 hybrid (GDN, attention, GDN, attention) at PP2, each stage one GDN and one attention layer, with
    the switch's replay (chunks off: the tiny batch would otherwise be one chunk, no prefix cache; each stage's
    cache holds its GDN layer's fork states) and packed: logprobs and entropies on the last stage, and every
    parameter's gradient on each stage equal the per-rollout reference (naive at TP2 + SP, gradients gathered over
    TP); verl's own PP path cannot run a hybrid on CPU (module doc). Planted: the first stage's GDN fork states
    receiving none of their branches' gradients fails on that stage, the last stage passing."""
    from megatron.core import parallel_state as ps

    from megatron_branch.models.gdn_tree import GDN_STATE
    from megatron_branch.parallel.groups import destroy_parallel
    from megatron_branch.schedule.prefix_cache import PrefixCache

    os.environ.setdefault("MASTER_PORT", "0")
    hf = shared_policy_dir(
        family="qwen3_5", num_layers=4, layer_types=["linear_attention", "full_attention"] * 2
    )
    ref, ref_full = _step(hf, "naive", tp=2)
    want = _collected(ref)
    walk = {"chunk_tokens": None}

    def pp2(schedule: str) -> tuple[StepOut, float]:
        destroy_parallel()  # verl's engine keeps megatron's groups when they exist (the reference's TP2)
        tree, full = _step(hf, schedule, pp=2, walk=walk if schedule == "replay" else None)
        assert ps.get_pipeline_model_parallel_world_size() == 2
        stage = _global_names(full, offset=2 * ps.get_pipeline_model_parallel_rank())
        assert any(n.endswith("self_attention.A_log") for n in stage)  # each stage holds a GDN layer
        return tree, _max_rel({k: ref_full[k] for k in stage}, stage)[0]

    for schedule in ("replay", "packed"):
        tree, err = pp2(schedule)
        got = _collected(tree)
        torch.testing.assert_close(got[0], want[0], rtol=BOUND, atol=BOUND, msg=schedule)
        torch.testing.assert_close(got[1], want[1], rtol=BOUND, atol=BOUND, msg=schedule)
        assert err <= BOUND, f"pp2 {schedule} stage {dist.get_rank()}: {err:.2e}"

    injection = PrefixCache.injection

    def without_gdn(self: Any, seg_id: int, captured: Any) -> Any:
        if dist.get_rank() == 0:
            captured = {k: h for k, h in captured.items() if h.kind is not GDN_STATE}
        return injection(self, seg_id, captured)

    monkeypatch.setattr(PrefixCache, "injection", without_gdn)
    _, err = pp2("replay")
    monkeypatch.undo()
    every = torch.zeros(2, dtype=torch.float64)
    every[dist.get_rank()] = err
    dist.all_reduce(every)
    assert every[0] > 100 * BOUND and every[1] <= BOUND, every
