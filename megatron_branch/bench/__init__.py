"""`megatron-branch bench`: the variants a user could run instead, measured round-robin in one process."""
