"""`schedule: auto` (issue 33 items 2 and 5): packed or replay, whichever is faster where it fits, by one rule.

Both give the same gradient (every schedule is exact); they differ in memory and speed. `packed` runs a rank's whole
share of the tree in one chunk (one forward, one backward); `replay` holds one root-to-leaf path and one chunk at a
time (schedule/replay.py), so it fits where packed does not, and with its token budget (`chunk_tokens`, on by
default) it packs small subtrees into chunks of at most that many tokens (schedule/walk.py packed_groups). THE rule
(`choose`, written once here), in order:
1. packed cannot run these options (the rules' line) -> replay;
2. packed's planned peak does not fit the budget -> replay;
3. replay runs with chunks and the tree packed would run has more tokens than one chunk -> replay: measured on a
   quiet 2-core CPU (docs/performance.md, issue 33's tables) chunked replay took 0.87-1.01x packed's time at every
   shape whose tree spans several chunks (many small prompts 0.81-0.87x with a third of packed's memory);
4. else packed: the tree is at most one chunk, which replay would run as that same single packed chunk (walk.py:
   the roots of a tree of at most `chunk_tokens` tokens are one group), so packed, which skips the walk, is it.
Without chunks (`chunk_tokens` None) step 3 is skipped: replay walked segment by segment was 1.4-3.8x slower than
packed at small segments (the same tables). Tokens are counted as packed_groups counts them: the tree's computed
positions (PrefixTree.num_tokens), the whole tree's, not one CP rank's.

Used by `grad --schedule auto` (the budget: `--memory-budget` GB, or on a GPU the free device memory after the model
is loaded), `train`'s `schedule.name: auto` (train/auto_schedule.py), the verl integration (integration/verl_auto.py),
the bench's `auto` variant (bench/runner.py) and `plan --schedule auto` (the budget: the device's, through the
planner's own verdict on the packed plan; the tokens: `plan_tokens`). What is compared in `grad`: packed's planned
activation peak of the largest DP share (plan/activations.py: the saved tensors of one chunk, plus the ring, logits
and dispatcher buffers beside them), not weights or gradients, which are the same for both schedules.
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
from megatron_branch.plan.model import Layout, RolloutShape


@dataclass(frozen=True, kw_only=True)
class AutoChoice:
    """What `schedule: auto` picked, and why (reported in the JSON / metrics)."""

    schedule: str
    """"packed" or "replay"."""
    reason: str
    """One line: what decided (packed's refusal, its planned bytes against the budget, or the tree's tokens)."""
    packed_bytes: int
    """Packed's planned memory (grad: its activation peak on the largest share; plan: its device total)."""
    budget_bytes: int
    """What it was compared with."""
    tokens: int
    """Tokens of the largest tree packed would run in one chunk (its computed positions, as schedule/walk.py
    packed_groups counts them)."""
    chunk_tokens: int | None
    """Replay's token budget per chunk the run has (ScheduleOptions.chunk_tokens); None: chunks off."""

    def to_json(self) -> dict[str, Any]:
        return {
            "picked": self.schedule,
            "reason": self.reason,
            "packed_bytes": self.packed_bytes,
            "budget_bytes": self.budget_bytes,
            "tokens": self.tokens,
            "chunk_tokens": self.chunk_tokens,
        }


def choose(packed_bytes: int, budget_bytes: int, *, tokens: int, chunk_tokens: int | None) -> AutoChoice:
    """THE rule's memory and token steps (module doc, steps 2-4): replay when packed's planned memory does not fit
    the budget, or when replay runs with chunks and the tree spans more than one; packed otherwise."""
    fits = packed_bytes <= budget_bytes
    verdict = "fits" if fits else "does not fit"
    reason = f"packed needs {packed_bytes / 1e9:.3g} GB, {verdict} the budget of {budget_bytes / 1e9:.3g} GB"
    spans = chunk_tokens is not None and tokens > chunk_tokens
    if not fits:
        reason += ": replay holds one path and one chunk at a time"
    elif spans:
        reason += (
            f", but the tree's {tokens} tokens span more than one chunk of {chunk_tokens}: replay's chunks bound "
            "the working set at packed's speed (measured: docs/performance.md)"
        )
    elif chunk_tokens is not None:
        reason += f", and the tree's {tokens} tokens are one chunk of {chunk_tokens} (replay would run it as packed)"
    return AutoChoice(schedule="packed" if fits and not spans else "replay", reason=reason,
                      packed_bytes=packed_bytes, budget_bytes=budget_bytes, tokens=tokens,
                      chunk_tokens=chunk_tokens)  # fmt: skip


