"""Generation under tensor parallel (+ sequence parallel): the same samples and logprobs as one rank, and the
recorded logprobs equal the TP training forward's. Under CP every rank generates the same samples redundantly
(the model is built as for training under CP; nothing in generation reads the CP group)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_branch.checkpoint.param_map import hf_to_mcore_state
from megatron_branch.checkpoint.tp import load_full_state
from megatron_branch.data import PrefixTree
from megatron_branch.generation import BranchSampler, EnvStep, MultiTurnParams, SamplingParams
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule
from megatron_branch.testing import tiny_hf_config, tiny_hf_model

VOCAB = 37
PARAMS = [
    SamplingParams(n=3, max_new_tokens=6, temperature=0),
    SamplingParams(n=4, max_new_tokens=6, temperature=0.9, top_p=0.95, stop_token_ids=(3,), branch_at=(2,)),
    SamplingParams(
        n=4,
        max_new_tokens=14,
        temperature=1.0,
        stop_token_ids=(3,),
        multi_turn=MultiTurnParams(turn_end_token_ids=tuple(range(4, VOCAB, 3)), branch_at_turns=(1,)),
    ),  # fmt: skip
]
"""Greedy; tree sampling; multi-turn rollouts forked after turn 1 (the observation fed on every TP rank)."""


class ToyTool:
    """A deterministic environment: a 2-4 token answer from the turn, done after 3 turns."""

    def reset(self, prompt: tuple[int, ...]) -> None:
        self.turns = 0

    def step(self, turn: tuple[int, ...]) -> EnvStep:
        self.turns += 1
        obs = tuple((sum(turn) + 5 * j) % VOCAB for j in range(2 + len(turn) % 3))
        return EnvStep(observation=obs, reward=1.0, done=self.turns >= 3)


def generate(hf, pcfg: ParallelConfig):  # noqa: ANN001, ANN201
    groups = initialize_parallel(pcfg)
    arch = ModelArch.from_hf_config(hf.config)
    model = build_model(
        arch, dtype=torch.float64, tp=groups.tp_size, sequence_parallel=groups.sequence_parallel
    )
    state = hf_to_mcore_state(hf.state_dict(), arch, padded_vocab=arch.padded_vocab_size(pcfg.tp))
    load_full_state(model, state, groups.tp)
    sampler = BranchSampler(model, vocab_size=VOCAB, groups=groups)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 4, 10)]  # odd total: SP pads
    outs = [
        sampler.generate(
            prompts, p, generator=torch.Generator().manual_seed(5),
            environments=None if p.multi_turn is None else lambda i: ToyTool(),
        )
        for p in PARAMS
    ]  # fmt: skip
    # the TP training forward's logprobs of the sampled tokens
    samples = outs[1].flat()
    rollouts = [s.to_rollout(advantage=1.0) for s in samples]
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    obj = PolicyGradientObjective.grpo([1.0] * len(rollouts), tree.num_response_tokens_logical())
    opts = ScheduleOptions(groups=groups, vocab_size=VOCAB, keep_logprobs=True, chunk_tokens=None)
    res = run_schedule("replay", model, tree, obj, opts)
    trained = [res.rollout_logprobs(tree, i) for i in range(len(rollouts))]
    return outs, trained


@pytest.mark.world(2)
@pytest.mark.parametrize(
    "pcfg",
    [ParallelConfig(tp=2), ParallelConfig(tp=2, sequence_parallel=True), ParallelConfig(cp=2)],
    ids=["tp2", "tp2_sp", "cp2_redundant"],
)
def test_generation_matches_single_rank(pcfg: ParallelConfig) -> None:
    hf = tiny_hf_model(
        tiny_hf_config("qwen2", vocab_size=VOCAB, heads=4, kv_heads=2), seed=2, dtype=torch.float64
    )
    ref, _ = generate(hf, ParallelConfig())  # world 2, tp 1: each rank alone
    outs, trained = generate(hf, pcfg)
    for got, want in zip(outs, ref):
        assert [s.response for s in got.flat()] == [s.response for s in want.flat()]
        for a, b in zip(got.flat(), want.flat()):
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-10, atol=1e-10
            )
        assert got.stats.prompt_prefills == [1, 1, 1]
        assert [s.loss_mask for s in got.flat()] == [s.loss_mask for s in want.flat()]
    assert any(s.tool_calls for s in outs[2].flat())  # the multi-turn case saw observations
    for s, lp in zip(outs[1].flat(), trained):
        torch.testing.assert_close(torch.tensor(s.logprobs, dtype=torch.float64), lp, rtol=1e-10, atol=1e-10)
    # both TP ranks hold the same samples
    mine = [list(s.response) for o in outs for s in o.flat()]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    assert all(e == every[0] for e in every)
