#!/usr/bin/env bash
# The 2.1M-position target on one 8-GPU node: 16 rollouts x 131,072 positions (a 122,880-token prompt shared by
# 16 responses of 8,192 tokens), qwen2.5-7b, TP1 x CP8, exact branch replay (one step, gradients under HF names).
#
# Settings from the planner (docs/planner.md):
#     megatron-branch plan --model qwen2.5-7b --prompt-length 122880 --responses 16 --response-length 8192 \
#         --gpus 8 --gpu h20 --tp 1 --cp 8 --dp 1 --recompute full --branch-micro-batch 8 --optimizer distributed --offload-fraction 0
# -> fits: 77.3 GB per rank of 96 (bf16, full recompute), step ~108 s on H20, 4.48x fewer FLOPs than naive.
#    With segment recompute only (selective): does NOT fit (185.3 GB bf16, 314.1 GB float32; largest term:
#    activations of the 15,360-row prompt shard). In float32 (what grad computes in) full does not fit at CP8
#    either (98.1 GB: float32 weights and grads, which CP does not shard): the preflight stops this script;
#    target_7b_tp2cp4.sh fits in float32.
#
# Runs `megatron-branch grad`: one step's exact gradient in float32, without an optimizer step (the TRAINING run of
# the 2.1M target with the planner's own layout is target_32b_train.sh / target_27b_train.sh, in bf16). Before launching, the planner is
# asked about THIS run (float32, RECOMPUTE=full by default: grad --recompute --recompute-layers; selective =
# --recompute only) and the script stops with its verdict if that does not fit (FORCE=1 launches anyway).
#
#     MODEL=HF_DIR ROLLOUTS=rollouts.jsonl [OUT=grads.safetensors] [GPU=h20|h100|h200] bash examples/launch/target_7b_cp8.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
grad_2p1m qwen2.5-7b 1 8
