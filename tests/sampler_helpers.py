"""What the hybrid sampler tests share (tests/unit/test_gdn_sampler.py, test_moe_hybrid_sampler.py): the prompts,
the module's single-process state, and the greedy-equals-HF-generate check."""

from __future__ import annotations

import pytest
import torch

from megatron_branch.generation import BranchSampler, SamplingParams
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel

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
