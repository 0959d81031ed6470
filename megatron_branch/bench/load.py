"""How busy the machine was while the benchmark ran: the CPU time OTHER processes used, read from /proc/stat.

A round-robin benchmark compares variants within one run, but a loaded machine still skews them (a variant timed
while another job peaks looks slow, the baseline timed then makes the others look fast): issue 35 saw a loaded
single-round run report "822% of limit". So the run records

    foreign_cpu_s         = (busy CPU time of the whole machine) - (this process's CPU time), over the run
    foreign_cpu_fraction  = foreign_cpu_s / (wall seconds x CPUs)     (0: nobody else ran; 1: every CPU taken)
    load_average_start / _end (os.getloadavg, where the platform has it)

and `warnings` says so when the machine was busy (foreign_cpu_fraction above BUSY_FRACTION), and whenever a figure
exceeds the analytic limit, which a fair timing cannot do. /proc/stat: proc(5), the first `cpu` line's jiffies
(user nice system idle iowait irq softirq steal ...; idle and iowait are the not-busy ones).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

BUSY_FRACTION = 0.10
"""Other processes using more than this share of all CPUs during the run make its timings suspect."""


def _machine_busy_s() -> float | None:
    """Busy CPU seconds of the whole machine since boot (None where /proc/stat is not there)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = sum(fields[:8]) - idle  # user..steal; guest time is already counted in user
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


@dataclass
class LoadMeter:
    """Start it before the timed work, `read()` after: the machine's load in between."""

    wall0: float = 0.0
    busy0: float | None = None
    own0: float = 0.0
    load0: list[float] | None = None

    @classmethod
    def start(cls) -> LoadMeter:
        return cls(wall0=time.perf_counter(), busy0=_machine_busy_s(), own0=_own_cpu_s(), load0=_loadavg())

    def read(self) -> dict[str, Any]:
        wall = time.perf_counter() - self.wall0
        out: dict[str, Any] = {"wall_s": wall, "cpus": os.cpu_count(), "load_average_start": self.load0,
                               "load_average_end": _loadavg()}  # fmt: skip
        busy = _machine_busy_s()
        if self.busy0 is not None and busy is not None and wall > 0:
            foreign = max(busy - self.busy0 - (_own_cpu_s() - self.own0), 0.0)
            out["foreign_cpu_s"] = foreign
            out["foreign_cpu_fraction"] = foreign / (wall * (os.cpu_count() or 1))
        out["busy"] = is_busy(out)
        return out


def is_busy(load: dict[str, Any]) -> bool:
    """Others used more than BUSY_FRACTION of the CPUs; without /proc/stat, a start load above half the CPUs."""
    if "foreign_cpu_fraction" in load:
        return load["foreign_cpu_fraction"] > BUSY_FRACTION
    start = load.get("load_average_start")
    return bool(start) and start[0] > 0.5 * (load.get("cpus") or 1)


def warnings(load: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """The lines a report must carry next to its figures."""
    out = []
    if load.get("busy"):
        share = load.get("foreign_cpu_fraction")
        said = f"other processes used {100 * share:.0f}% of its {load['cpus']} CPUs" if share is not None else (
            f"load average {load['load_average_start'][0]:g} on {load['cpus']} CPUs")  # fmt: skip
        out.append(f"warning: the machine was busy during this run ({said}): the timings and speed-ups below are "
                   "not reliable; rerun on a quiet machine")  # fmt: skip
    above = [r for r in rows if (r.get("fraction_of_limit") or 0) > 1.0]
    if above:
        worst = max(above, key=lambda r: r["fraction_of_limit"])
        out.append(f"warning: {len(above)} figure(s) above the analytic limit (up to "
                   f"{100 * worst['fraction_of_limit']:.0f}%, {worst['variant']} at P={worst['prompt']}, "
                   f"G={worst['branches']}): a fair timing cannot beat the limit; timing noise or load")  # fmt: skip
    return out