def decide(
    packed_bytes: int,
    budget_bytes: int,
    packed_problem: str | None = None,
    *,
    tokens: int,
    chunk_tokens: int | None,
) -> AutoChoice:
    """THE rule (module doc): replay when packed cannot run these options at all (`packed_problem`: the rules' one
    line), else `choose`."""
    if packed_problem is not None:
        return AutoChoice(schedule="replay", reason=f"packed cannot run this: {packed_problem}",
                          packed_bytes=packed_bytes, budget_bytes=budget_bytes, tokens=tokens,
                          chunk_tokens=chunk_tokens)  # fmt: skip
    return choose(packed_bytes, budget_bytes, tokens=tokens, chunk_tokens=chunk_tokens)


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


def share_peak(
    arch: ModelArch,
    rollouts: list[Any],
    layout: Layout,
    *,
    act_bytes: int,
    layer_recompute: bool,
    micro_batches: int = 1,
) -> tuple[int, int]:
    """(packed's planned activation peak, its tokens) over `rollouts` (one update's batch), each the largest over
    the chunks packed runs: every micro-batch (update.split_micro_batches) of every DP share
    (parallel.assign_groups). Replay runs each of those trees on its own, so its tokens are what one chunk of
    replay's budget is compared with."""
    from megatron_branch.parallel.data import assign_groups
    from megatron_branch.update.step import split_micro_batches

    tree = PrefixTree.build(rollouts, vocab_size=arch.vocab_size)
    shares = [s for s in assign_groups(tree, layout.dp) if s] or [list(range(len(rollouts)))]
    chunks = [c for s in shares for c in split_micro_batches(rollouts, s, micro_batches)]
    trees = [PrefixTree.build([rollouts[i] for i in c], vocab_size=arch.vocab_size) for c in chunks]
    peak = max(
        packed_peak_bytes(arch, t, layout, act_bytes=act_bytes, layer_recompute=layer_recompute)
        for t in trees
    )
    return peak, max(t.num_tokens for t in trees)


def grad_choice(
    arch: ModelArch,
    batches: list[list[Any]],
    layout: Layout,
    *,
    act_bytes: int,
    layer_recompute: bool,
    budget_bytes: int,
    chunk_tokens: int | None,
    packed_problem: str | None = None,
    micro_batches: int = 1,
) -> AutoChoice:
    """`grad --schedule auto` (one batch) and `train`'s per step (each of `batches` one update's rollouts,
    train/auto_schedule.py): THE rule on the largest chunk's peak and tokens (share_peak) over every batch."""
    sizes = [
        share_peak(
            arch, b, layout, act_bytes=act_bytes, layer_recompute=layer_recompute, micro_batches=micro_batches
        )
        for b in batches
        if b
    ]
    return decide(max(p for p, _ in sizes), budget_bytes, packed_problem, tokens=max(t for _, t in sizes),
                  chunk_tokens=chunk_tokens)  # fmt: skip


def plan_tokens(shape: RolloutShape, layout: Layout) -> int:
    """Tokens of the tree packed runs on one rank in the planner (plan/memory.py step_peak): this DP rank's prompt
    groups (one under pipeline parallelism: a wave of one-group chunks), each R + G x L computed positions, the count
    step_peak's replay compares with `chunk_tokens` too."""
    groups = 1 if layout.pp > 1 else cdiv(shape.prompts, layout.dp)
    return groups * (shape.root_length + shape.responses * shape.leaf_length)
