"""Using branch replay from an existing megatron-core run.

* model side: `patch_layer_spec` (our core attention in the spec's attention slot, local or TE spec) and
  `enable_position_rope` (RoPE follows position ids);
* step side: `get_forward_backward_func()`, a drop-in for megatron-core's, whose data iterator yields rollout
  batches that run as one prefix tree;
* for code that cannot be edited: `with megatron_branch.patched(): ...` does all three by a reversible monkeypatch.

patches/ shows the change on two example scripts.
"""

from megatron_branch.integration.patching import TESTED_MEGATRON_CORE, patched
from megatron_branch.integration.schedule import BranchForwardBackward, get_forward_backward_func
from megatron_branch.integration.spec import patch_layer_spec
from megatron_branch.models.rotary import enable_position_rope

__all__ = [
    "TESTED_MEGATRON_CORE",
    "BranchForwardBackward",
    "enable_position_rope",
    "get_forward_backward_func",
    "patch_layer_spec",
    "patched",
]
