#!/usr/bin/env bash
# The 2.1M-position target for a 70B-class policy, TRAINED on TWO nodes: qwen2.5-72b, GRPO with exact branch replay,
# one prompt of 130,048 tokens x 16 sampled responses of 1,024 tokens per step (2,097,152 logical positions), on
# 2 nodes x 8 H20 (16 GPUs), with exactly the options the planner chooses (examples/configs/target_72b_2node.yaml
# holds them):
#     megatron-branch plan --model qwen2.5-72b --prompt-length 130048 --responses 16 --response-length 1024
#         --gpus 16 --gpu h20
# -> fits: TP8 x CP2 x PP1 x DP1 + sequence parallel (TP inside a node, the CP ring across the two nodes), recompute
#    full (segment recompute + per-layer checkpointing), the distributed optimizer with all of its state on the host
#    (offload 1), branch micro-batch 8, bf16: 86.2 GB per rank of 96, 650 GB of host memory per node, ~229 s per step
#    (the planner's estimate at MFU 0.45).
# H20, not H100: on 2 x 8 H100 (80 GB) no layout without pipeline parallelism fits (TP8 x CP2 needs the 86.2 GB
# above: CP shards neither weights nor gradients). The planner's faster pipelined choices (H20 with
# `--root-pieces auto`: TP8 x PP2, 16 root pieces, segment recompute, ~195 s; H100: TP8 x PP2, ~69 s whole roots)
# are NOT what this launcher runs: `train`'s sampler under PP holds a whole-model copy per rank (docs/parallelism.md),
# 145 GB for this policy, which no 96 GB GPU holds; at PP those layouts run through `grad --pp 2 --root-pieces 16`
# or the drop-in with an external sampler.
#
# What has run where: NOTHING of this on a GPU (no GPU has been lent to this project), and nothing on two machines.
# On the 2-core CPU the same script runs scaled down as two "nodes" on one machine (SCALE=tiny: two torchrun agents,
# NODE_RANK 0 and 1, joined at MASTER_ADDR=127.0.0.1; a tiny config-defined model at the plan's layout with TP = the
# processes per node, the same bf16, recompute, distributed-optimizer, offload and branch-micro-batch options;
# tests/unit/test_launchers.py checks that they reach the run). The per-rank memory above is the planner's
# arithmetic, not a measurement; the sampler's memory (train samples with the TP-sharded policy) is not planned.
#
# Run it once on EACH node (the same command, NODE_RANK 0 on the node at MASTER_ADDR, 1 on the other); OUT must be
# a folder both nodes share (megatron's distributed checkpoints write every rank's shards into it):
#     NODE_RANK=0|1 MASTER_ADDR=node0-address MASTER_PORT=29500 MODEL=HF_DIR TRAIN_FILES=prompts.jsonl \
#         REWARD=module:function [OUT=runs/target_72b] [GPU=h20] bash examples/launch/target_72b_2node.sh [key=value ...]
#     SCALE=tiny NODE_RANK=0|1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 [NPROC_PER_NODE=1] [OUT=DIR] \
#         bash examples/launch/target_72b_2node.sh        # the CPU run, scaled down (start both "nodes")
# Before a full launch the planner is asked about exactly this layout and the script stops with its verdict if it
# does not fit (FORCE=1 launches anyway); MB_DRY_RUN=1 prints the commands instead of running them.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
CONFIG=${CONFIG:-$HERE/../configs/target_72b_2node.yaml}
OUT=${OUT:-runs/target_72b}
NNODES=2
NODE_RANK=${NODE_RANK:?set NODE_RANK to this node\'s rank: 0 on the node at MASTER_ADDR, 1 on the other}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to node 0\'s address (reachable from both nodes)}
MASTER_PORT=${MASTER_PORT:?set MASTER_PORT to a free TCP port on node 0, the same on both nodes (e.g. 29500)}
if [[ ! "$NODE_RANK" =~ ^[0-9]+$ ]] || ((NODE_RANK >= NNODES)); then
    echo "NODE_RANK must be 0 or 1 (this launcher runs on $NNODES nodes), got '$NODE_RANK'" >&2
    exit 2
fi
if [[ ! "$MASTER_PORT" =~ ^[0-9]+$ ]] || ((MASTER_PORT < 1 || MASTER_PORT > 65535)); then
    echo "MASTER_PORT must be a TCP port number (1-65535), got '$MASTER_PORT'" >&2
    exit 2
fi
if [[ "${SCALE:-full}" == tiny ]]; then
    # The same options on a tiny model: only the sizes change (TP = the processes per node, the model, the data,
    # the steps); the axis that crosses the nodes in the plan crosses the two "nodes" here too.
    NPROC_PER_NODE=${NPROC_PER_NODE:-1}
    sp=false
    if ((NPROC_PER_NODE > 1)); then sp=true; fi
    size=(parallel.tp="$NPROC_PER_NODE" parallel.sequence_parallel="$sp" model.hf_path=null
          "model.arch={hidden_size: 32, num_layers: 2, num_attention_heads: 4, num_query_groups: 2, ffn_hidden_size: 64, max_position_embeddings: 96}"
          tokenizer.type=sentencepiece data.task=needles "data.task_args={length: 24, num_needles: 1}"
          data.num_prompts=8 data.max_prompt_length=null rollout.n=4 rollout.response_length=4
          trainer.total_training_steps=2 trainer.save_freq=1 logging.progress_bar=false logging.tensorboard=false)
else
    MODEL=${MODEL:?set MODEL to the Hugging Face folder of qwen2.5-72b}
    TRAIN_FILES=${TRAIN_FILES:?set TRAIN_FILES to a JSONL file of prompts (\{"prompt": text, ...\})}
    REWARD=${REWARD:?set REWARD to module:function (the reward of a response)}
    GPU=${GPU:-h20}
    NPROC_PER_NODE=8
    preflight --model qwen2.5-72b --prompt-length 130048 --responses 16 --response-length 1024 --gpus 16 \
        --gpu "$GPU" --tp 8 --cp 2 --dp 1 --recompute full --optimizer distributed --offload-fraction 1 \
        --branch-micro-batch 8 --dtype bf16
    size=(model.hf_path="$MODEL" data.train_files="$TRAIN_FILES" data.reward="$REWARD")
fi
run $TORCHRUN --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" --node_rank "$NODE_RANK" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" -m megatron_branch train "$CONFIG" "${size[@]}" \
    trainer.default_local_dir="$OUT" "$@"
