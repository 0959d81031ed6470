"""Thin wrapper: `python tools/verify_conversion.py --hf DIR --mcore DIR` == `megatron-branch verify-conversion`."""

from __future__ import annotations

import sys

from megatron_branch.cli import main

if __name__ == "__main__":
    sys.exit(main(["verify-conversion", *sys.argv[1:]]))
