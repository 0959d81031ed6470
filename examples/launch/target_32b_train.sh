#!/usr/bin/env bash
# The 2.1M-position target, TRAINED: qwen2.5-32b, GRPO with exact branch replay, one prompt of 130,048 tokens x 16
# sampled responses of 1,024 tokens per step (2,097,152 logical positions), on one node of 8 x H20, with exactly the
# options the planner chooses (examples/configs/target_32b_train.yaml holds them):
#     megatron-branch plan --model qwen2.5-32b --prompt-length 130048 --responses 16 --response-length 1024
#         --gpus 8 --gpu h20
# -> fits: TP8 x CP1 x DP1 + sequence parallel, recompute full (segment recompute + per-layer checkpointing), the
#    distributed optimizer with half of its state on the host (offload 0.5), branch micro-batch 8, bf16: 87.4 GB per
#    rank of 96, 331 GB of host memory per node, ~214 s per step (the planner's estimate at MFU 0.45).
#
# What has run where: NOTHING of this on a GPU (no GPU has been lent to this project). On the 2-core CPU the same
# script runs scaled down (SCALE=tiny: a tiny config-defined model at TP2 + SP on 2 ranks, the same bf16, recompute,
# distributed-optimizer, offload and branch-micro-batch options; tests/unit/test_launchers.py checks that they reach
# the run, from the run's engine.json), and the planner's per-term memory of this layout was rehearsed at the 32B
# rank's shapes (docs/scaling.md). The per-rank memory above is the planner's arithmetic, not a measurement.
# Caveat: Qwen2.5-32B's released config.json declares 32,768 positions (131,072 only with its YaRN rope scaling,
# which the engine refuses rather than approximates): a 131K prompt needs a checkpoint whose config.json allows it
# with plain RoPE; the run refuses in one line otherwise (prompt + response exceed the model's context).
#
#     MODEL=HF_DIR TRAIN_FILES=prompts.jsonl REWARD=module:function [OUT=runs/target_32b] [GPU=h20] \
#         bash examples/launch/target_32b_train.sh [section.key=value ...]
#     SCALE=tiny [NPROC=2] [OUT=DIR] bash examples/launch/target_32b_train.sh     # the CPU run, scaled down
# Before a full launch the planner is asked about exactly this layout and the script stops with its verdict if it
# does not fit (FORCE=1 launches anyway); MB_DRY_RUN=1 prints the commands instead of running them.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
CONFIG=${CONFIG:-$HERE/../configs/target_32b_train.yaml}
OUT=${OUT:-runs/target_32b}
if [[ "${SCALE:-full}" == tiny ]]; then
    # The same options on a tiny model: only the sizes change (TP = the ranks, the model, the data, the steps).
    NPROC=${NPROC:-2}
    size=(parallel.tp="$NPROC" model.hf_path=null
          "model.arch={hidden_size: 32, num_layers: 2, num_attention_heads: 4, num_query_groups: 2, ffn_hidden_size: 64, max_position_embeddings: 96}"
          tokenizer.type=sentencepiece data.task=needles "data.task_args={length: 24, num_needles: 1}"
          data.num_prompts=8 data.max_prompt_length=null rollout.n=4 rollout.response_length=4
          trainer.total_training_steps=2 trainer.save_freq=1 logging.progress_bar=false logging.tensorboard=false)
else
    MODEL=${MODEL:?set MODEL to the Hugging Face folder of qwen2.5-32b}
    TRAIN_FILES=${TRAIN_FILES:?set TRAIN_FILES to a JSONL file of prompts (\{"prompt": text, ...\})}
    REWARD=${REWARD:?set REWARD to module:function (the reward of a response)}
    GPU=${GPU:-h20}
    NPROC=8
    preflight --model qwen2.5-32b --prompt-length 130048 --responses 16 --response-length 1024 --gpus 8 \
        --gpu "$GPU" --tp 8 --cp 1 --dp 1 --recompute full --optimizer distributed --offload-fraction 0.5 \
        --branch-micro-batch 8 --dtype bf16
    size=(model.hf_path="$MODEL" data.train_files="$TRAIN_FILES" data.reward="$REWARD")
fi
run $TORCHRUN --standalone --nproc_per_node "$NPROC" -m megatron_branch train "$CONFIG" "${size[@]}" \
    trainer.default_local_dir="$OUT" "$@"
