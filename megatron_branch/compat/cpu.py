"""Shims that let megatron-core 0.16.1 run on a machine without CUDA.

megatron-core assumes CUDA in a handful of places (measured on CPU; docs/design.md). Each shim
below replaces exactly one of those assumptions, is applied only when CUDA is absent, is idempotent, and first
checks that the name it patches still exists, so that a megatron-core upgrade that renames it fails loudly
(`CompatError`) instead of silently running unpatched code. tests/unit/test_compat.py guards every one.

The shims never change results: on CPU they route the same computation to the CPU device or generator.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["CompatError", "CpuRNGStatesTracker", "apply_cpu_shims", "applied_shims", "needs_cpu_shims"]

_APPLIED: dict[str, bool] = {}


class CompatError(RuntimeError):
    """megatron-core no longer has a name that a CPU shim patches (a version mismatch)."""


def needs_cpu_shims() -> bool:
    """True when CUDA is unavailable: the shims are applied only then."""
    return not torch.cuda.is_available()


def _resolve(module: str, attr: str) -> tuple[Any, Any]:
    try:
        mod = importlib.import_module(module)
    except ImportError as e:  # pragma: no cover - only on a broken install
        raise CompatError(f"cannot import {module}: {e}") from e
    if not hasattr(mod, attr):
        raise CompatError(
            f"megatron-core changed: {module}.{attr} is gone; megatron-branch's CPU shims target megatron-core 0.16.1"
        )
    return mod, getattr(mod, attr)


# --- 1. torch.cuda.current_device() ------------------------------------------------------------------------------
# Megatron allocates buffers with `device=torch.cuda.current_device()` (GlobalMemoryBuffer, tensor_parallel
# mappings, RoPE's inv_freq move). Returning the CPU device keeps those allocations on the CPU.
def _shim_current_device() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]


# --- 2. The model-parallel RNG tracker ---------------------------------------------------------------------------
class CpuRNGStatesTracker:
    """A drop-in for megatron's CudaRNGStatesTracker that keeps CPU generator states.

    `fork(name)` swaps the default CPU generator to the named state (where CPU dropout draws from), and restores it
    afterwards, exactly as the CUDA tracker does for the CUDA generator. Megatron forks it during weight init even
    with dropout 0, so it is needed for every model.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _shim_rng_tracker() -> None:
    random, _ = _resolve("megatron.core.tensor_parallel.random", "_CUDA_RNG_STATE_TRACKER")
    _resolve("megatron.core.tensor_parallel.random", "_CUDA_RNG_STATE_TRACKER_INITIALIZED")
    _resolve("megatron.core.tensor_parallel.random", "initialize_rng_tracker")
    if not isinstance(random._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
        random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    # Marked initialised so that initialize_rng_tracker() keeps ours instead of building a CUDA one.
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


# --- 3. Default causal mask --------------------------------------------------------------------------------------
# `get_default_causal_mask` builds on device "cuda" when attention_mask is None. Our code always passes masks; this
# keeps megatron's own fallback usable on CPU too.
def _shim_default_mask() -> None:
    utils, _ = _resolve("megatron.core.transformer.utils", "get_default_causal_mask")
    softmax, _ = _resolve("megatron.core.fusions.fused_softmax", "get_default_causal_mask")

    @functools.lru_cache(maxsize=8)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    utils.get_default_causal_mask = get_default_causal_mask
    softmax.get_default_causal_mask = get_default_causal_mask


# --- 3b. Sliding-window causal mask ------------------------------------------------------------------------------
# `get_sliding_window_causal_mask` (a window_size layer of DotProductAttention: gpt-oss) builds on device "cuda".
# The same triu / tril arithmetic on the CPU; True = masked, as megatron's.
def _shim_window_mask() -> None:
    utils, _ = _resolve("megatron.core.transformer.utils", "get_sliding_window_causal_mask")
    softmax, _ = _resolve("megatron.core.fusions.fused_softmax", "get_sliding_window_causal_mask")

    def get_sliding_window_causal_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
        m = torch.ones(sq, skv, dtype=torch.bool)
        mu = torch.triu(m, diagonal=skv - sq - window_size[0])
        return ~torch.tril(mu, diagonal=skv - sq + window_size[1])

    utils.get_sliding_window_causal_mask = get_sliding_window_causal_mask
    softmax.get_sliding_window_causal_mask = get_sliding_window_causal_mask


# --- 4. RoPE slicing under context parallel ----------------------------------------------------------------------
# megatron's zigzag slice of the rotary table pins memory and calls `.cuda()`. Same slice, on the table's device.
def _shim_rope_cp() -> None:
    rope_utils, _ = _resolve(
        "megatron.core.models.common.embeddings.rope_utils", "get_pos_emb_on_this_cp_rank"
    )
    rotary, _ = _resolve(
        "megatron.core.models.common.embeddings.rotary_pos_embedding", "get_pos_emb_on_this_cp_rank"
    )
    yarn, _ = _resolve(
        "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding", "get_pos_emb_on_this_cp_rank"
    )

    def get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
        pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1 :])
        pos_emb = pos_emb.index_select(seq_dim, cp_idx)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])

    rope_utils.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank
    rotary.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank
    yarn.get_pos_emb_on_this_cp_rank = (
        get_pos_emb_on_this_cp_rank  # its constructor slices its cache (gpt-oss)
    )


# --- 5. Pipeline schedules' tensor factories ---------------------------------------------------------------------
# schedules.py creates `torch.zeros([], dtype=torch.int, device="cuda")` token counters. We give the module a view
# of torch whose factories map device "cuda" to the CPU; every other attribute is torch's own.
class _CpuTorchView:
    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name in ("zeros", "ones", "empty", "tensor", "full"):
            return _cpu_factory(attr)
        return attr


def _cpu_factory(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cuda":
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return wrapped


def _shim_schedules() -> None:
    schedules, real = _resolve("megatron.core.pipeline_parallel.schedules", "torch")
    _resolve("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining")
    if not isinstance(real, _CpuTorchView):
        schedules.torch = _CpuTorchView(real)


_SHIMS: dict[str, Callable[[], None]] = {
    "current_device": _shim_current_device,
    "rng_tracker": _shim_rng_tracker,
    "default_causal_mask": _shim_default_mask,
    "window_causal_mask": _shim_window_mask,
    "rope_cp_slice": _shim_rope_cp,
    "schedule_factories": _shim_schedules,
}


def apply_shims(shims: dict[str, Any], applied: dict[str, bool], *, force: bool = False) -> list[str]:
    """Apply each of `shims` once (when CUDA is absent, or `force`), recording it in `applied`. Returns the names
    applied by this call. Shared by the CPU shims here and the optimizer shims (compat/optimizer.py)."""
    if not (force or needs_cpu_shims()):
        return []
    done = []
    for name, shim in shims.items():
        if applied.get(name):
            continue
        shim()
        applied[name] = True
        done.append(name)
    return done


def apply_cpu_shims(*, force: bool = False) -> list[str]:
    """Apply every CPU shim once (when CUDA is absent, or `force`). Returns the names applied by this call."""
    return apply_shims(_SHIMS, _APPLIED, force=force)


def applied_shims() -> list[str]:
    return [n for n, ok in _APPLIED.items() if ok]
