"""The schedule variants the memory benchmark compares (a subset of megatron_branch.bench.config.VARIANTS, the one
registry: name -> (schedule, extra ScheduleOptions))."""

from __future__ import annotations

from megatron_branch.bench.config import VARIANTS as ALL

VARIANTS = {name: ALL[name] for name in ("naive", "packed", "replay", "replay+recompute")}
