"""Branch replay inside verl's MegatronEngine (verl 0.9.1): the policy update and `compute_log_prob` run as one
prefix tree per step, with verl's own loss, micro-batching, metrics and output layout.

The switch (docs/verl.md): `actor_rollout_ref.model.external_lib=megatron_branch.integration.verl_enable`. verl
imports that module in every worker when it builds the model config; the import calls `register()`, which puts
`branch_engine_class(<verl's engine for this device>)` into verl's `EngineRegistry` under this platform's vendor
key (looked up before the device-only default), for language models and value models (PPO's critic: the schedules
read its one-output head's value per row). Nothing of verl is forked or edited.

What the subclass changes (everything else is verl's code, running unchanged):

* `initialize()`: after verl builds the model, each layer's core attention becomes `BranchFallbackAttention`
  (the original module, e.g. TEDotProductAttention, when no BranchContext is attached: verl's own paths keep
  working), a hybrid's GatedDeltaNet becomes `BranchGatedDeltaNet` (its state follows the tree) and RoPE follows
  explicit position ids (`enable_position_rope`): verl_model.py. Settings and models branch replay does not
  support are refused here, with one line (`refuse_unsupported`).
* `forward_backward_batch()`: verl's own method runs, with megatron's `get_forward_backward_func` replaced, for
  the duration of the call only, by `VerlTreeStep` (verl_step.py): the step's micro-batches as one prefix tree.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from megatron_branch.errors import SettingError
from megatron_branch.integration import verl_moe
from megatron_branch.integration.verl_model import patch_verl_model, unwrap
from megatron_branch.integration.verl_pp import refuse_pipeline
from megatron_branch.integration.verl_step import BranchOptions, VerlBranchError, VerlTreeStep
from megatron_branch.rules import check_verl_model

__all__ = [
    "TESTED_VERL",
    "BranchOptions",
    "VerlBranchError",
    "branch_engine_class",
    "check_verl_version",
    "refuse_unsupported",
    "register",
    "unregister",
]

logger = logging.getLogger(__name__)

TESTED_VERL = ("0.9.1",)
"""verl versions whose engine internals this was tested against (tests/unit/test_verl_engine.py)."""


def check_verl_version() -> None:
    import verl

    if verl.__version__ not in TESTED_VERL:
        raise VerlBranchError(
            f"megatron_branch.integration.verl was tested with verl {', '.join(TESTED_VERL)}, not "
            f"{verl.__version__}; pin verl or check the engine internals it relies on (docs/verl.md)"
        )


def refuse_unsupported(engine_config: Any, tf_config: Any = None) -> None:
    """One clear line for each verl setting the tree step does not support; with `tf_config` (after verl built the
    model), for each kind of model it cannot run (rules.check_verl_model). Pipeline parallelism: verl_pp.py."""
    if engine_config.dynamic_context_parallel:  # context_parallel_size > 1 runs (verl_cp.py says how)
        raise VerlBranchError(
            "branch replay in verl's engine does not support dynamic_context_parallel (a CP group per "
            "micro-batch; megatron-core 0.16.1 has no dynamic DPxCP groups): use context_parallel_size"
        )
    if engine_config.use_fused_kernels:
        raise VerlBranchError(
            "branch replay computes its own logprobs: set actor_rollout_ref.model.use_fused_kernels=False"
        )
    if not engine_config.use_remove_padding:
        raise VerlBranchError("branch replay reads verl's no-padding batches: set use_remove_padding=True")
    if tf_config is None:
        return
    try:  # the model verl built: what patch_verl_model can wrap (rules/)
        check_verl_model(
            attention_variant=getattr(tf_config, "experimental_attention_variant", None),
            rotary_interleaved=bool(getattr(tf_config, "rotary_interleaved", False)),
            moe_reason=verl_moe.refusal_reason(tf_config) if verl_moe.is_moe(tf_config) else None,
            gdn_heads=_gdn_heads(tf_config),
            tp=int(getattr(tf_config, "tensor_model_parallel_size", 1) or 1),
            cp=int(engine_config.context_parallel_size),
            position_embedding=str(getattr(tf_config, "position_embedding_type", "rope")),
        )
    except SettingError as e:
        raise VerlBranchError(str(e)) from None


def _gdn_heads(tf_config: Any) -> tuple[int, int] | None:
    """A hybrid's (key, value) gated delta net heads (megatron's TransformerConfig fields), else None."""
    if getattr(tf_config, "experimental_attention_variant", None) != "gated_delta_net":
        return None
    return int(tf_config.linear_num_key_heads), int(tf_config.linear_num_value_heads)


def branch_engine_class(base: type, options: BranchOptions | None = None) -> type:
    """A subclass of verl's engine class `base` whose steps run as one prefix tree (module doc)."""
    opts = options or BranchOptions()

    class BranchReplayEngine(base):  # type: ignore[misc, valid-type]
        branch_options = opts

        def initialize(self) -> None:
            check_verl_version()
            refuse_unsupported(self.engine_config)
            refuse_pipeline(self.engine_config, self.branch_options)
            super().initialize()
            refuse_unsupported(self.engine_config, self.tf_config)
            refuse_pipeline(
                self.engine_config,
                self.branch_options,
                self.tf_config,
                moe=verl_moe.is_moe(self.tf_config),
            )
            if getattr(self, "is_value_model", False) and self.branch_options.schedule == "naive":
                raise VerlBranchError("verl's value model runs with the replay or packed schedule, not naive")
            for chunk in self.module:
                patch_verl_model(unwrap(chunk))
                verl_moe.patch_verl_moe(unwrap(chunk), self.model_config.hf_config)
                if getattr(self, "is_value_model", False):
                    unwrap(chunk).is_critic = True  # the schedules read the one-output head's value per row

        def forward_backward_batch(
            self, data: Any, loss_function: Callable, forward_only: bool = False
        ) -> Any:
            import verl.workers.engine.megatron.transformer_impl as impl

            step = VerlTreeStep(engine=self, options=self.branch_options)
            saved = impl.get_forward_backward_func
            impl.get_forward_backward_func = lambda *a, **k: step
            try:
                return super().forward_backward_batch(data, loss_function, forward_only=forward_only)
            finally:
                impl.get_forward_backward_func = saved

    BranchReplayEngine.__name__ = BranchReplayEngine.__qualname__ = f"BranchReplay{base.__name__}"
    return BranchReplayEngine


