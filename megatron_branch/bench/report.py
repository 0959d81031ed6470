"""The benchmark's outputs: a markdown table per shape, the JSON file, and PNG plots against G and P."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def markdown(report: dict[str, Any]) -> str:
    """One table per (P, G): every variant's time, throughput, memory, FLOPs and speed-up next to the limit."""
    cfg = report["config"]
    model = cfg["model"]
    head = (
        f"Model: {model['num_layers']} layers, hidden {model['hidden_size']}, {model['num_attention_heads']} heads / "
        f"{model['num_query_groups']} kv, "
        + (
            f"{model['num_experts']} experts (top-{model['moe_top_k']}, width {model['moe_ffn_hidden_size']})"
            if model.get("num_experts")
            else f"ffn {model['ffn_hidden_size']}"
        )
        + f", vocab {model['vocab_size']}, {cfg['dtype']} on {cfg['device']}; "
        + (
            f"S={cfg['response']}, levels {cfg['levels']}"
            if not cfg.get("turns")
            else f"{cfg['turns']} turns of {cfg['response']} + tool outputs of {cfg['observation']}, forks after "
            f"turns {list(cfg['branch_at_turns'])}"
        )
        + f", branch_micro_batch {cfg['micro']}; {cfg['rounds']} rounds "
        f"after 1 warm-up, round-robin, order rotated. Machine: "
        + ", ".join(f"{k} {v}" for k, v in report["machine"].items())
    )
    load = report.get("load", {})
    if "foreign_cpu_fraction" in load:
        head += (
            f"; other processes' share of the CPUs during the run {100 * load['foreign_cpu_fraction']:.0f}%"
        )
    lines = [*report.get("warnings", []), head, ""]
    shapes = sorted({(r["prompt"], r["branches"]) for r in report["rows"]})
    mfu = any(r.get("mfu") is not None for r in report["rows"])
    for p, g in shapes:
        rows = [r for r in report["rows"] if (r["prompt"], r["branches"]) == (p, g)]
        lines += [
            f"**P={p:,}, G={g}** (positions logical {rows[0].get('positions_logical', 0):,}; analytic limit "
            f"{rows[0]['analytic_limit']:.2f}x over {report['baseline']})",
            "",
            "| variant | median s (fwd+bwd) | min-max s | logical tok/s | computed tok/s | speed-up | "
            "FLOP ratio | of limit | GFLOP | peak RSS MB | CUDA peak MB | activations MB |"
            + (" MFU |" if mfu else ""),
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if mfu else ""),
        ]
        for r in rows:
            if r.get("failed"):
                lines.append(f"| {r['variant']} | {r['failed']} |" + " |" * (11 + mfu))
                continue
            name = r["variant"] + (f" ({r['auto']['picked']})" if r.get("auto") else "")
            lines.append(
                f"| {name} | {r['median_s']:.3f} | {r['min_s']:.3f}-{r['max_s']:.3f} | "
                f"{r['logical_tokens_per_s']:,.0f} | {r['computed_tokens_per_s']:,.0f} | {r['speedup']:.2f}x | "
                f"{r['flop_ratio']:.2f}x | {100 * r['fraction_of_limit']:.0f}% | {r['gflop_step']:,.4g} | "
                f"{_mb(r['rss_peak_mb'])} | {_mb(r['cuda_peak_mb'])} | {_mb(r['activation_meter_mb'])} |"
                + (f" {100 * r['mfu']:.1f}% |" if mfu and r["mfu"] is not None else (" - |" if mfu else ""))
            )
        lines.append("")
    if "profile" in report:
        prof = report["profile"]
        lines += [
            f"Top ops of one {prof['variant']} step (P={prof['prompt']:,}, G={prof['branches']}), torch.profiler:",
            "",
            "```",
            prof["table"].rstrip(),
            "```",
            "",
        ]
        if "wall_s" in prof:
            lines += [
                f"Where the profiled step's {prof['wall_s']:.3f} s go: ops {prof['op_s']:.3f} s (GEMMs "
                f"{prof['gemm_s']:.3f}, fused attention forward {prof['flash_forward_s']:.3f} and backward "
                f"{prof['flash_backward_s']:.3f}, other ops {prof['other_ops_s']:.3f}), outside any op "
                f"{prof['outside_ops_s']:.3f} s; the analytic FLOPs at the measured GEMM rate "
                f"({prof['gemm_gflops']:.0f} GFLOP/s) take {prof['flop_time_at_gemm_rate_s']:.3f} s.",
                "",
            ]
    lines.append(
        "speed-up = naive-fused median / this median; FLOP ratio = naive-fused analytic FLOPs / this variant's; "
        "of limit = speed-up / (naive-fused FLOPs / minimal tree FLOPs)."
    )
    return "\n".join(lines) + "\n"


PLOT_MARKER = "bench_plots.json"
"""The file every --plot folder holds (the list of its PNGs): `--overwrite` replaces only such a folder."""


def json_text(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=1, default=str) + "\n"


def plot(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """PNGs of speed-up (with the analytic limit) and peak memory against G and against P, for every axis of the
    grid with at least two values; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if not r.get("failed")]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    mem_key = "cuda_peak_mb" if report["config"]["device"] == "cuda" else "rss_peak_mb"
    written = []
    for axis, other, label in (
        ("branches", "prompt", "G (responses per prompt)"),
        ("prompt", "branches", "P"),
    ):
        xs = sorted({r[axis] for r in rows})
        if len(xs) < 2:
            continue
        for fixed in sorted({r[other] for r in rows}):
            sel = [r for r in rows if r[other] == fixed]
            meter = report["config"]["meter"]
            fig, axes = plt.subplots(1, 3 if meter else 2, figsize=(15 if meter else 10, 4))
            for i, v in enumerate(variants):
                pts = sorted(((r[axis], r) for r in sel if r["variant"] == v), key=lambda p: p[0])
                x = [a for a, _ in pts]
                axes[0].plot(x, [r["speedup"] for _, r in pts], marker="o", color=f"C{i}", label=v)
                axes[1].plot(x, [r[mem_key] for _, r in pts], marker="o", color=f"C{i}", label=v)
                if meter:
                    axes[2].plot(
                        x, [r["activation_meter_mb"] for _, r in pts], marker="o", color=f"C{i}", label=v
                    )
            lim = sorted((r[axis], r["analytic_limit"]) for r in sel if r["variant"] == report["baseline"])
            axes[0].plot(
                [x for x, _ in lim], [y for _, y in lim], color="black", ls=":", label="analytic limit"
            )
            for ax in axes:
                ax.set_xscale("log", base=2)
                ax.set_xlabel(label)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
            axes[0].set_ylabel(f"speed-up over {report['baseline']}")
            axes[1].set_ylabel(
                f"peak {'CUDA allocated' if mem_key == 'cuda_peak_mb' else 'RSS'} MB above step start"
            )
            if meter:
                axes[2].set_ylabel("activation meter MB (saved for backward)")
            name = "G" if axis == "branches" else "P"
            fig.suptitle(f"{other}={fixed}")
            fig.tight_layout()
            path = out_dir / f"bench_vs_{name}_{other}{fixed}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    return written
