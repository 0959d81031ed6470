"""A deterministic activation-memory meter: bytes held for backward, counted exactly, on CPU as on GPU.

Wall-clock memory (RSS, allocator peaks) on a shared CPU machine is noisy and includes allocator caching;
what the schedules differ in is which activations they keep alive for backward. `ActivationMeter` counts
exactly that, from autograd's own bookkeeping, so its numbers are reproducible run to run and can be asserted
on in tests.

What it counts, while the context is active:
  * every tensor autograd SAVES FOR BACKWARD (through `torch.autograd.graph.saved_tensors_hooks`, which sees
    built-in ops and custom autograd Functions' `save_for_backward` alike), from the moment it is saved until
    autograd releases it (after the node's backward ran, or when the graph is dropped);
  * tensors registered explicitly with `track_extra` (the replay schedule registers its cached K/V leaves),
    until they are garbage; for leaves that require grad also their `.grad` accumulator once it exists.
Each STORAGE is counted once, with its full size (a small view of a large buffer keeps the whole buffer alive),
keyed by `untyped_storage().data_ptr()`; a storage saved by several ops, or saved and registered, counts once.

What it does NOT count: parameters (pass the modules to exclude their storages), parameter gradients,
optimizer state, and transient tensors that are freed before backward (an op's outputs that nothing saves,
the temporaries inside a fused kernel). So `peak_bytes` is a lower bound of the real activation peak, and the
right number to compare schedules by. On CUDA, `cuda_peak_bytes` additionally reports the allocator's
`torch.cuda.max_memory_allocated` over the context (everything, including parameters and workspace).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import torch

_ACTIVE: list[ActivationMeter] = []  # a stack, so that nested meters each see what runs inside them


class _Saved:
    """What autograd holds instead of a saved tensor; its death is the moment the saved bytes are released."""

    __slots__ = ("tensor", "_release", "__weakref__")

    def __init__(self, tensor: torch.Tensor, release: Any) -> None:
        # detach(): same storage, no grad_fn, so that saving an op's OUTPUT does not make a reference cycle
        # (output -> grad_fn -> saved -> output) that would delay the release until the cycle collector runs.
        self.tensor = tensor.detach()
        self._release = release

    def __del__(self) -> None:
        self._release()


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without a storage (sparse, some subclasses)
        return None
    return s.data_ptr(), s.nbytes()


KINDS = ("saved", "registered", "registered_grad")
"""What holds a counted storage: autograd (saved for backward), a registered extra (replay's prefix cache), or a
registered leaf's `.grad` (the cache's dK/dV accumulators). A storage both saved and registered (a root's captured
K/V, kept by its graph and cached) counts once, as "registered": the planner's cached_kv term."""