def _engine_key() -> tuple[str, str]:
    """The (device, vendor) key verl's EngineRegistry.get_engine_cls looks up first (its env overrides too)."""
    import os

    from verl.utils.device import get_device_name, get_vendor

    return os.getenv("VERL_ENGINE_DEVICE") or get_device_name(), os.getenv(
        "VERL_ENGINE_VENDOR"
    ) or get_vendor()


MODEL_TYPES = ("language_model", "value_model")
"""verl's engine kinds the switch replaces: the actor / reference policy, and PPO's critic."""


def register(options: BranchOptions | None = None) -> type:
    """Register the branch-replay engine for verl's language models and value models (the critic) on this
    process's platform (idempotent); returns the language-model class."""
    from verl.workers.engine import EngineRegistry

    check_verl_version()
    out = []
    for model_type in MODEL_TYPES:
        try:
            current = EngineRegistry.get_engine_cls(model_type=model_type, backend="megatron")
        except (AssertionError, ValueError):  # verl's lookup: no engine of this kind for this device
            if model_type == "language_model":
                raise
            continue  # a platform without verl's Megatron value engine: the actor alone runs with the tree
        if getattr(current, "branch_options", None) is not None:
            out.append(current)
            continue
        cls = branch_engine_class(current, options)
        device, vendor = _engine_key()
        registry = EngineRegistry._engines[model_type]["megatron"]
        registry[(device, vendor)] = (
            cls  # the (device, vendor) key is looked up before the device-only default
        )
        if dist.is_initialized() and dist.get_rank() == 0:
            logger.warning(
                "megatron-branch: verl's Megatron engine runs with branch replay (%s)", cls.__name__
            )
        out.append(cls)
    return out[0]


def unregister() -> None:
    """Undo `register()` in this process (tests compare verl with and without the switch in one process)."""
    from verl.workers.engine import EngineRegistry

    key = _engine_key()
    for model_type in MODEL_TYPES:
        registry = EngineRegistry._engines.get(model_type, {}).get("megatron", {})
        if getattr(registry.get(key), "branch_options", None) is not None:
            del registry[key]
