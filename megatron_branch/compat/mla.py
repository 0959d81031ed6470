"""The one shim megatron-core 0.16.1's multi-latent attention (transformer/multi_latent_attention.py) needs
without TransformerEngine.

`MultiLatentAttention.__init__` tests `HAVE_TE and isinstance(self.linear_proj, TELinear)`; with TE absent the
module's import of megatron.core.extensions.transformer_engine still succeeds (that module binds stand-in mocks
for TE's classes), so HAVE_TE is True and `isinstance(..., <a mock>)` raises TypeError. The shim sets the module's
HAVE_TE to False, what megatron's own fallback branch (`except ImportError`) sets: the check is about TE's
fp8 / fp4 linear_proj only, so nothing computed changes. Idempotent; refuses (`CompatError`) when megatron no
longer has the name; tests/unit/test_deepseek_v3.py builds an MLA model, which fails without it.
"""

from __future__ import annotations

from megatron_branch.compat.cpu import _resolve, apply_shims
from megatron_branch.compat.moe import needs_te_shim

__all__ = ["apply_mla_shims"]

_APPLIED: dict[str, bool] = {}
_MLA = "megatron.core.transformer.multi_latent_attention"


def _shim_have_te() -> None:
    mod, _ = _resolve(_MLA, "HAVE_TE")
    mod.HAVE_TE = False


def apply_mla_shims(*, force: bool = False) -> list[str]:
    """Apply the MLA shim where TransformerEngine is absent (or `force`). Returns the names applied by this call."""
    shims = {"mla_have_te": _shim_have_te} if force or needs_te_shim() else {}
    return apply_shims(shims, _APPLIED, force=True)
