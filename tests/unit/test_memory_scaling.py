"""Activation-memory SCALING of the schedules, measured with the deterministic ActivationMeter.

One prompt (P=64) with G leaf branches (S=8): replay keeps one prompt graph plus one micro-batch of leaves alive,
so its peak must not grow with G; packed keeps the whole tree, so it grows about linearly in G; naive keeps one
rollout at a time. These are byte counts from autograd's bookkeeping, identical run to run: no timing here.
"""

from __future__ import annotations

import random

import pytest
import torch

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.memory import ActivationMeter, track_extra
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, StepResult, run_schedule

VOCAB = 37
P, S, MICRO = 64, 8, 4
GS = (4, 8, 16, 32)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    initialize_parallel(ParallelConfig())
    torch.manual_seed(0)
    arch = ModelArch(
        family="llama",
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
    )
    return build_model(arch, dtype=torch.float32)


def one_prompt(g: int, seed: int = 0) -> list[Rollout]:
    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB) for _ in range(P)]
    # distinct first response tokens (g <= VOCAB): every rollout is its own leaf right below the prompt
    return [
        Rollout(
            prompt=prompt,
            response=[i] + [rng.randrange(VOCAB) for _ in range(S - 1)],
            advantage=rng.uniform(-1, 1),
        )
        for i in range(g)
    ]


def three_levels(seed: int = 1) -> list[Rollout]:
    """prompt 64 -> 2 x 16 -> 2 x 16 -> 4 leaves x 8: inner segments long enough that their graphs matter."""
    rng = random.Random(seed)

    def toks(first: int, n: int) -> list[int]:
        return [first] + [rng.randrange(VOCAB) for _ in range(n - 1)]

    prompt = [rng.randrange(VOCAB) for _ in range(P)]
    # one token run per NODE (drawn once), so that siblings share their parent's whole segment
    l1 = [toks(a, 16) for a in range(2)]
    l2 = [[toks(b, 16) for b in range(2)] for _ in range(2)]
    out = []
    for a in range(2):
        for b in range(2):
            for c in range(4):
                resp = l1[a] + l2[a][b] + toks(c, S)
                out.append(Rollout(prompt=prompt, response=resp, advantage=rng.uniform(-1, 1)))
    return out


def peak(
    model: torch.nn.Module, rollouts: list[Rollout], schedule: str, **kw: object
) -> tuple[int, StepResult]:
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rollouts], tree.num_response_tokens_logical())
    model.zero_grad(set_to_none=True)
    opts = ScheduleOptions(vocab_size=VOCAB, branch_micro_batch=MICRO, **{"chunk_tokens": None, **kw})  # type: ignore[arg-type]
    with ActivationMeter(model) as m:
        res = run_schedule(schedule, model, tree, obj, opts)
    # everything saved for backward was released by the end of the step (no graph or cache leaks)
    assert m.current_bytes == 0, (schedule, m.current_bytes)
    assert m.peak_bytes > 0
    return m.peak_bytes, res


def test_meter_counts_each_storage_once_and_releases() -> None:
    x = torch.randn(1000, requires_grad=True)
    with ActivationMeter() as m:
        y = (x * 2).exp()  # exp saves its output: 4000 bytes
        z = y.sin()  # sin saves its input, the SAME storage: still 4000
        assert m.current_bytes == 4000
        z.sum().backward()
        assert m.current_bytes == 0
        w = x.sin().cos()  # saves x and sin's output: two storages; dropped without backward
        assert m.current_bytes == 8000
        del w
        assert m.current_bytes == 0
    assert m.peak_bytes == 8000


def test_meter_excludes_parameters_and_tracks_extras() -> None:
    lin = torch.nn.Linear(16, 16, bias=False)
    x = torch.randn(4, 16, requires_grad=True)
    with ActivationMeter(lin) as m:
        out = lin(x)  # saves x (256 B) and the weight (excluded)
        assert m.current_bytes == 4 * 16 * 4
        leaf = torch.zeros(8, requires_grad=True)
        track_extra([leaf])
        assert m.current_bytes == 256 + 32
        (out.sum() + (leaf * 3).sum()).backward()  # leaf.grad appears: counted with the leaf
        assert m.current_bytes == 32 + 32
        del leaf
        assert m.current_bytes == 0


@pytest.mark.slow
def test_replay_flat_packed_linear_naive_flat(model: torch.nn.Module) -> None:
    peaks: dict[str, dict[int, int]] = {"naive": {}, "packed": {}, "replay": {}}
    for g in GS:
        for schedule in peaks:
            peaks[schedule][g], res = peak(model, one_prompt(g), schedule)
            want = g * (P + S) if schedule == "naive" else P + g * S
            assert res.positions_computed == want
    lo, hi = GS[0], GS[-1]
    replay, packed, naive = peaks["replay"], peaks["packed"], peaks["naive"]
    assert replay[hi] < 1.25 * replay[lo], replay
    assert packed[hi] > 2.5 * packed[lo], packed
    assert naive[hi] <= 1.01 * naive[lo], naive  # one rollout at a time, all of the same length
    # monotone in G for packed; replay below packed once the tree is bigger than prompt + one micro-batch
    assert all(packed[a] < packed[b] for a, b in zip(GS, GS[1:])), packed
    assert replay[hi] < 0.5 * packed[hi]


@pytest.mark.slow
def test_recompute_lowers_replay_peak_on_three_levels(model: torch.nn.Module) -> None:
    rollouts = three_levels()
    tree = PrefixTree.build(rollouts)
    assert tree.max_depth == 3 and tree.positions_computed == P + 2 * 16 + 4 * 16 + 16 * S
    plain, res_plain = peak(model, rollouts, "replay")
    recomputed, res_rec = peak(model, rollouts, "replay", recompute=True)
    assert res_plain.positions_recomputed == 0
    assert res_rec.positions_recomputed == P + 2 * 16 + 4 * 16  # every inner segment once more
    assert recomputed < 0.9 * plain, (recomputed, plain)
