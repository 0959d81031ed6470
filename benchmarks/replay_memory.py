"""Peak activation memory of naive / packed / replay / replay+recompute as the number of branches G grows.

One prompt of P tokens with G leaf responses of S tokens each (every response its own branch right below the
prompt). Memory is measured with megatron_branch.memory.ActivationMeter: the bytes of distinct storages that
autograd holds for backward (plus replay's cached K/V leaves and their gradient accumulators), excluding
parameters, grads and optimizer state. It is deterministic, so one run per cell is enough and the numbers are the
same on any machine with the same torch version (timing is in benchmarks/schedule_speed.py).

    .venv/bin/python benchmarks/replay_memory.py                 # both configs, table + docs/img/replay_memory.png
    .venv/bin/python benchmarks/replay_memory.py --configs small --no-plot
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from variants import VARIANTS  # benchmarks/ is on sys.path when a script here runs

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.memory import ActivationMeter
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule
from megatron_branch.testing import random_tree_rollouts

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Config:
    name: str
    prompt: int
    response: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int = 37
    micro: int = 4
    gs: tuple[int, ...] = (4, 8, 16, 32)

    def describe(self) -> str:
        return (
            f"P={self.prompt}, S={self.response}, hidden {self.hidden}, {self.layers} layers, "
            f"{self.heads} heads / {self.kv_heads} KV, vocab {self.vocab}, fp32, branch_micro_batch={self.micro}"
        )


CONFIGS = {
    # the unit test's setting (tests/unit/test_memory_scaling.py)
    "small": Config("small", prompt=64, response=8, hidden=32, layers=2, heads=4, kv_heads=2),
    # a longer prompt: the shared part dominates, which is where replay pays off
    "large": Config("large", prompt=512, response=32, hidden=64, layers=4, heads=4, kv_heads=2),
}


def rollouts(cfg: Config, g: int, seed: int = 0) -> list[Rollout]:
    """One prompt, G leaves of length S right below it (distinct first tokens)."""
    return random_tree_rollouts(
        vocab_size=cfg.vocab,
        prompt_len=cfg.prompt,
        branches=g,
        seg_len=(cfg.response, cfg.response),
        seed=seed,
    )


def three_levels(cfg: Config, seed: int = 1) -> list[Rollout]:
    """The unit test's deeper tree: prompt -> 2 x 16 -> 2 x 16 -> 4 leaves x S (16 rollouts), where recompute
    matters because three inner graphs would otherwise be alive at once."""
    rng = random.Random(seed)

    def toks(first: int, n: int) -> list[int]:
        return [first] + [rng.randrange(cfg.vocab) for _ in range(n - 1)]

    prompt = [rng.randrange(cfg.vocab) for _ in range(cfg.prompt)]
    # one token run per NODE (drawn once), so that siblings share their parent's whole segment
    l1 = [toks(a, 16) for a in range(2)]
    l2 = [[toks(b, 16) for b in range(2)] for _ in range(2)]
    return [
        Rollout(
            prompt=prompt,
            response=l1[a] + l2[a][b] + toks(c, cfg.response),
            advantage=rng.uniform(-1, 1),
        )
        for a in range(2)
        for b in range(2)
        for c in range(4)
    ]


def build(cfg: Config) -> torch.nn.Module:
    torch.manual_seed(0)
    arch = ModelArch(
        family="llama",
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        num_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_query_groups=cfg.kv_heads,
        ffn_hidden_size=2 * cfg.hidden,
    )
    return build_model(arch, dtype=torch.float32)


def measure(cfg: Config, batches: dict[int, list[Rollout]]) -> list[dict[str, float | int]]:
    """One row per batch (keyed by G, its number of rollouts): positions and every variant's peak MB."""
    model = build(cfg)
    rows = []
    for g, rs in batches.items():
        tree = PrefixTree.build(rs, vocab_size=cfg.vocab)
        obj = PolicyGradientObjective.grpo([r.advantage for r in rs], tree.num_response_tokens_logical())
        row: dict[str, float | int] = {
            "G": g,
            "logical": tree.positions_logical,
            "computed": tree.positions_computed,
        }
        for label, (schedule, kw) in VARIANTS.items():
            model.zero_grad(set_to_none=True)
            opts = ScheduleOptions(vocab_size=cfg.vocab, branch_micro_batch=cfg.micro, **kw)
            with ActivationMeter(model) as meter:
                res = run_schedule(schedule, model, tree, obj, opts)
            assert meter.current_bytes == 0, f"{label}: {meter.current_bytes} bytes still held after the step"
            row[label] = meter.peak_bytes / 2**20
            if label == "replay+recompute":
                row["recomputed"] = res.positions_recomputed
        rows.append(row)
    return rows


def markdown(cfg: Config, rows: list[dict[str, float | int]]) -> str:
    head = (
        "| G | positions logical (naive) | computed (packed, replay) | + recomputed (replay+recompute) | "
        + " | ".join(f"{v} peak MB" for v in VARIANTS)
        + " | replay / packed |"
    )
    lines = [f"**{cfg.name}**: {cfg.describe()}", "", head, "|" + "---:|" * (5 + len(VARIANTS))]
    for r in rows:
        cells = [str(r["G"]), f"{r['logical']:,}", f"{r['computed']:,}", f"{r['recomputed']:,}"]
        cells += [f"{r[v]:.2f}" for v in VARIANTS]
        cells.append(f"{r['replay'] / r['packed']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict[str, tuple[Config, list[dict[str, float | int]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on the benchmark machines
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, (cfg, rows) in zip(axes[0], results.values()):
        gs = [r["G"] for r in rows]
        for v in VARIANTS:
            ax.plot(gs, [r[v] for r in rows], marker="o", label=v)
        ax.set_xticks(gs, [str(g) for g in gs])  # linear axis: packed's growth in G shows as a straight line
        ax.set_xlabel("branches G (leaf responses under one prompt)")
        ax.set_ylabel("peak activation memory (MB)")
        ax.set_title(
            f"{cfg.name}: P={cfg.prompt}, S={cfg.response}, h={cfg.hidden}, {cfg.layers} layers", fontsize=9
        )
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "replay_memory.png")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()

    initialize_parallel(ParallelConfig())
    results = {}
    for name in args.configs:
        cfg = CONFIGS[name]
        rows = measure(cfg, {g: rollouts(cfg, g) for g in cfg.gs})
        results[name] = (cfg, rows)
        print(markdown(cfg, rows), end="\n\n", flush=True)
    if "small" in args.configs:
        cfg = CONFIGS["small"]
        deep = measure(cfg, {16: three_levels(cfg)})
        title = (
            f"{cfg.name}, three-level tree (prompt {cfg.prompt} -> 2 x 16 -> 2 x 16 -> 4 x {cfg.response})"
        )
        print(markdown(cfg, deep).replace(f"**{cfg.name}**", f"**{title}**"), end="\n\n", flush=True)
    if not args.no_plot:
        plot(results, args.plot)
        print(f"plot: {args.plot.relative_to(ROOT) if args.plot.is_relative_to(ROOT) else args.plot}")


if __name__ == "__main__":
    main()
