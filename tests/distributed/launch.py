"""Run the distributed test suite under ONE torchrun launch for a world size (start-up dominates on CPU).

    python tests/distributed/launch.py 2      # every test marked for world size 2

Rank 0's output is shown; any failing rank fails the launch. pytest's exit code 5 (nothing selected) is success.
"""

from __future__ import annotations

import os
import subprocess
import sys


def main() -> int:
    world = int(sys.argv[1])
    extra = sys.argv[2:]
    env = dict(os.environ, MEGATRON_BRANCH_TEST_WORLD=str(world), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        "--local-ranks-filter=0",
        "-m",
        "pytest",
        "tests/distributed",
        "-q",
        "-p",
        "no:cacheprovider",
        "-x",
        *extra,
    ]
    print(f"[launch] world size {world}: {' '.join(cmd[2:])}", flush=True)
    rc = subprocess.call(cmd, env=env)
    return 0 if rc == 5 else rc


if __name__ == "__main__":
    sys.exit(main())
