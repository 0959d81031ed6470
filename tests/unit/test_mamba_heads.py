"""The head blocks a Mamba-2 mixer runs per CP rank (models/mamba_heads.py) and the CP rule for them (rules/
check_mamba_run), in one process; the exchange itself runs under torchrun (tests/distributed/test_nemotron_h_cp.py).

One process can check the blocks exactly up to the scan's output: with an exchange that gives rank j its block of
every row and returns zeros for the other blocks, the conv + scan outputs summed over j are the whole TP rank's (and
so are their gradients). The grouped gated norm after them is not linear across a group's heads, so the check stops
before it (the norm runs per position on the home rank, after the exchange back)."""

from __future__ import annotations

import pytest
import torch
from gdn_helpers import rollouts
from test_gdn_heads import _OneBlock

from megatron_branch.attention.context import LocalContext
from megatron_branch.data import PrefixTree
from megatron_branch.errors import SettingError
from megatron_branch.models import ModelArch, build_model
from megatron_branch.models.arch import check_schedule_supports
from megatron_branch.models.mamba_heads import MambaBlocks, MambaDims
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule.chunks import make_chunk
from megatron_branch.testing import tiny_hf_config


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


@pytest.mark.parametrize("H,G,cp", [(4, 2, 2), (4, 2, 4), (4, 1, 2), (8, 4, 2), (6, 2, 2)])
def test_blocks_cover_every_head_once_with_the_groups_they_read(H: int, G: int, cp: int) -> None:
    d = MambaDims(heads=H, groups=G, head_dim=3, state=2, kernel=4)
    b = MambaBlocks.of(d, cp, torch.device("cpu"))
    assert sorted(b.heads.reshape(-1).tolist()) == list(range(H))  # every head in one block
    for j in range(cp):
        h = b.heads[j]
        x, B, C = torch.split(b.conv[j], [b.dims.d_inner, b.dims.groups * 2, b.dims.groups * 2])
        assert torch.equal(x // 3, h.repeat_interleave(3))  # the heads' x channels
        groups = sorted(set(((B - d.d_inner) // 2).tolist()))
        assert groups == sorted(set((h // (H // G)).tolist()))  # B of the groups these heads read
        assert torch.equal(C, B + G * 2)  # and C of the same groups
        assert torch.equal(b.index[j], torch.cat([b.conv[j], d.conv_channels + h]))  # + their dt


def test_the_rule_is_megatrons_split_and_refuses_in_one_line() -> None:
    """4 heads in 2 groups (the tiny model): CP 2 (whole groups) and 4 (a group's B/C on two ranks) split, 3 not;
    TP2 leaves 2 heads in 1 group per rank: CP 2 only."""
    arch = ModelArch.from_hf_config(tiny_hf_config("nemotron_h", num_layers=5, ffn=48))
    for tp, cp in ((1, 2), (1, 4), (2, 2)):
        check_schedule_supports(arch, "replay", cp=cp, tp=tp)
    for tp, cp, words in ((1, 3, "4 heads in 2 groups (--tp 1)"), (2, 4, "2 heads in 1 group (--tp 2)")):
        with pytest.raises(SettingError) as e:
            check_schedule_supports(arch, "replay", cp=cp, tp=tp)
        msg = str(e.value)
        assert f"--cp {cp} cannot split the Mamba-2 heads" in msg and words in msg and "\n" not in msg, msg


@pytest.mark.parametrize("cp", [2, 4])
def test_the_blocks_summed_are_the_whole_scan(cp: int) -> None:
    """CP2: each block one whole group; CP4: each group's B / C read by two blocks (megatron's replicated group)."""
    arch = ModelArch.from_hf_config(tiny_hf_config("nemotron_h", num_layers=1, ffn=48, layer_types="M"))
    mixer = build_model(arch).decoder.layers[0].self_attention
    tree = PrefixTree.build(rollouts(), vocab_size=arch.vocab_size)
    ctree = make_chunk(tree, list(range(len(tree.segments)))).tree(tree)
    dims = mixer._dims()
    s = tree.num_tokens
    x = torch.randn(s, dims.conv_channels + dims.heads, generator=torch.Generator().manual_seed(0))
    w = torch.randn(s, dims.d_inner, generator=torch.Generator().manual_seed(1))

    def run(ex: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mixer.zero_grad(set_to_none=True)
        mixer.context = LocalContext(layout=None, tree=ctree, exchange=ex)  # type: ignore[arg-type]
        try:
            y = mixer._tree_or_blocks(x, dims, mixer._params())
        finally:
            mixer.context = None
        (y * w).sum().backward()
        return y.detach(), {n: p.grad.clone() for n, p in mixer.named_parameters() if p.grad is not None}

    whole, whole_grads = run(None)
    parts = [run(_OneBlock(cp, j)) for j in range(cp)]
    torch.testing.assert_close(sum(p[0] for p in parts), whole, rtol=0, atol=1e-6 * whole.abs().max().item())
    assert set(whole_grads) == {"conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D"}
    for n, g in whole_grads.items():
        got = sum(p[1][n] for p in parts)
        torch.testing.assert_close(got, g, rtol=0, atol=1e-5 * g.abs().max().item())
    assert all(p[0].abs().max() > 0 for p in parts)  # every block contributes
    blocks = mixer.head_blocks(cp, torch.device("cpu"))
    for j, (y, _) in enumerate(parts):  # block j's output lands on its heads' channels only
        mine = (blocks.heads[j][:, None] * dims.head_dim + torch.arange(dims.head_dim)).reshape(-1)
        others = torch.ones(dims.d_inner, dtype=torch.bool)
        others[mine] = False
        assert y[:, others].abs().max() == 0
