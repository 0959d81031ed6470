"""Command implementations behind the `megatron-branch` CLI."""