class ActivationMeter:
    """Context manager: `with ActivationMeter(model) as m: run_schedule(...)`, then read `m.peak_bytes`.

    `exclude` modules: their parameters' storages are never counted (a linear layer saves its weight for
    backward; that is not activation memory). Only one pair of saved-tensor hooks is active at a time in
    torch, so an inner meter hides the saved tensors from an outer one (registered extras reach every active
    meter).
    """

    def __init__(self, *exclude: torch.nn.Module) -> None:
        self._exclude = exclude
        self._excluded: set[int] = set()
        self._refs: dict[int, int] = {}  # storage ptr -> live references (saved copies + registered tensors)
        self._sizes: dict[int, int] = {}  # storage ptr -> bytes
        self._kinds: dict[int, str] = {}  # storage ptr -> the KINDS entry it is counted under (its first use)
        self.current_by_kind = dict.fromkeys(KINDS, 0)
        """`current_bytes` split by what holds the storage (see KINDS)."""
        self.peak_by_kind = dict.fromkeys(KINDS, 0)
        """The split of `current_bytes` at the moment of `peak_bytes` (sums to it): the planner's per-term peak."""
        self.current_bytes = 0
        """Bytes of distinct storages alive now (saved for backward or registered)."""
        self.peak_bytes = 0
        """Largest `current_bytes` seen."""
        self.saved_count = 0
        """Tensors saved for backward (with repeats), for diagnostics."""
        self.cuda_peak_bytes: int | None = None
        """CUDA only: torch.cuda.max_memory_allocated over the context (None on CPU)."""
        self.cuda_baseline_bytes: int | None = None
        """CUDA only: torch.cuda.memory_allocated when the context was entered."""
        self._hooks: Any = None

    # --- accounting -------------------------------------------------------------------------------------------
    def _acquire(self, ptr: int, nbytes: int, kind: str) -> None:
        n = self._refs.get(ptr, 0)
        if n == 0:
            self._sizes[ptr] = nbytes
            self._kinds[ptr] = kind
            self.current_bytes += nbytes
            self.current_by_kind[kind] += nbytes
            if self.current_bytes > self.peak_bytes:
                self.peak_bytes = self.current_bytes
                self.peak_by_kind = dict(self.current_by_kind)
        elif kind != "saved" and self._kinds.get(ptr) == "saved":
            # a saved storage the cache registers (a root's captured K/V, kept by its graph) is the cache's
            self._kinds[ptr] = kind
            self.current_by_kind["saved"] -= self._sizes[ptr]
            self.current_by_kind[kind] += self._sizes[ptr]
            if self.current_bytes == self.peak_bytes:
                self.peak_by_kind = dict(self.current_by_kind)
        self._refs[ptr] = n + 1

    def _release(self, ptr: int) -> None:
        n = self._refs.get(ptr, 0)
        if n <= 1:
            self._refs.pop(ptr, None)
            nbytes = self._sizes.pop(ptr, 0)
            self.current_bytes -= nbytes
            kind = self._kinds.pop(ptr, None)
            if kind is not None:
                self.current_by_kind[kind] -= nbytes
        else:
            self._refs[ptr] = n - 1

    def _pack(self, t: torch.Tensor) -> Any:
        key = _storage_key(t)
        if key is None or key[0] in self._excluded:
            return t
        ptr, nbytes = key
        self.saved_count += 1
        self._acquire(ptr, nbytes, "saved")
        return _Saved(t, lambda: self._release(ptr))

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def track(self, t: torch.Tensor, kind: str = "registered") -> None:
        """Count `t`'s storage until `t` is garbage (and its `.grad`, for a leaf that requires grad), under `kind`
        (KINDS)."""
        key = _storage_key(t)
        if key is None or key[0] in self._excluded:
            return
        ptr, nbytes = key
        self._acquire(ptr, nbytes, kind)
        weakref.finalize(t, self._release, ptr)
        if t.requires_grad and t.is_leaf:
            # The dK/dV accumulator of a cached leaf is as large as the leaf and lives as long: count it from
            # its first accumulation (once; later accumulations are in place).
            meter = weakref.ref(self)  # the hook must not keep the meter alive
            seen = False

            def on_grad(leaf: torch.Tensor) -> None:
                nonlocal seen
                m = meter()
                if seen or m is None or leaf.grad is None:
                    return
                seen = True
                gkey = _storage_key(leaf.grad)
                if gkey is not None:
                    m._acquire(*gkey, "registered_grad")
                    # released with the leaf: nothing here replaces or drops a cached leaf's .grad before that
                    weakref.finalize(leaf, m._release, gkey[0])

            t.register_post_accumulate_grad_hook(on_grad)

    # --- context ----------------------------------------------------------------------------------------------
    def __enter__(self) -> ActivationMeter:
        self._excluded = {p.untyped_storage().data_ptr() for m in self._exclude for p in m.parameters()}
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.cuda_baseline_bytes = torch.cuda.memory_allocated()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _ACTIVE.remove(self)
        self._hooks.__exit__(exc_type, exc, tb)
        self._hooks = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.cuda_peak_bytes = torch.cuda.max_memory_allocated()

    @property
    def peak_mb(self) -> float:
        return self.peak_bytes / 2**20


def track_extra(tensors: Iterable[torch.Tensor], kind: str = "registered") -> None:
    """Register tensors with every active meter (a no-op when none is active: safe to call in the schedules)."""
    if not _ACTIVE:
        return
    for t in tensors:
        for m in _ACTIVE:
            m.track(t, kind)


@contextmanager
def count_recomputed() -> Iterator[None]:
    """Around a non-reentrant checkpoint's recomputation (in backward): count what it rebuilds with every active
    meter (a no-op when none is active).

    Inside the recomputation the innermost saved-tensor hooks are checkpoint's own, which store each rebuilt
    tensor until the original graph's node unpacks it. These hooks wrap them (read with torch's private
    `_top_saved_tensors_default_hooks`, which torch's AOTAutograd also uses; the meter tests of
    tests/unit/test_layer_checkpoint.py fail if it changes): each tensor is replaced by a
    detached alias of the same storage, counted until the alias is garbage (checkpoint drops its reference when the
    node unpacks it, the node when its backward ran), then passed to checkpoint's hook unchanged.
    """
    if not _ACTIVE:
        yield
        return
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    assert top is not None, "count_recomputed belongs inside a checkpoint's recomputation"
    inner_pack, inner_unpack = top

    def pack(t: torch.Tensor) -> Any:
        alias = t.detach()  # the same storage; checkpoint keeps this very object (it needs no grad)
        track_extra([alias], kind="saved")  # rebuilt activations, not a registered cache
        return inner_pack(alias)

    with torch.autograd.graph.saved_tensors_hooks(pack, inner_unpack):
        yield
