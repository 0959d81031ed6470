"""The schedule variants every benchmark compares: name -> (schedule, extra ScheduleOptions)."""

from __future__ import annotations

VARIANTS: dict[str, tuple[str, dict[str, bool]]] = {
    "naive": ("naive", {}),
    "packed": ("packed", {}),
    "replay": ("replay", {}),
    "replay+recompute": ("replay", {"recompute": True}),
}
