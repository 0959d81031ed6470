#!/usr/bin/env bash
# CPU demo at world 4: TP2 x CP2 with sequence parallel. A tiny random Qwen2-style model and a branching rollout file are made offline
# (examples/make_tiny_assets.py), then one exact replay step writes the gradients under HF names and prints
# its JSON line (loss, positions logical/computed).
#
#     bash examples/launch/cpu_world4.sh [WORK_DIR]        # MB_DRY_RUN=1 prints the commands instead
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
WORK=${1:-${WORK:-/tmp/megatron-branch-demo}}
NPROC=4
run mkdir -p "$WORK"
run $PYTHON "$HERE/../make_tiny_assets.py" --out "$WORK"
run $TORCHRUN --standalone --nproc_per_node $NPROC -m megatron_branch grad --hf "$WORK/hf" \
    --rollouts "$WORK/rollouts.jsonl" --out "$WORK/grads_world4.safetensors" --schedule replay --tp 2 --cp 2 --sequence-parallel
