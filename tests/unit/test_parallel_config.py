"""Parallel layouts refused before any work: CP larger than the tokens allow, naive under CP, bad sizes.

The refusals that need a real multi-process world (CP too large for the tree under torchrun, world not tp*cp*dp at
world 2) are in tests/distributed/test_grad_matrix.py::test_grad_refusals_before_work.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from megatron_branch.cli import main
from megatron_branch.data import PrefixTree, Rollout, write_rollouts_jsonl
from megatron_branch.errors import UserError
from megatron_branch.parallel.cp_layout import check_cp_fits
from megatron_branch.parallel.groups import ParallelConfig
from megatron_branch.schedule.chunks import make_chunk, split_chunk


def _random_tree(rng: random.Random) -> PrefixTree:
    prompt = [rng.randrange(1, 30) for _ in range(rng.randint(1, 6))]
    rs = []
    for first in rng.sample(range(1, 30), rng.randint(1, 3)):
        tail = [rng.randrange(1, 30) for _ in range(rng.randint(0, 5))]
        rs.append(Rollout(prompt=prompt, response=[first, *tail], advantage=1.0))
    return PrefixTree.build(rs, vocab_size=37)


def test_check_cp_fits_refuses_exactly_idle_ranks() -> None:
    """The rule refuses a CP size iff some CP rank would hold no real token of any chunk of the step."""
    rng = random.Random(0)
    for _ in range(60):
        tree = _random_tree(rng)
        whole = make_chunk(
            tree, range(len(tree.segments))
        )  # packed; replay's chunks partition the same segments
        for cp in range(1, 10):
            idle = any(not bool((split_chunk(tree, whole, cp, r).token_index >= 0).any()) for r in range(cp))
            if idle:
                with pytest.raises(UserError, match=f"--cp {cp} is larger than the tokens allow"):
                    check_cp_fits(tree, cp)
            else:
                check_cp_fits(tree, cp)


def test_check_cp_fits_boundary() -> None:
    tree = PrefixTree.build(
        [
            Rollout(prompt=[1, 2, 3], response=[4], advantage=1.0),
            Rollout(prompt=[1, 2, 3], response=[5], advantage=1),
        ]
    )
    check_cp_fits(tree, 3)  # the prompt segment has 3 tokens: rank 2 holds its last one
    with pytest.raises(UserError) as e:
        check_cp_fits(tree, 4)
    assert "\n" not in str(e.value) and "use --cp <= 3" in str(e.value)


def test_parallel_config_sizes() -> None:
    assert ParallelConfig(tp=2, cp=2).data_parallel_size(8) == 2
    with pytest.raises(UserError, match="world size 6 is not a multiple of tp\\*cp"):
        ParallelConfig(tp=2, cp=2).data_parallel_size(6)
    with pytest.raises(UserError, match=r"tp\*cp = 4\*4 = 16 ranks > world size 8"):  # issue 35: 16 > 8 said
        ParallelConfig(tp=4, cp=4).data_parallel_size(8)
    with pytest.raises(UserError, match="--cp must be a positive integer"):
        ParallelConfig(cp=0)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from megatron_branch.testing import tiny_hf_config, tiny_hf_model

    d = tmp_path_factory.mktemp("pcfg")
    tiny_hf_model(tiny_hf_config("qwen2", heads=4, kv_heads=2), seed=0).save_pretrained(d / "hf")
    write_rollouts_jsonl(d / "r.jsonl", [Rollout(prompt=[1, 2, 3], response=[4, 5], advantage=1.0)])
    return d


@pytest.mark.parametrize(
    "layout,words",
    [
        (["--tp", "3"], "tensor parallel size 3"),  # 4 heads
        (["--cp", "2"], "tp*cp = 1*2 = 2 ranks > world size 1"),
        (["--cp", "2", "--schedule", "naive"], "--schedule naive has no context parallelism"),
    ],
)
def test_grad_refuses_before_work(
    workdir: Path, capsys: pytest.CaptureFixture[str], layout: list[str], words: str
) -> None:
    out = workdir / "never.safetensors"
    argv = ["grad", "--hf", str(workdir / "hf"), "--rollouts", str(workdir / "r.jsonl"), "--out", str(out)]
    rc = main([*argv, *layout])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and words in err and "\n" not in err, err
    assert err.startswith("megatron-branch: error:")
    assert not out.exists()
