#!/usr/bin/env bash
# Build the wheel folder that examples/bench_gpu.sh installs on a GPU machine without registry access.
# Run on a machine WITH registry access, with the same Python version (and CPU architecture) as the GPU machine:
#     examples/build_gpu_wheels.sh WHEEL_DIR        # then copy WHEEL_DIR next to the checkout on the GPU machine
# The list (examples/gpu_wheels.txt) comes from examples/list_gpu_wheels.py; torch is not in it (the GPU machine
# has its CUDA build).
set -euo pipefail
out=${1:?usage: examples/build_gpu_wheels.sh WHEEL_DIR}
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
mkdir -p "$out"
"$python" -m pip wheel --no-deps -r "$here/gpu_wheels.txt" -w "$out"
echo "built $(ls "$out"/*.whl | wc -l) wheels in $out for $("$python" -c 'import sys; print(sys.version.split()[0])')"
