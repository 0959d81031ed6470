"""Checkpoint conversion: Hugging Face (Llama, Qwen2, Qwen3, Qwen3.5) <-> megatron-core distributed checkpoints, and TP gathering."""

from megatron_branch.checkpoint.hf_io import HFTensorReader, load_hf_config, write_hf_folder
from megatron_branch.checkpoint.hf_to_mcore import convert_hf_to_mcore, save_mcore_checkpoint
from megatron_branch.checkpoint.mcore_to_hf import convert_mcore_to_hf, load_mcore_checkpoint, read_meta
from megatron_branch.checkpoint.param_map import (
    hf_to_mcore_state,
    iter_hf_to_mcore,
    iter_mcore_to_hf,
    mcore_to_hf_state,
)
from megatron_branch.checkpoint.tp import (
    gather_full_grads,
    gather_full_state,
    load_full_state,
    load_full_tensor,
)

__all__ = [
    "HFTensorReader",
    "convert_hf_to_mcore",
    "convert_mcore_to_hf",
    "gather_full_grads",
    "gather_full_state",
    "hf_to_mcore_state",
    "iter_hf_to_mcore",
    "iter_mcore_to_hf",
    "load_full_state",
    "load_full_tensor",
    "load_hf_config",
    "load_mcore_checkpoint",
    "mcore_to_hf_state",
    "read_meta",
    "save_mcore_checkpoint",
    "write_hf_folder",
]
