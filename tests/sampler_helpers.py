"""What the hybrid sampler tests share (tests/unit/test_gdn_sampler.py, test_moe_hybrid_sampler.py,
test_nemotron_h_sampler.py): the prompts, the module's single-process state, the greedy-equals-HF-generate check,
and tree sampling checked against the training forward's logprobs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megatron_branch.data import PrefixTree
from megatron_branch.generation import BranchSampler, SamplingParams
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule

VOCAB = 37


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def prompts() -> list[list[int]]:
    """Two prompts of 9 and 4 tokens, seeded by their length."""
    return [
        [int(x) for x in torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n))]
        for n in (9, 4)
    ]


def assert_greedy_equals_hf_generate(hf: torch.nn.Module, model: torch.nn.Module, steps: int = 6) -> None:
    """Greedy branch sampling (2 per prompt) == HF `generate`, and each prompt is prefilled once."""
    ps = prompts()
    out = BranchSampler(model, vocab_size=VOCAB).generate(
        ps, SamplingParams(n=2, max_new_tokens=steps, temperature=0)
    )
    assert out.stats.prompt_prefills == [1, 1] and out.stats.prefill_forwards == 1
    for p, prompt in enumerate(ps):
        want = hf.generate(
            torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps
        )
        for s in out.samples[p]:
            assert list(s.response) == want[0, len(prompt) :].tolist()


def tree_sample(model: torch.nn.Module, *, record: bool = False) -> Any:
    """4 samples per prompt (temperature 1, seeded), forks after 2 and 4 tokens: children continue from their
    parent's state row; `record`: with routing records (a MoE model)."""
    sp = SamplingParams(n=4, max_new_tokens=6, temperature=1.0, branch_at=(2, 4), branch_factor=2)
    return BranchSampler(model, vocab_size=VOCAB, record_routing=record).generate(
        prompts(), sp, generator=torch.Generator().manual_seed(3)
    )


def training_logprobs(
    model: torch.nn.Module, samples: list, schedule: str, moe: Any = None
) -> list[torch.Tensor]:
    """Each sample's response logprobs from a training forward of `schedule` over the samples' tree."""
    rollouts = [s.to_rollout(advantage=1.0) for s in samples]
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    obj = PolicyGradientObjective.grpo([1.0] * len(rollouts), tree.num_response_tokens_logical())
    opts = ScheduleOptions(vocab_size=VOCAB, keep_logprobs=True, moe=moe, chunk_tokens=None)
    res = run_schedule(schedule, model, tree, obj, opts)
    model.zero_grad(set_to_none=True)
    return [res.rollout_logprobs(tree, i) for i in range(len(rollouts))]


def max_logprob_error(samples: list, wants: list[torch.Tensor]) -> float:
    return max(
        (torch.tensor(s.logprobs, dtype=torch.float64) - w).abs().max().item()
        for s, w in zip(samples, wants, strict=True)
    )


def tree_sampling_error(model: torch.nn.Module, out: Any) -> float:
    """`tree_sample`'s output checked for its shape (8 samples, each prompt prefilled once, pairs sharing their
    first 4 tokens); the worst |sampled - training forward| logprob under replay and naive."""
    samples = out.flat()
    assert len(samples) == 8 and out.stats.prompt_prefills == [1, 1]
    for group in out.samples:  # tree sampling: pairs share their first 4 tokens
        assert all(a.response[:4] == b.response[:4] for a, b in zip(group[0::2], group[1::2]))
    return max(
        max_logprob_error(samples, training_logprobs(model, samples, schedule))
        for schedule in ("replay", "naive")
    )
