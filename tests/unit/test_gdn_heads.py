"""The head blocks a gated delta net layer runs per CP rank (models/gdn_heads.py) and the zigzag row map the head
exchange reads (parallel/cp_layout.py zigzag_rows, schedule/chunks.py CPChunk.all_rows), in one process; the
exchange itself runs under torchrun (tests/distributed/test_gdn_cp.py). The CP rule's refusals (rules/) through
grad, train and the library.

One process can check the blocks exactly: the gated norm and out_proj act per value head and are linear after it,
so with an exchange that gives rank j its block of every row and returns zeros for the other blocks, the layer's
outputs summed over j are the whole layer's (and so are the gradients)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_hybrid_models import megatron_of

from megatron_branch.attention.context import LocalContext
from megatron_branch.cli import main
from megatron_branch.data import PrefixTree, Rollout, write_rollouts_jsonl
from megatron_branch.errors import UserError
from megatron_branch.models.gdn_heads import HeadBlocks
from megatron_branch.models.gdn_tree import GDNDims
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.rules import check_gdn_context_parallel, gdn_context_parallel_sizes
from megatron_branch.schedule.chunks import make_chunk, split_chunk
from megatron_branch.testing import exact_hf_norms, tiny_hf_config, tiny_hf_model


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def _dims(nk: int, nv: int) -> GDNDims:
    return GDNDims(qk=nk * 3, v=nv * 2, heads_k=nk, heads_v=nv, dk=3, dv=2, kernel=4)


@pytest.mark.parametrize("nk,nv,cp", [(2, 4, 2), (2, 4, 4), (1, 2, 2), (4, 8, 2), (2, 6, 2), (1, 4, 4)])
def test_blocks_cover_every_head_once_with_the_key_heads_they_read(nk: int, nv: int, cp: int) -> None:
    d = _dims(nk, nv)
    b = HeadBlocks.of(d, cp, torch.device("cpu"))
    assert sorted(b.value_heads.reshape(-1).tolist()) == list(range(nv))  # every value head in one block
    reads = nv // nk
    for j in range(cp):
        vh = b.value_heads[j]
        q = b.conv[j][: b.dims.qk]
        key_heads = sorted(set((q // d.dk).tolist()))
        assert key_heads == sorted(set((vh // reads).tolist()))  # the block's q channels: its key heads'
        assert torch.equal(b.conv[j][b.dims.qk : 2 * b.dims.qk], q + d.qk)  # k channels of the same heads
        v = b.conv[j][2 * b.dims.qk :]
        assert torch.equal((v - 2 * d.qk) // d.dv, vh.repeat_interleave(d.dv))
        z_end = 2 * d.qk + 2 * d.v
        assert torch.equal(b.index[j][-2 * len(vh) :], torch.cat([z_end + vh, z_end + nv + vh]))
        # the block's own GQA: its value head i reads its key head i // (heads_v / heads_k)
        r = b.dims.heads_v // b.dims.heads_k
        assert [key_heads[i // r] for i in range(len(vh))] == (vh // reads).tolist()
    z = set(range(2 * d.qk + d.v, 2 * d.qk + 2 * d.v))
    assert not z & set(b.index.reshape(-1).tolist())  # the output gate stays home


@pytest.mark.parametrize(
    "nk,nv,tp,ok",
    [(2, 4, 1, [1, 2, 4]), (16, 48, 8, [1, 2, 6]), (16, 48, 1, [1, 2, 4, 8, 16, 48]), (2, 6, 1, [1, 2, 6])],
)
def test_the_rule_lists_the_sizes_the_blocks_split(nk: int, nv: int, tp: int, ok: list[int]) -> None:
    assert gdn_context_parallel_sizes(key_heads=nk, value_heads=nv, tp=tp) == ok
    for cp in ok:
        check_gdn_context_parallel(key_heads=nk, value_heads=nv, tp=tp, cp=cp)
        HeadBlocks.of(_dims(nk // tp, nv // tp), cp, torch.device("cpu"))
    bad = next(c for c in range(2, 64) if c not in ok)
    with pytest.raises(UserError, match=f"--cp {bad} cannot split the hybrid's gated delta net heads"):
        check_gdn_context_parallel(key_heads=nk, value_heads=nv, tp=tp, cp=bad)


class _OneBlock:
    """An exchange for ONE process standing in for CP rank `rank` of `size` where every row is local: its block of
    every row, and zeros for the blocks the other ranks would send back."""

    def __init__(self, size: int, rank: int) -> None:
        self.size, self.rank = size, rank

    def to_tree(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.rank]

    def to_ranks(self, y: torch.Tensor) -> torch.Tensor:
        out = y.new_zeros(y.shape[0], self.size, y.shape[1])
        out[:, self.rank] = y
        return out


def _rollouts() -> list[Rollout]:
    p = [3, 14, 15, 9, 2, 6, 5]
    return [
        Rollout(prompt=p, response=[6, 5, 3, 5, 8], advantage=1.0),
        Rollout(prompt=p, response=[6, 5, 8, 1], advantage=-0.5),
        Rollout(prompt=p, response=[7], advantage=0.4),
        Rollout(prompt=[1, 2, 3], response=[4, 4, 4, 4, 4, 4], advantage=0.4),
    ]


@pytest.mark.parametrize("cp", [2, 4])
def test_the_blocks_summed_are_the_whole_layer(cp: int) -> None:
    """2 key / 4 value heads: CP2 splits whole key heads, CP4 shares each key head between two blocks."""
    hf = exact_hf_norms(
        tiny_hf_model(tiny_hf_config("qwen3_5", num_layers=1, layer_types=["linear_attention"]))
    )
    arch, model = megatron_of(hf)
    gdn = model.decoder.layers[0].self_attention
    tree = PrefixTree.build(_rollouts(), vocab_size=arch.vocab_size)
    ctree = make_chunk(tree, list(range(len(tree.segments)))).tree(tree)
    s = tree.num_tokens
    x = torch.randn(s, 1, arch.hidden_size, generator=torch.Generator().manual_seed(0))
    w = torch.randn(s, 1, arch.hidden_size, generator=torch.Generator().manual_seed(1))

    def run(ex: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        gdn.zero_grad(set_to_none=True)
        gdn.context = LocalContext(layout=None, tree=ctree, exchange=ex)  # type: ignore[arg-type]
        try:
            out, _ = gdn(x, None)
        finally:
            gdn.context = None
        (out * w).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in gdn.named_parameters()}

    whole, whole_grads = run(None)
    parts = [run(_OneBlock(cp, j)) for j in range(cp)]
    torch.testing.assert_close(sum(p[0] for p in parts), whole, rtol=0, atol=2e-6)
    for n, g in whole_grads.items():
        torch.testing.assert_close(sum(p[1][n] for p in parts), g, rtol=0, atol=2e-5 * g.abs().max().item())
    assert all(p[0].abs().max() > 0 for p in parts)  # every block contributes
    # the blocks are built once per (CP size, device) and kept on the layer: cp forwards and backwards used one
    cpu = torch.device("cpu")
    assert list(gdn._head_blocks) == [(cp, cpu)] and gdn.head_blocks(cp, cpu) is gdn._head_blocks[cp, cpu]
    fresh = HeadBlocks.of(gdn._dims(), cp, cpu)
    assert (
        torch.equal(gdn.head_blocks(cp, cpu).index, fresh.index)
        and gdn.head_blocks(cp, cpu).dims == fresh.dims
    )


@pytest.mark.parametrize("cp,pad", [(2, 1), (4, 2), (3, 1)])
def test_all_rows_is_every_ranks_share(cp: int, pad: int) -> None:
    tree = PrefixTree.build(_rollouts(), vocab_size=37)
    chunk = make_chunk(tree, list(range(len(tree.segments))))
    parts = [split_chunk(tree, chunk, cp, r, pad_to_multiple=pad) for r in range(cp)]
    for r in range(cp):
        assert torch.equal(parts[r].all_rows(tree)[r], parts[r].rows)
        assert torch.equal(parts[0].all_rows(tree), parts[r].all_rows(tree))
    rows = parts[0].all_rows(tree).reshape(-1)
    assert sorted(rows[rows >= 0].tolist()) == list(range(chunk.num_real))  # each unsplit row held once


# --- the rule through every entry point ------------------------------------------------------------------------------
def test_a_cp_size_the_heads_do_not_split_is_refused_by_grad_and_train(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from megatron_branch.train.config_io import load_config

    hf = tiny_hf_model(tiny_hf_config("qwen3_5", num_layers=4))  # 2 key / 4 value GDN heads
    hf.save_pretrained(tmp_path / "hf")
    write_rollouts_jsonl(tmp_path / "r.jsonl", _rollouts())
    out = tmp_path / "g.safetensors"
    argv = ["grad", "--hf", str(tmp_path / "hf"), "--rollouts", str(tmp_path / "r.jsonl"), "--out", str(out)]
    capsys.readouterr()  # save_pretrained's progress bar
    assert main([*argv, "--schedule", "replay", "--cp", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(
        "megatron-branch: error: --cp 3 cannot split the hybrid's gated"
    )
    assert "2 key / 4 value heads (--tp 1)" in err and "use --cp in 1, 2, 4" in err
    assert not out.exists()
    cfg = ["model.hf_path=" + str(tmp_path / "hf"), "data.task=kv_retrieval", "tokenizer.type=hf"]
    with pytest.raises(UserError) as e:
        load_config(None, [*cfg, "parallel.cp=3"])
    assert "parallel.cp=3 cannot split the hybrid's gated delta net heads" in str(e.value)
    assert "(parallel.tp=1)" in str(e.value) and "use parallel.cp in 1, 2, 4" in str(e.value)
    load_config(None, [*cfg, "parallel.cp=2"])  # a size the heads split is a valid config
