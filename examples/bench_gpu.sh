#!/usr/bin/env bash
# One prepared GPU session (one H100/H200-class GPU, under 8 minutes), installing nothing from the network:
#     examples/bench_gpu.sh OUT_DIR [PEAK_TFLOPS [WHEEL_DIR]]
#   PEAK_TFLOPS  the GPU's dense bf16 peak, for MFU (default 989: H100/H200 SXM)
#   WHEEL_DIR    wheels to install first, offline (pip --no-index), e.g. built by examples/build_gpu_wheels.sh;
#                needed where megatron-core, transformers, pytest or matplotlib are missing (examples/gpu_wheels.txt)
# Writes under OUT_DIR: env.txt (GPU, versions), gpu-tests.txt (tests/gpu), bench.md / bench.json (the 1B-class
# bf16 model at P = 32K with G = 8 and 16: times, tokens/s, CUDA peak memory, FLOPs, speed-up vs naive-fused and
# the analytic limit, MFU), bench_vs_G_*.png. Exit status: non-zero if the tests or the bench failed.
set -uo pipefail
out=${1:?usage: examples/bench_gpu.sh OUT_DIR [PEAK_TFLOPS [WHEEL_DIR]]}
peak=${2:-989}
wheels=${3:-}
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)

if [ -n "$wheels" ]; then
    # offline: only the wheels handed over, never the network
    "$python" -m pip install --no-index --no-deps --disable-pip-version-check -q "$wheels"/*.whl || exit 3
fi
"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'bench_gpu.sh: no CUDA device')" || exit 4
{
    "$python" -c "import torch, sys; print('python', sys.version.split()[0]); \
print('torch', torch.__version__, 'cuda', torch.version.cuda); print('gpu', torch.cuda.get_device_name())"
    "$python" -c "import megatron.core; print('megatron-core', megatron.core.__version__)"
    "$python" -c "import flash_attn; print('flash-attn', flash_attn.__version__)" 2>/dev/null || echo "flash-attn absent"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

status=0
cd "$repo" || exit 5
timeout 180 "$python" -m pytest tests/gpu -q -p no:cacheprovider -rs 2>&1 | tee "$out/gpu-tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

timeout 330 "$python" -m megatron_branch bench --preset gpu-1b --rounds 2 --peak-tflops "$peak" \
    --json "$out/bench.json" --markdown "$out/bench.md" --plot "$out/plots" 2>&1 | tee "$out/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "bench_gpu.sh: done in $(( $(date +%s) - start )) s, status $status; results in $out"
exit $status
