"""The sampler on Nemotron-H: a decode step is a 1-token segment continuing from its row of each Mamba layer's
state table (SSM state and conv tail, generation/kv_cache.py, as the gated delta net's), each prompt prefilled once
and its state forked at every branch point; greedy tokens equal HF `generate` (which decodes through its own
recurrent cache), sampled logprobs equal the training forward.

Bounds: the SSD scan is float32 inside (tests/unit/test_nemotron_h.py); logprobs tested at 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from sampler_helpers import (  # noqa: F401 (_single_process: the fixture)
    _single_process,
    assert_greedy_equals_hf_generate,
    tree_sample,
    tree_sampling_error,
)
from test_nemotron_h import megatron_of, nemotron, plant_start_bug


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
    out = tree_sample(model)
    monkeypatch.undo()
    err = tree_sampling_error(model, out)
    assert (err <= 1e-5) if bug is None else (err > 1e-3), (bug, err)  # 100x the bound
