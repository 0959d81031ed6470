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
