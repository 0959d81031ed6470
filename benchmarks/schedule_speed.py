"""Superseded by `megatron-branch bench` (megatron_branch/bench/): the same round-robin method in one process, with
the fair baselines (naive-fused, packed-nosharing, repeat-prefix), memory, analytic FLOPs and plots. This script
forwards its arguments, which the bench accepts under the same names (--prompt, --branches, --response, --hidden,
--layers, --heads, --vocab, --micro, --rounds):

    .venv/bin/python benchmarks/schedule_speed.py --prompt 1024 --branches 8 --response 64
"""

from __future__ import annotations

import sys

from megatron_branch.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
