# Shared by the launchers in this folder (sourced, not run).
# MB_DRY_RUN=1: print every command instead of running it (the CPU dry-run test parses what is printed).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The checkout's .venv (make setup) when there is one, so a fresh clone needs no PATH change; else PATH's.
BIN=""
if [[ -x "$HERE/../../.venv/bin/python" ]]; then BIN="$(cd "$HERE/../../.venv/bin" && pwd)/"; fi
MB=${MB:-${BIN}megatron-branch}     # the installed command (or: "python -m megatron_branch")
TORCHRUN=${TORCHRUN:-${BIN}torchrun}
PYTHON=${PYTHON:-${BIN}python}

run() {
    if [[ -n "${MB_DRY_RUN:-}" ]]; then
        printf '%q ' "$@"
        printf '\n'
    else
        "$@"
    fi
}

# preflight PLAN_ARGS...: ask the planner whether this layout fits; stop with its one-line verdict if not
# (FORCE=1 runs anyway). The planner command is printed too, so that the settings can be re-derived.
preflight() {
    local cmd=($MB plan "$@" --json)
    if [[ -n "${MB_DRY_RUN:-}" ]]; then
        run "${cmd[@]}"
        return
    fi
    local out fits rc=0
    out=$("${cmd[@]}") || rc=$?   # 1: does not fit (read below); 2: bad input, already said in one line
    if (( rc > 1 )); then exit "$rc"; fi
    fits=$(printf '%s\n' "$out" | tail -n 1 | $PYTHON -c 'import json, sys; print(json.load(sys.stdin)["fits"])')
    if [[ "$fits" != "True" && -z "${FORCE:-}" ]]; then
        printf '%s\n' "$out" | head -n 1 >&2   # the verdict
        echo "the planner says this layout does not fit (FORCE=1 to run anyway)" >&2
        exit 1
    fi
}

# grad_2p1m HF_NAME TP CP: the 2.1M-position target's one exact gradient step on one 8-GPU node (16 rollouts x
# 131,072 positions: a 122,880-token prompt shared by 16 responses of 8,192 tokens) at TP x CP, float32, after
# asking the planner about exactly this run (RECOMPUTE=full by default: grad --recompute --recompute-layers;
# selective = --recompute only). Reads MODEL, ROLLOUTS, OUT, GPU, RECOMPUTE, FORCE from the environment.
grad_2p1m() {
    local name=$1 tp=$2 cp=$3
    MODEL=${MODEL:?set MODEL to the Hugging Face folder of $name}
    ROLLOUTS=${ROLLOUTS:?set ROLLOUTS to a JSONL file of 16 rollouts sharing a 122,880-token prompt}
    OUT=${OUT:-grads.safetensors}
    GPU=${GPU:-h20}
    RECOMPUTE=${RECOMPUTE:-full}
    preflight --model "$name" --prompt-length 122880 --responses 16 --response-length 8192 --gpus 8 --gpu "$GPU" \
        --tp "$tp" --cp "$cp" --dp 1 --recompute "$RECOMPUTE" --dtype float32 \
        --branch-micro-batch 8 --optimizer distributed --offload-fraction 0
    local flags=()
    [[ "$RECOMPUTE" != none ]] && flags+=(--recompute)
    [[ "$RECOMPUTE" == full ]] && flags+=(--recompute-layers)
    (( tp > 1 )) && flags+=(--tp "$tp" --sequence-parallel)
    (( cp > 1 )) && flags+=(--cp "$cp")
    run $TORCHRUN --standalone --nproc_per_node 8 -m megatron_branch grad --hf "$MODEL" --rollouts "$ROLLOUTS" \
        --out "$OUT" --schedule replay --dtype float32 --branch-micro-batch 8 "${flags[@]}"
}
