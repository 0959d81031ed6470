"""What a run reports: OUT/metrics.jsonl (one JSON line per step), TensorBoard events, a tqdm bar, OUT/curves.png.

Names follow verl where it has one (`critic/score/mean`, `response_length/mean`, `actor/*`, `timing_s/*`,
`perf/throughput`), plus ours (`reward_mean`, `loss`, `positions_logical`, `positions_computed`). Only rank 0
writes. On resume the lines after the checkpoint's step are dropped, so metrics.jsonl always describes the run
that the newest checkpoint continues.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from megatron_branch import outputs
from megatron_branch.errors import UserError

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The lines of a metrics.jsonl (missing file = no lines). A last line cut short (a crash while `log`
    appended it: no newline, not JSON) is dropped, so a resume reads the rest and rewrites the file without it;
    any other line that is not JSON is a one-line UserError naming `path:line`."""
    p = Path(path)
    if not p.is_file():
        return []
    text = p.read_text(encoding="utf-8")
    lines = text.splitlines()
    if lines and not text.endswith("\n") and not _is_json(lines[-1]):
        lines.pop()
    rows = []
    for k, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise UserError(f"invalid JSON ({e.msg} at column {e.colno})", where=f"{p}:{k}") from None
    return rows


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


class RunLogger:
    """metrics.jsonl + TensorBoard + tqdm for one run folder. Construct on every rank; only `enabled` writes."""

    def __init__(
        self,
        out: Path,
        *,
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
        tensorboard: bool = True,
        progress_bar: bool = True,
    ) -> None:
        self.out, self.enabled = out, enabled
        self.file = out / METRICS_FILE
        self._tb = None
        self._bar = None
        if not enabled:
            return
        kept = [m for m in read_metrics(self.file) if m.get("step", 0) <= start_step]
        # replaced whole (temp file + rename): a crash here keeps the run's metrics as they were
        outputs.write_text(
            self.file, "".join(json.dumps(m) + "\n" for m in kept), overwrite=True, what="metrics file"
        )
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is a dependency; a trimmed environment still trains
                SummaryWriter = None
            if SummaryWriter is not None:
                # purge_step drops events of steps after the checkpoint, as metrics.jsonl above
                self._tb = SummaryWriter(
                    str(out / "tensorboard"), purge_step=start_step + 1 if start_step else None
                )
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True
            )

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: _jsonable(v) for k, v in metrics.items()}
        with self.file.open("a") as f:
            f.write(json.dumps(clean) + "\n")
        step = int(clean["step"])
        if self._tb is not None:
            for k, v in clean.items():
                if k != "step" and isinstance(v, (int, float)) and v is not None and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._bar is not None:
            self._bar.set_postfix(
                reward=f"{clean.get('reward_mean', float('nan')):.3f}",
                step_s=f"{clean.get('timing_s/step', float('nan')):.1f}",
                refresh=False,
            )
            self._bar.update(1)

    def write(self, text: str) -> None:
        """A line of text that does not break the bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def plot(self) -> Path | None:
        if not self.enabled:
            return None
        return plot_curves(read_metrics(self.file), self.out / CURVES_FILE)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()


def run_summary(rows: list[dict[str, Any]]) -> list[str]:
    """The lines `train` prints at the end (the README shows the demo's): mean reward over the first and the
    last k steps (k = 10, or half of a shorter run) and the positions of the last step, logical vs computed."""
    rows = [r for r in rows if isinstance(r.get("reward_mean"), (int, float))]
    if not rows:
        return []
    k = min(10, max(1, len(rows) // 2))
    first = sum(r["reward_mean"] for r in rows[:k]) / k
    last = sum(r["reward_mean"] for r in rows[-k:]) / k
    lines = [
        f"mean reward, first {k} steps: {first:.3f}    last {k} steps: {last:.3f}    ({len(rows)} steps)"
    ]
    end = rows[-1]
    if "positions_logical" in end and "positions_computed" in end:
        lines.append(
            f"positions per step: logical {end['positions_logical']}, computed {end['positions_computed']}"
        )
    return lines


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN
    return v


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_curves(rows: list[dict[str, Any]], path: Path, *, title: str | None = None) -> Path | None:
    """Reward, loss, KL and positions (logical vs computed) per step, in one PNG. None without rows."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    panels = [
        ("reward", [("reward_mean", "mean reward")]),
        ("loss", [("loss", "loss")]),
        ("KL", [("actor/kl_loss", "KL to reference"), ("actor/ppo_kl", "KL to sampler (ppo_kl)")]),
        (
            "positions per step",
            [("positions_logical", "logical (naive)"), ("positions_computed", "computed")],
        ),
    ]
    for ax, (name, keys) in zip(axes, panels):
        for key, label in keys:
            xs, ys = _series(rows, key)
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 60 else None, label=label)
        if not ax.get_lines():
            ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(path)
    return path


def multi_turn_metrics(turns: list[tuple[int, int]], rollouts: list[Any]) -> dict[str, float]:
    """Per rollout of the step's global batch: policy turns and tool calls (observations) on average, and the
    fraction of response tokens that are trained (loss_mask 1; the rest are observations)."""
    n = len(turns)
    trained = sum(r.num_trained for r in rollouts)
    return {
        "multi_turn/turns_mean": sum(t for t, _ in turns) / n,
        "multi_turn/tool_calls_mean": sum(c for _, c in turns) / n,
        "multi_turn/trained_fraction": trained / max(1, sum(len(r.response) for r in rollouts)),
    }
