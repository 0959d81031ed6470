"""Draw docs/img/parallelism.png: how a prefix tree is laid out over TP / SP / CP ranks (TP2 x CP2, SP on).

    .venv/bin/python docs/make_parallelism_figure.py

The layout is computed by the real code (`schedule.chunks.make_chunk`, `schedule.chunks.split_chunk`), not drawn
by hand: (a) the tree, every token coloured by the CP rank that holds it (zigzag per segment, padding hatched);
(b) what each of the 4 global ranks holds in the packed forward: its CP share, cut into SP shards along the
sequence outside attention, and all of the share's rows but half of the heads inside attention; (c) replay of one
leaf: each CP rank's keys are ITS cached shards of the ancestors plus its rows of the leaf, and the ring passes
them around.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

from megatron_branch.data import PrefixTree, Rollout  # noqa: E402
from megatron_branch.schedule.chunks import make_chunk, split_chunk  # noqa: E402

TP, CP = 2, 2
RANK_COLORS = ["#4C72B0", "#DD8452"]  # CP rank 0, 1
SEG_COLORS = ["#8172B3", "#55A868", "#C44E52", "#937860", "#DA8BC3"]
OUT = Path(__file__).resolve().parent / "img" / "parallelism.png"


def _tree() -> PrefixTree:
    prompt = list(range(1, 12))  # 11 tokens: no 2*CP divides it
    shared = [20, 21, 22, 23, 24]
    return PrefixTree.build(
        [
            Rollout(prompt=prompt, response=shared + [30, 31, 32, 33, 34, 35, 36], advantage=1.0),
            Rollout(prompt=prompt, response=shared + [25, 26, 27], advantage=-1.0),
            Rollout(prompt=prompt, response=[12, 13, 14, 15, 16, 17], advantage=0.5),
        ],
        vocab_size=40,
    )


def _seg_name(tree: PrefixTree, sid: int) -> str:
    s = tree.segments[sid]
    if s.depth == 0:
        return "prompt P"
    return "shared S" if s.children else f"leaf L{sid}"


def _cell(  # noqa: ANN001
    ax,
    x: float,
    y: float,
    color: str,
    *,
    text: str = "",
    pad: bool = False,
    w: float = 1.0,
    faded: bool = False,
) -> None:
    """One token row: coloured; padding hatched; `faded` = held by another rank of the TP group (SP shard)."""
    ax.add_patch(
        Rectangle(
            (x, y),
            w * 0.94,
            0.8,
            facecolor="white" if pad else color,
            alpha=0.18 if faded else 1.0,
            edgecolor="#999999" if pad else "black",
            hatch="///" if pad else None,
            lw=0.5,
        )
    )
    if text:
        ax.text(
            x + w * 0.47,
            y + 0.4,
            text,
            ha="center",
            va="center",
            fontsize=6,
            color="black" if pad else "white",
        )


def panel_tree(ax, tree: PrefixTree) -> None:  # noqa: ANN001
    """(a) Each segment as a row of tokens at its tree position, coloured by the CP rank holding it."""
    ax.set_title(
        "(a) prefix tree; each token coloured by the CP rank that holds it (zigzag per segment)", loc="left"
    )
    whole = make_chunk(tree, range(len(tree.segments)))
    owner = {}
    for r in range(CP):
        part = split_chunk(tree, whole, CP, r)
        for idx in part.token_index.tolist():
            if idx >= 0:
                owner[idx] = r
    x0: dict[int, int] = {}
    y = 0
    for seg in tree.segments:
        start = (
            0 if not seg.ancestors else x0[seg.ancestors[-1]] + tree.segments[seg.ancestors[-1]].length + 1
        )
        x0[seg.id] = start
        for j in range(seg.length):
            _cell(ax, start + j, -y, RANK_COLORS[owner[seg.offset + j]], text=str(j))
        piece = -(-seg.length // (2 * CP))
        for p in range(1, 2 * CP):  # piece boundaries
            if p * piece < seg.length:
                ax.plot([start + p * piece - 0.03] * 2, [-y - 0.1, -y + 0.9], color="black", lw=1.2)
        ax.text(start - 0.3, -y + 0.4, _seg_name(tree, seg.id), ha="right", va="center", fontsize=7)
        y += 1
    for r, c in enumerate(RANK_COLORS):
        ax.add_patch(Rectangle((0.2 + 7 * r, -y - 0.6), 0.8, 0.6, color=c))
        ax.text(1.3 + 7 * r, -y - 0.3, f"CP rank {r}", va="center", fontsize=7)
    ax.text(
        15,
        -y - 0.3,
        "hatched = padding;  | = zigzag piece boundary (2*CP pieces; rank r takes r and 2CP-1-r)",
        va="center",
        fontsize=7,
    )
    ax.set_xlim(-6, 32)
    ax.set_ylim(-y - 1, 1.2)
    ax.axis("off")


def panel_ranks(ax, tree: PrefixTree) -> None:  # noqa: ANN001
    """(b) packed forward: global rank g = tp_rank + TP * cp_rank; SP shards outside attention, heads inside."""
    ax.set_title(
        "(b) packed forward on TP2 x CP2 + SP: global rank = tp + 2*cp; TP groups {0,1},{2,3}, CP groups {0,2},{1,3}",
        loc="left",
    )
    whole = make_chunk(tree, range(len(tree.segments)))
    y = 0.0
    for cp in range(CP):
        part = split_chunk(tree, whole, CP, cp, pad_to_multiple=TP)
        seg = part.meta[0].tolist()
        n = len(seg)
        shard = n // TP
        for tp in range(TP):
            g = tp + TP * cp
            ax.text(-0.5, -y + 0.4, f"rank {g} (cp {cp}, tp {tp})", ha="right", va="center", fontsize=7)
            for j, s in enumerate(
                seg
            ):  # outside attention (SP): only this TP rank's contiguous shard of rows
                mine = j // shard == tp
                _cell(ax, j, -y, SEG_COLORS[s] if s >= 0 else "white", pad=s < 0, faded=not mine)
            ax.text(
                n + 0.5,
                -y + 0.4,
                f"norm/MLP-in rows {tp * shard}..{(tp + 1) * shard - 1} (SP)",
                fontsize=6,
                va="center",
            )
            x = n + 11
            for j, s in enumerate(seg):  # inside attention: every row of the CP share, heads split over TP
                _cell(ax, x + j * 0.6, -y, SEG_COLORS[s] if s >= 0 else "white", pad=s < 0, w=0.6)
            ax.text(
                x + n * 0.6 + 0.5,
                -y + 0.4,
                f"attention: all rows, heads {2 * tp},{2 * tp + 1} of 4",
                fontsize=6,
                va="center",
            )
            y += 1
        y += 0.4
    ax.text(
        1,
        -y - 1.0,
        "faded = rows held by the other TP rank (sequence parallel shard); hatched = padding",
        fontsize=7,
    )
    for i, sid in enumerate(range(len(tree.segments))):
        ax.add_patch(Rectangle((1 + 7 * i, -y - 0.4), 0.8, 0.6, color=SEG_COLORS[sid]))
        ax.text(2 + 7 * i, -y - 0.1, _seg_name(tree, sid), va="center", fontsize=7)
    ax.set_xlim(-8, 62)
    ax.set_ylim(-y - 1.4, 1.2)
    ax.axis("off")


def panel_replay(ax, tree: PrefixTree) -> None:  # noqa: ANN001
    """(c) replay of the first leaf under the shared segment: keys = own ancestor shards + own leaf rows."""
    leaf = next(s for s in tree.segments if not s.children and len(s.ancestors) == 2)
    ax.set_title(
        f"(c) replay, chunk = {_seg_name(tree, leaf.id)}: each CP rank's keys are ITS cached K/V shards of P and S "
        "(kept on it for the whole subtree) + its leaf rows; the ring passes every block to the other rank",
        loc="left",
        fontsize=8,
    )
    y = 0.0
    for cp in range(CP):
        x = 0.0
        ax.text(-0.5, -y + 0.4, f"CP rank {cp} keys", ha="right", va="center", fontsize=7)
        for sid in (*leaf.ancestors, leaf.id):
            s = tree.segments[sid]
            part = split_chunk(tree, make_chunk(tree, [sid], external=s.ancestors), CP, cp)
            for seg_id in part.meta[0].tolist():
                _cell(ax, x, -y, SEG_COLORS[seg_id] if seg_id >= 0 else "white", pad=seg_id < 0)
                x += 1
            label = "cached" if sid != leaf.id else "chunk"
            ax.text(
                x - part.num_local / 2,
                -y + 1.0,
                f"{_seg_name(tree, sid).split()[-1]} ({label})",
                ha="center",
                fontsize=6,
            )
            x += 0.6
        y += 1.8
    ax.add_patch(
        FancyArrowPatch(
            (x + 1, -0.2 + 0.4),
            (x + 1, -1.8 + 0.4),
            connectionstyle="arc3,rad=-0.5",
            arrowstyle="->",
            mutation_scale=10,
        )
    )
    ax.add_patch(
        FancyArrowPatch(
            (x + 1.5, -1.8 + 0.4),
            (x + 1.5, -0.2 + 0.4),
            connectionstyle="arc3,rad=-0.5",
            arrowstyle="->",
            mutation_scale=10,
        )
    )
    ax.text(
        x + 3,
        -0.6,
        "ring: K/V block forward,\ndK/dV accumulator back\nto the shard's owner",
        fontsize=7,
        va="center",
    )
    ax.set_xlim(-8, 40)
    ax.set_ylim(-y, 1.6)
    ax.axis("off")


def main() -> None:
    tree = _tree()
    fig, axes = plt.subplots(3, 1, figsize=(13, 10), gridspec_kw={"height_ratios": [1.3, 1.6, 0.9]})
    panel_tree(axes[0], tree)
    panel_ranks(axes[1], tree)
    panel_replay(axes[2], tree)
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=130)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
