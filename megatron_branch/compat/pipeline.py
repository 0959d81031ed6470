"""Shims that let megatron-core 0.16.1's pipeline parallelism (stage models, p2p) run on a machine without CUDA.

Like compat/cpu.py, each shim replaces exactly one CUDA assumption, is applied only without CUDA (or forced), is
idempotent, and checks that the name it patches still exists (`CompatError` otherwise); tests/unit/test_compat.py
checks the targets, tests/distributed/test_pipeline.py runs what needs them (and fails without them). On a GPU
nothing here runs.

1. The tied embedding's copy on the last stage. With `share_embeddings_and_output_weights` and more than one stage,
   `LanguageModule.setup_embeddings_and_output_layer` zeroes the last stage's output weight and all-reduces it over
   the embedding group (first + last stage) so that both stages start from the first stage's embedding; before the
   all-reduce it moves the weight with `weight.data = weight.data.cuda()`. The shim runs that method with
   `Tensor.cuda` returning the tensor itself (the same all-reduce, on the CPU), for the duration of the call only.
2. `torch.cuda.synchronize()` in the p2p layer. `P2PCommunicator` synchronises the device after batched
   `batch_isend_irecv` calls (`batch_p2p_sync`, on by default) and after exchanging shapes (`variable_seq_lengths`);
   on the CPU there is no device to wait for, and gloo's requests were already waited on. The p2p module gets a
   view of torch whose `cuda.synchronize` does nothing; every other attribute is torch's own.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_branch.compat.cpu import _resolve, apply_shims

__all__ = ["apply_pipeline_shims", "pipeline_shims"]

_APPLIED: dict[str, bool] = {}
_LANGUAGE_MODULE = "megatron.core.models.common.language_module.language_module"
_P2P = "megatron.core.pipeline_parallel.p2p_communication"


@contextlib.contextmanager
def _tensor_cuda_is_identity() -> Iterator[None]:
    """`Tensor.cuda()` returns the tensor itself while inside (no CUDA: the tensor stays where it is)."""
    real = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = real  # type: ignore[method-assign]


def _shim_embedding_copy() -> None:
    _, cls = _resolve(_LANGUAGE_MODULE, "LanguageModule")
    real = getattr(cls, "setup_embeddings_and_output_layer", None)
    if real is None:
        from megatron_branch.compat.cpu import CompatError

        raise CompatError(
            "megatron-core changed: LanguageModule.setup_embeddings_and_output_layer is gone; megatron-branch's "
            "pipeline shims target megatron-core 0.16.1"
        )
    if getattr(real, "_megatron_branch_cpu", False):
        return

    @functools.wraps(real)
    def setup_embeddings_and_output_layer(self: Any) -> None:
        with _tensor_cuda_is_identity():
            real(self)

    setup_embeddings_and_output_layer._megatron_branch_cpu = True  # type: ignore[attr-defined]
    cls.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


class _CudaWithoutSync:
    """torch.cuda with a `synchronize` that does nothing (no device to wait for)."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        if name == "synchronize":
            return lambda *args, **kwargs: None
        return getattr(self._real, name)


class _TorchWithoutSync:
    """torch, whose `cuda` is `_CudaWithoutSync` (the p2p module's view; nothing else sees it)."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        if name == "cuda":
            return _CudaWithoutSync(self._real.cuda)
        return getattr(self._real, name)


def _shim_p2p_sync() -> None:
    p2p, real = _resolve(_P2P, "torch")
    _resolve(_P2P, "P2PCommunicator")
    if not isinstance(real, _TorchWithoutSync):
        p2p.torch = _TorchWithoutSync(real)


def pipeline_shims() -> dict[str, Callable[[], None]]:
    return {"embedding_copy": _shim_embedding_copy, "p2p_synchronize": _shim_p2p_sync}


def apply_pipeline_shims(*, force: bool = False) -> list[str]:
    """Apply the pipeline shims once (when CUDA is absent, or `force`); returns the names applied by this call."""
    return apply_shims(pipeline_shims(), _APPLIED, force=force)
