"""megatron-branch: exact shared-prefix ("branch replay") RL training for Megatron-Core."""

__version__ = "0.1.0"
