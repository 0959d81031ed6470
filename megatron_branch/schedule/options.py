"""How a step runs: the schedule options every schedule, chunk and entry point reads (one home, no import circle:
chunks.py and common.py both need it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_branch.attention.dispatch import backend_problem
from megatron_branch.parallel.groups import ParallelGroups
from megatron_branch.schedule.hooks import ScheduleHook, StepHook

DEFAULT_CHUNK_TOKENS = 4096
"""replay's token budget per packed chunk unless a run says otherwise (ScheduleOptions.chunk_tokens; the one home of
the default: ScheduleConfig, grad, train, bench and verl's BranchOptions all read it). 4096 is the budget of issue
33's tables (docs/performance.md): with it replay was within 1.10x of packed at every shape (demo, small prompts,
agentic, P = 4096 with G = 8 and 16), where leaf micro-batches of 8 alone were up to 3.76x slower; a chunk of 4096
tokens keeps replay's memory bounded (one chunk's activations, beside the path's cache) far below a long prompt's."""


CHUNKS_OFF = {
    "replay-stopgrad": "replay-stopgrad freezes the prompt rows of cached segments only: it walks segment by segment",
}
"""Replay-like schedules that run without chunks whatever `chunk_tokens` says, and why (reported, never refused:
the chunks are a default). Every other feature runs with them (tests/unit/test_chunk_tokens.py, the families' and
layouts' tests with `chunk_tokens`)."""


def chunks_ran(schedule: str, chunk_tokens: int | None) -> dict[str, Any]:
    """What a run of `schedule` did with replay's chunks, for its JSON: the budget it ran with (None: no chunks), and
    `chunk_tokens_off`, the reason, when a budget was set but the schedule walks without it."""
    if schedule in CHUNKS_OFF and chunk_tokens is not None:
        return {"chunk_tokens": None, "chunk_tokens_off": CHUNKS_OFF[schedule]}
    return {"chunk_tokens": chunk_tokens if schedule == "replay" else None}


@dataclass(kw_only=True)
class ScheduleOptions:
    """How a step runs. The parallel layout comes in whole (`groups`), never read from globals inside the math."""

    groups: ParallelGroups = field(default_factory=ParallelGroups.single)
    """The process groups and sizes (parallel/groups.py); the default is one process without parallelism."""
    vocab_size: int
    """Real (unpadded) vocabulary size; padded logits are excluded from every softmax."""
    backend: str | None = None
    """Attention backend (attention.dispatch): the executor of the visibility plan on one rank AND on every ring
    block under CP; None = `default_backend()`. A baseline without a ring executor is refused under CP."""
    branch_micro_batch: int = 8
    """replay: how many sibling LEAF segments share one forward/backward with `chunk_tokens` None, and with a token
    budget for consecutive leaves each larger than it (smaller ones share a chunk by tokens, schedule/walk.py)."""
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS
    """replay: pack small subtrees into chunks of at most this many tokens (schedule/walk.py): consecutive siblings
    whose whole subtree fits (leaves, short turns, small prompt groups at the top) share one forward and backward
    against their ancestors' cached state instead of one per segment (or per `branch_micro_batch` leaves); a larger
    subtree is walked as before. Exact (the same layout rules as `packed`). On by default (DEFAULT_CHUNK_TOKENS);
    None: off, every segment walked (leaf micro-batches of `branch_micro_batch`)."""
    recompute: bool = False
    """replay: keep no graph for a segment with children; recompute its forward at its backward."""
    recompute_layers: bool = False
    """replay, packed, naive-fused: per-layer activation checkpointing inside every chunk (torch's non-reentrant
    checkpoint, models/layer_checkpoint.py): only each transformer layer's input is kept, one layer's graph is rebuilt
    at a time in backward, at the price of one more forward of every layer. With `recompute` it is the planner's
    `recompute full`. Needs a model built by models.build_model; no effect without grad (scoring)."""
    keep_logprobs: bool = False
    """Return every target's logprob (detached) in the result."""
    keep_entropy: bool = False
    """Also compute and return every target row's full-vocabulary entropy (detached)."""
    ring_stats: Any = None
    """Under CP: a parallel.ring.RingStats the ring attention adds its message and kernel counts to (None = not
    counted)."""
    fused_logprobs: bool = True
    """Fuse the output projection with the logprob by row chunks (losses/fused_logprobs.py): a chunk's full logits
    are never materialised. Needs a BranchGPTModel; False (or another model) = megatron's output layer + logprobs."""
    moe: Any = None
    """A MoE policy's router options (losses/router.py MoEOptions: router losses, routing replay); None = megatron's
    routing, no router losses. Ignored for a dense model. The schedule hook schedule/moe.py ROUTER_PLAN reads them."""
    hooks: tuple[ScheduleHook, ...] = ()
    """Per-step features of the caller's own (schedule/hooks.py), bound by run_schedule after the registered ones
    (schedule/__init__.py HOOKS)."""
    step_hooks: tuple[StepHook, ...] = ()
    """Set by run_schedule: the hooks bound to this step, entered around every forward; not a user option."""
    pipeline_order: str = "1f1b"
    """Under pipeline parallelism (schedule/pipeline.py): the order of each wave of leaf micro-batches on a stage,
    "1f1b" (megatron's: pp - 1 - stage forwards first, then one forward one backward; at most pp micro-batches
    alive) or "gpipe" (all forwards, then all backwards). Both give the same gradients."""
    root_pieces: int = 1
    """replay under pipeline parallelism: cut each shared root (a prompt with its branches) into this many sequence
    pieces (fewer when the root is shorter; data/pieces.py), which flow through the stages like micro-batches, so
    the root's forward and backward leave (pp - 1) / (root_pieces + pp - 1) of its time idle instead of
    (pp - 1) / pp; exact (the unsplit root's computation in another order). 1 = whole roots. rules.check_pipeline
    refuses it without pipeline parallelism or for another schedule."""
    logprob_chunk_rows: int = 256
    """Rows of logits alive at once in the fused path. 256 keeps the transient [rows, vocab] fp32 chunk at 32 MB
    for a 32K vocabulary (128 MB at 128K) while the chunk's GEMM stays large (256 x hidden x vocab); on the
    2-core CPU the head ran within 2% of its time at 1024 rows (docs/performance.md). The chunk is the only head
    term that grows with the leaf micro-batch (Liger-Kernel's fused linear cross-entropy bounds its chunks the
    same way)."""

    def __post_init__(self) -> None:
        problem = backend_problem(self.backend, cp_size=self.cp_size)
        if problem is not None:
            raise ValueError(problem)
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if self.branch_micro_batch <= 0:
            raise ValueError(f"branch_micro_batch must be positive, got {self.branch_micro_batch}")
        if self.chunk_tokens is not None and self.chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {self.chunk_tokens}")
        if self.root_pieces <= 0:
            raise ValueError(f"root_pieces must be positive, got {self.root_pieces}")
        if self.pipeline_order not in ("1f1b", "gpipe"):
            raise ValueError(f"pipeline_order must be 1f1b or gpipe, got {self.pipeline_order!r}")
        if self.logprob_chunk_rows <= 0:
            raise ValueError(f"logprob_chunk_rows must be positive, got {self.logprob_chunk_rows}")

    # the views the math reads (one home: `groups`)
    @property
    def tp_group(self) -> Any:
        return self.groups.tp

    @property
    def tp_size(self) -> int:
        return self.groups.tp_size

    @property
    def sequence_parallel(self) -> bool:
        return self.groups.sequence_parallel

    @property
    def cp_group(self) -> Any:
        return self.groups.cp

    @property
    def cp_size(self) -> int:
        return self.groups.cp_size

    @property
    def pp_group(self) -> Any:
        return self.groups.pp

    @property
    def pp_size(self) -> int:
        return self.groups.pp_size

    @property
    def pad_to(self) -> int:
        return self.tp_size if self.sequence_parallel else 1
