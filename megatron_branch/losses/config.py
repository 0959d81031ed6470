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

RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
"""verl 0.9.1's rollout_rs criteria (rollout_corr_helper.SUPPORTED_ROLLOUT_RS_OPTIONS)."""
TOKEN_RS_OPTIONS = ("token_k1", "token_k2", "token_k3")

KL_TYPES = ("k1", "k2", "k3")
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
"""verl's names for the same estimators."""
DPO_LOSSES = ("sigmoid", "ipo")
IS_LEVELS = ("token", "sequence")
"""gspo's importance-sampling level: verl's GSPO-token, or TRL's importance_sampling_level="sequence"."""


@dataclass(kw_only=True)
class ObjectiveConfig:
    """The policy objective and its settings (verl's actor keys where verl has them)."""

    policy_loss: str = "vanilla"
    """Registered objective (losses/registry.py): vanilla (= grpo: clipped surrogate + KL + entropy bonus), pg (the
    linear policy gradient), gspo, cispo, sapo, geo_mean, clip_cov, kl_cov, dpo, verl:<loss_mode> (verl's own
    function), or one a plugin registers."""
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
    use_bias_correction_kl: bool = False
    """Multiply the KL estimate by the importance ratio r, with its gradient (TRL's use_bias_correction_kl,
    DeepSeek-V3.2's unbiased KL; verl has none)."""
    entropy_token_mean: bool = False
    """Average the entropy bonus over all response tokens of the batch (TRL) instead of with loss_agg_mode
    (verl)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """gspo: token = verl's GSPO-token (each token's gradient weighted by s_i); sequence = TRL's
    importance_sampling_level="sequence" (the gradient of the sequence ratio itself)."""
    rollout_is: Literal["token", "sequence"] | None = None
    """Rollout correction (verl's algorithm.rollout_correction.rollout_is): truncated importance weights
    exp(old_logprobs - rollout_logprobs) on the policy term, per token or per sequence; None = off."""
    rollout_is_threshold: float = 2.0
    """Upper truncation of those weights (verl's rollout_is_threshold, TIS)."""
    rollout_is_threshold_lower: float | None = None
    """IcePop (masked IS): weights outside [rollout_is_threshold_lower, rollout_is_threshold] are zeroed instead of
    truncated (verl's rollout_is_threshold "lower_upper"); None = TIS."""
    rollout_rs: str | None = None
    """Rollout rejection sampling (verl's algorithm.rollout_correction.rollout_rs): comma-separated criteria on
    log(old / rollout) of verl 0.9.1 (token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2, seq_max_k3); a
    rejected token, or every token of a rejected rollout, leaves the loss as loss_mask 0 does (computed by verl's own
    compute_rollout_rejection_mask: needs the verl extra); None = off."""
    rollout_rs_threshold: float | str | None = None
    """Thresholds of rollout_rs (verl's rollout_rs_threshold, which takes a number or a string): one number for all
    criteria, or a string of one bound per criterion, comma-separated; *_k1 take ratio bounds "lower_upper" (or an
    upper u, lower 1/u), k2/k3 an upper bound."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: fraction of the batch's (rollout, token) pairs whose gradient is cut (verl's
    policy_loss.clip_cov_ratio)."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower bound of a candidate's advantage-logprob covariance."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of that covariance."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: fraction of the batch's pairs that get the |log-ratio| penalty (verl's policy_loss.kl_cov_ratio)."""
    ppo_kl_coef: float = 0.1
    """kl_cov: coefficient of that penalty (verl's policy_loss.ppo_kl_coef)."""
    tau_pos: float = 1.0
    """sapo: temperature of the gate where A > 0 (verl's actor.tau_pos)."""
    tau_neg: float = 1.05
    """sapo: temperature of the gate where A <= 0 (verl's actor.tau_neg)."""
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
        if self.importance_sampling_level not in IS_LEVELS:
            self._bad("importance_sampling_level", f"must be one of {', '.join(IS_LEVELS)}")
        if self.importance_sampling_level != "token" and self.policy_loss != "gspo":
            raise SettingError(
                lambda s: (
                    f"{s.value('importance_sampling_level', self.importance_sampling_level)} is gspo's (TRL's GSPO); "
                    f"{s.name('policy_loss')} is {self.policy_loss!r}"
                )
            )
        if self.rollout_is is not None:
            if self.rollout_is not in ("token", "sequence"):
                self._bad("rollout_is", "must be token or sequence")
            if self.policy_loss not in (None, "vanilla", "grpo", "gspo", "cispo", "sapo"):
                raise SettingError(
                    lambda s: (
                        f"{s.name('rollout_is')} weights the per-token policy term of vanilla, gspo, cispo and "
                        f"sapo, not {self.policy_loss!r}"
                    )
                )
        if self.rollout_rs is not None:
            self._check_rollout_rs()
        elif self.rollout_rs_threshold is not None:
            self._bad("rollout_rs_threshold", "is rollout_rs's threshold; rollout_rs is off")
        if not self.rollout_is_threshold > 0:
            self._bad("rollout_is_threshold", "must be positive")
        low = self.rollout_is_threshold_lower
        if low is not None and not 0 <= low < self.rollout_is_threshold:
            self._bad(
                "rollout_is_threshold_lower",
                f"must be in [0, rollout_is_threshold={self.rollout_is_threshold})",
            )
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            if not 0 < getattr(self, name) <= 1:
                self._bad(name, "must be in (0, 1]")
        if not self.clip_cov_lb < self.clip_cov_ub:
            self._bad("clip_cov_lb", f"must be below clip_cov_ub ({self.clip_cov_ub})")
        for name in ("tau_pos", "tau_neg"):
            if not getattr(self, name) > 0:
                self._bad(name, "must be positive")
        if not self.dpo_beta > 0:
            self._bad("dpo_beta", "must be positive")
        if self.dpo_loss not in DPO_LOSSES:
            self._bad("dpo_loss", f"must be one of {', '.join(DPO_LOSSES)}")

    def _check_rollout_rs(self) -> None:
        """verl's rules for rollout_rs and its thresholds (rollout_corr_helper._parse_rollout_rs_thresholds)."""
        options = [o.strip() for o in str(self.rollout_rs).split(",") if o.strip()]
        bad = [o for o in options if o not in RS_OPTIONS]
        if not options or bad:
            self._bad("rollout_rs", f"must be comma-separated criteria among {', '.join(RS_OPTIONS)}")
        if self.rollout_rs_threshold is None:
            self._bad("rollout_rs_threshold", f"is required with rollout_rs={self.rollout_rs!r}")
        if isinstance(self.rollout_rs_threshold, bool) or not isinstance(
            self.rollout_rs_threshold, (int, float, str)
        ):
            self._bad("rollout_rs_threshold", "must be a number or a string of bounds (verl's types)")
        specs = [p.strip() for p in str(self.rollout_rs_threshold).split(",") if p.strip()]
        if len(specs) not in (1, len(dict.fromkeys(options))):
            self._bad("rollout_rs_threshold", "must hold one threshold, or one per rollout_rs criterion")
        for option, spec in zip(dict.fromkeys(options), specs * len(options) if len(specs) == 1 else specs):
            bounds = spec.split("_", 1) if option.endswith("k1") else [spec]
            try:  # float() reads "0.1_2" as 0.12: an "_" is a bound separator, never a digit separator
                values = (
                    [float(b) for b in bounds if "_" not in b] if len(bounds) == spec.count("_") + 1 else []
                )
            except ValueError:
                values = []
            if not values or min(values) <= 0 or values != sorted(values):
                what = (
                    "a positive upper ratio bound or lower_upper"
                    if option.endswith("k1")
                    else "one positive bound"
                )
                self._bad("rollout_rs_threshold", f"for {option} must be {what}")
        if self.rollout_is == "sequence" and any(o in TOKEN_RS_OPTIONS for o in options):
            # verl weighs a sequence by ALL its tokens before rejecting some; here a rejected token leaves the
            # rollout's pairs, so the sequence weight would differ: refused rather than silently different
            self._bad("rollout_rs", "rejects tokens; with rollout_is=sequence reject whole rollouts (seq_*)")

    def _bad(self, name: str, problem: str) -> None:
        value = getattr(self, name)
        raise SettingError(lambda s: f"{s.name(name)} {problem}, got {value!r}")
