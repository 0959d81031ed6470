"""The one objective config: what every objective is built from, in verl's names, validated once.

    cfg = ObjectiveConfig(policy_loss="vanilla", clip_ratio_c=3.0, kl_loss_coef=0.001)
    objective = build_objective(cfg, batch)        # losses/registry.py: the registered class, normalised on batch

`megatron-branch grad` maps its flags onto these fields (`--clip-low` is an alias of `--clip-ratio-low`, ...), the
train config's `actor` section IS this class (plus the update split), so both build objectives through the same
builder from the same names. A bad value is a SettingError naming the field as the entry point spells it
(`--clip-ratio-c` on the command line, `actor.clip_ratio_c` in a config).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_branch.errors import SettingError
from megatron_branch.losses.aggregation import AGG_MODES

KL_TYPES = ("k1", "k2", "k3")
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
"""verl's names for the same estimators."""
DPO_LOSSES = ("sigmoid", "ipo")


@dataclass(kw_only=True)
class ObjectiveConfig:
    """The policy objective and its settings (verl's actor keys where verl has them)."""

    policy_loss: str = "vanilla"
    """Registered objective (losses/registry.py): vanilla (= grpo: clipped surrogate + KL + entropy bonus), pg (the
    linear policy gradient), dpo, or one a plugin registers."""
    clip_ratio_low: float = 0.2
    """Lower clip of the importance ratio: 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """Upper clip: 1 + clip_ratio_high (DAPO's clip-higher when larger than clip_ratio_low)."""
    clip_ratio_c: float | None = None
    """Dual clip for negative advantages (verl applies 3.0); None = off; must be > 1."""
    kl_loss_coef: float = 0.0
    """KL-to-reference coefficient (needs ref_logprobs: scored by a frozen reference when it is > 0)."""
    kl_loss_type: Literal["k1", "k2", "k3", "kl", "mse", "low_var_kl"] = "low_var_kl"
    """KL estimator (verl's names are aliases: kl = k1, mse = k2, low_var_kl = k3). The default is verl's actor
    default (verl/trainer/config/actor/actor.yaml: kl_loss_type: low_var_kl), for train and grad alike."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (the loss subtracts entropy_coeff * H)."""
    loss_agg_mode: Literal[
        "token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How per-token losses aggregate over the GLOBAL batch's trained tokens (losses/aggregation.py)."""
    loss_agg_norm: float | None = None
    """L_norm of seq-mean-token-sum-norm (required there, refused elsewhere)."""
    entropy_metric: bool = False
    """Report actor/entropy even when entropy_coeff is 0 (one sum per row in the fused projection)."""
    dpo_beta: float = 0.1
    """DPO: beta (the IPO regulariser's 1/(2 beta) target)."""
    dpo_loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """DPO: loss form."""

    def __post_init__(self) -> None:
        if not 0 <= self.clip_ratio_low < 1:
            self._bad("clip_ratio_low", "must be in [0, 1) (r is clipped at 1 - clip_ratio_low)")
        if self.clip_ratio_high < 0:
            self._bad("clip_ratio_high", "must be >= 0")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            self._bad("clip_ratio_c", "must be > 1 (the dual-clip bound for A < 0; verl uses 3.0)")
        for name in ("kl_loss_coef", "entropy_coeff"):
            if getattr(self, name) < 0:
                self._bad(name, "must be >= 0")
        if self.kl_loss_type not in KL_TYPES and self.kl_loss_type not in KL_ALIASES:
            self._bad("kl_loss_type", f"must be one of {', '.join((*KL_TYPES, *KL_ALIASES))}")
        if self.loss_agg_mode not in AGG_MODES:
            self._bad("loss_agg_mode", f"must be one of {', '.join(AGG_MODES)}")
        norm = self.loss_agg_norm
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and (norm is None or not norm > 0):
            raise SettingError(
                lambda s: (
                    f"{s.value('loss_agg_mode', self.loss_agg_mode)} needs a positive "
                    f"{s.name('loss_agg_norm')} (L_norm)"
                )
            )
        if self.loss_agg_mode != "seq-mean-token-sum-norm" and norm is not None:
            raise SettingError(
                lambda s: (
                    f"{s.name('loss_agg_norm')} is only used by seq-mean-token-sum-norm, not "
                    f"{s.value('loss_agg_mode', self.loss_agg_mode)}"
                )
            )
        if not self.dpo_beta > 0:
            self._bad("dpo_beta", "must be positive")
        if self.dpo_loss not in DPO_LOSSES:
            self._bad("dpo_loss", f"must be one of {', '.join(DPO_LOSSES)}")

    def _bad(self, name: str, problem: str) -> None:
        value = getattr(self, name)
        raise SettingError(lambda s: f"{s.name(name)} {problem}, got {value!r}")
