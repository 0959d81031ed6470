"""`schedule: auto` (issue 33 item 2): packed when its planned memory fits the budget, replay otherwise.

Both give the same gradient (every schedule is exact); they differ in memory and speed. `packed` runs a rank's whole
share of the tree in one chunk (one forward, one backward, the fastest at small and medium shapes); `replay` holds
one root-to-leaf path and one chunk at a time (schedule/replay.py), so it fits where packed does not. The rule is
written once here (`choose`) and used by `grad --schedule auto` (the budget: `--memory-budget` GB, or on a GPU the
free device memory after the model is loaded) and by `plan --schedule auto` (the budget: the device's, through the
planner's own verdict on the packed plan). What is compared in `grad`: packed's planned activation peak of the
largest DP share (plan/activations.py: the saved tensors of one chunk, plus the ring, logits and dispatcher buffers
beside them), not weights or gradients, which are the same for both schedules.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Any

from megatron_branch.data import PrefixTree
from megatron_branch.models.arch import ModelArch
from megatron_branch.plan.activations import Dims, cdiv, local_rows
from megatron_branch.plan.memory import packed_peak
from megatron_branch.plan.model import Layout


@dataclass(frozen=True, kw_only=True)
class AutoChoice:
    """What `schedule: auto` picked, and why (reported in the JSON / metrics)."""

    schedule: str
    """"packed" or "replay"."""
    reason: str
    """One line: packed's planned bytes against the budget."""
    packed_bytes: int
    """Packed's planned memory (grad: its activation peak on the largest share; plan: its device total)."""
    budget_bytes: int
    """What it was compared with."""

    def to_json(self) -> dict[str, Any]:
        return {
            "picked": self.schedule,
            "reason": self.reason,
            "packed_bytes": self.packed_bytes,
            "budget_bytes": self.budget_bytes,
        }


def choose(packed_bytes: int, budget_bytes: int) -> AutoChoice:
    """THE rule: packed when its planned memory fits the budget, replay otherwise."""
    fits = packed_bytes <= budget_bytes
    verdict = "fits" if fits else "does not fit"
    reason = f"packed needs {packed_bytes / 1e9:.3g} GB, {verdict} the budget of {budget_bytes / 1e9:.3g} GB"
    return AutoChoice(
        schedule="packed" if fits else "replay",
        reason=reason + ("" if fits else ": replay holds one path and one chunk at a time"),
        packed_bytes=packed_bytes,
        budget_bytes=budget_bytes,
    )


def decide(packed_bytes: int, budget_bytes: int, packed_problem: str | None = None) -> AutoChoice:
    """`choose`, or replay when packed cannot run these options at all (`packed_problem`: the rules' one line)."""
    if packed_problem is not None:
        return AutoChoice(schedule="replay", reason=f"packed cannot run this: {packed_problem}",
                          packed_bytes=packed_bytes, budget_bytes=budget_bytes)  # fmt: skip
    return choose(packed_bytes, budget_bytes)


def free_device_bytes() -> int:
    """This rank's free memory now: a GPU's (torch's mem_get_info), else the host's available memory shared by this
    node's ranks (LOCAL_WORLD_SIZE). Callers agree on the smallest over the ranks themselves."""
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.mem_get_info()[0])
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(free // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def packed_peak_bytes(
    arch: ModelArch,
    tree: PrefixTree,
    layout: Layout,
    *,
    act_bytes: int,
    layer_recompute: bool = False,
    logprob_chunk_rows: int = 256,
) -> int:
    """Planned activation peak of `packed` over `tree` (one rank's share, in one chunk): plan/memory.py's packed
    terms (packed_peak), with the rows, targets and sequences read off the tree rather than a RolloutShape."""
    dm = Dims.of(arch, layout, act_bytes, gdn_kernel="torch")
    seqs = sorted(
        Counter(s.length for s in tree.segments).items()
    )  # a GDN layer: each segment its own sequence
    per_cp_rank = Layout(cp=layout.cp, tp=1, sequence_parallel=False)  # zigzag pieces per segment under CP
    r = sum(local_rows(length, n, per_cp_rank) for length, n in seqs)
    r = local_rows(r, 1, Layout(tp=layout.tp, sequence_parallel=layout.sequence_parallel))  # SP padding
    starts = tree.response_starts()
    # every response token once: the rows of the chunk that reach the output projection (schedule/chunks.py)
    m = cdiv(sum(s.length - starts[s.id] for s in tree.segments), layout.cp)
    pk = packed_peak(dm, r, m, cp=layout.cp, layer_recompute=layer_recompute, sequences=seqs,
                     logprob_chunk_rows=logprob_chunk_rows)  # fmt: skip
    return pk.saved + pk.ring_buffers + pk.logits + pk.dispatcher


def share_peak_bytes(
    arch: ModelArch,
    rollouts: list[Any],
    layout: Layout,
    *,
    act_bytes: int,
    layer_recompute: bool,
    micro_batches: int = 1,
) -> int:
    """Packed's planned activation peak over `rollouts` (one update's batch): the largest chunk packed runs, that
    is the largest micro-batch (update.split_micro_batches) of the largest DP share (parallel.assign_groups)."""
    from megatron_branch.parallel.data import assign_groups
    from megatron_branch.update.step import split_micro_batches

    tree = PrefixTree.build(rollouts, vocab_size=arch.vocab_size)
    shares = [s for s in assign_groups(tree, layout.dp) if s] or [list(range(len(rollouts)))]
    chunks = [c for s in shares for c in split_micro_batches(rollouts, s, micro_batches)]
    return max(
        packed_peak_bytes(
            arch,
            PrefixTree.build([rollouts[i] for i in c], vocab_size=arch.vocab_size),
            layout,
            act_bytes=act_bytes,
            layer_recompute=layer_recompute,
        )
        for c in chunks
    )


def grad_choice(
    arch: ModelArch,
    rollouts: list[Any],
    layout: Layout,
    *,
    act_bytes: int,
    layer_recompute: bool,
    budget_bytes: int,
    packed_problem: str | None = None,
    micro_batches: int = 1,
) -> AutoChoice:
    """`grad --schedule auto` (and `train`'s per batch, train/auto_schedule.py): packed's planned activation peak
    on the largest chunk (share_peak_bytes) against the budget; replay when packed cannot run these options at all
    (`packed_problem`: the rules' one line)."""
    peak = share_peak_bytes(arch, rollouts, layout, act_bytes=act_bytes, layer_recompute=layer_recompute,
                            micro_batches=micro_batches)  # fmt: skip
    return decide(peak, budget_bytes, packed_problem)
