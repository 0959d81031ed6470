"""The sampler on Nemotron-H: a decode step is a 1-token segment continuing from its row of each Mamba layer's
state table (SSM state and conv tail, generation/kv_cache.py, as the gated delta net's), each prompt prefilled once
and its state forked at every branch point; greedy tokens equal HF `generate` (which decodes through its own
recurrent cache), sampled logprobs equal the training forward.

Bounds: the SSD scan is float32 inside (tests/unit/test_nemotron_h.py); logprobs tested at 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from sampler_helpers import VOCAB, _single_process, assert_greedy_equals_hf_generate, prompts  # noqa: F401 (the fixture)
from test_gdn_sampler import _training_logprobs
from test_nemotron_h import megatron_of, nemotron, plant_start_bug

from megatron_branch.generation import BranchSampler, SamplingParams


@pytest.fixture(scope="module")
def models():  # noqa: ANN201
    hf = nemotron(torch.float32, seed=7)
    _, model = megatron_of(hf, torch.float32)
    return hf.eval(), model.eval()


def test_greedy_equals_hf_generate_and_each_prompt_is_prefilled_once(models) -> None:  # noqa: ANN001
    hf, model = models
    assert_greedy_equals_hf_generate(hf, model)


@pytest.mark.parametrize("bug", [None, "zero_parent_state", "drop_parent_tail"])
def test_tree_sampled_logprobs_equal_the_training_forward(models, bug, monkeypatch) -> None:  # noqa: ANN001
    """Forks after 2 and 4 tokens: children continue from their parent's state row. Planted: decode steps from a
    zero SSM state, or without the conv tail (the logprobs then differ from the training forward)."""
    _, model = models
    if bug:
        plant_start_bug(monkeypatch, bug)
    sp = SamplingParams(n=4, max_new_tokens=6, temperature=1.0, branch_at=(2, 4), branch_factor=2)
    out = BranchSampler(model, vocab_size=VOCAB).generate(
        prompts(), sp, generator=torch.Generator().manual_seed(3)
    )
    monkeypatch.undo()
    samples = out.flat()
    assert len(samples) == 8 and out.stats.prompt_prefills == [1, 1]
    errs = [
        (torch.tensor(s.logprobs, dtype=torch.float64) - want).abs().max().item()
        for schedule in ("replay", "naive")
        for s, want in zip(samples, _training_logprobs(model, samples, schedule))
    ]
    assert (max(errs) <= 1e-5) if bug is None else (max(errs) > 1e-3), (bug, max(errs))  # 100x the bound
