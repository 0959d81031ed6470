"""Thin wrapper: `python tools/convert.py hf-to-mcore --hf DIR --out DIR` == `megatron-branch convert ...`."""

from __future__ import annotations

import sys

from megatron_branch.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
