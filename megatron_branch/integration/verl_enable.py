"""The one switch that turns branch replay on in verl (docs/verl.md):

    actor_rollout_ref.model.external_lib=megatron_branch.integration.verl_enable

verl imports `model.external_lib` in every worker process when it builds the model config, before it creates the
engines; importing this module registers the branch-replay engine for verl's Megatron language models there
(`megatron_branch.integration.verl.register`). Nothing else in verl's configuration changes.
"""

from megatron_branch.integration.verl import register

ENGINE = register()
"""The registered engine class (a subclass of the engine verl would otherwise build)."""
