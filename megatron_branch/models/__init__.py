"""Model construction: architecture mapping and the megatron-core GPT model with branch-aware attention."""

from megatron_branch.models.arch import ModelArch
from megatron_branch.models.critic import BranchCriticModel, build_critic
from megatron_branch.models.gpt import BranchGPTModel, branch_layer_spec, build_model

__all__ = [
    "BranchCriticModel",
    "BranchGPTModel",
    "ModelArch",
    "branch_layer_spec",
    "build_critic",
    "build_model",
]
