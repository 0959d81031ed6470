#!/usr/bin/env bash
# The 2.1M-position target on one 8-GPU node: 16 rollouts x 131,072 positions (a 122,880-token prompt shared by
# 16 responses of 8,192 tokens), qwen2.5-32b, TP2 x CP4, exact branch replay (one step, gradients under HF names).
#
# Settings from the planner (docs/planner.md):
#     megatron-branch plan --model qwen2.5-32b --prompt-length 122880 --responses 16 --response-length 8192 \
#         --gpus 8 --gpu h20 --tp 2 --cp 4 --dp 1 --recompute full --branch-micro-batch 8 --optimizer distributed --offload-fraction 0
# -> does NOT fit on 8 x H20: 194.2 GB per rank at TP2 x CP4 even with full recompute (largest term:
#    gradients, 65.5 GB). The planner's nearest: TP4 x CP2 + full recompute on 8 x H200 with the distributed
#    optimizer (140.6 GB of 141), or 16 x H20 (TP8 x CP2); with the optimizer state offloaded to
#    the host (a training run), TP8 + full recompute fits on 8 x H20 (docs/planner.md); the search, PP
#    included, keeps it.
#
# Runs `megatron-branch grad`: one step's exact gradient in float32, without an optimizer step (the TRAINING run of
# the 2.1M target with the planner's own layout is target_32b_train.sh / target_27b_train.sh, in bf16). Before launching, the planner is
# asked about THIS run (float32, RECOMPUTE=full by default: grad --recompute --recompute-layers; selective =
# --recompute only) and the script stops with its verdict if that does not fit (FORCE=1 launches anyway).
#
#     MODEL=HF_DIR ROLLOUTS=rollouts.jsonl [OUT=grads.safetensors] [GPU=h20|h100|h200] bash examples/launch/target_32b_tp2cp4.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
grad_2p1m qwen2.5-32b 2 4
