"""`python -m megatron_branch ...` (and `torchrun ... -m megatron_branch ...`)."""

import sys

from megatron_branch.cli import main

sys.exit(main())
