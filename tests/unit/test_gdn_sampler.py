"""The sampler on a hybrid: decoding steps every gated delta net layer's state per branch (a decode step is a
1-token segment continuing from its row of the state table, generation/kv_cache.py), each prompt's state computed
once by prefill and forked at every branch point.

Bounds: the delta rule is float32 inside; decode runs one token per rule call where training chunks the whole
segment, so logprobs agree to float32 rounding (tested at 1e-5, as tests/unit/test_generation.py does for float32).
"""

from __future__ import annotations

import pytest
import torch
from gdn_helpers import plant_start_bug
from sampler_helpers import (  # noqa: F401 (_single_process: the fixture)
    _single_process,
    assert_greedy_equals_hf_generate,
    tree_sample,
    tree_sampling_error,
)
from test_gdn_replay import hybrid
from test_hybrid_models import megatron_of


@pytest.fixture(scope="module")
def models():  # noqa: ANN201
    hf = hybrid(torch.float32, seed=7)
    _, model = megatron_of(hf, torch.float32)
    return hf.eval(), model.eval()


def test_greedy_equals_hf_generate_and_each_prompt_is_prefilled_once(models) -> None:  # noqa: ANN001
    hf, model = models
    assert_greedy_equals_hf_generate(hf, model)


@pytest.mark.slow
@pytest.mark.parametrize("bug", [None, "zero_parent_state"])
def test_tree_sampled_logprobs_equal_the_training_forward(models, bug, monkeypatch) -> None:  # noqa: ANN001
    """Forks after 2 and 4 tokens: children continue from their parent's state row. Planted: a decode step from a
    zero state (the logprobs then differ from the training forward)."""
    _, model = models
    if bug:
        plant_start_bug(monkeypatch, bug)
    out = tree_sample(model)
    monkeypatch.undo()
    err = tree_sampling_error(model, out)
    assert (err <= 1e-5) if bug is None else (err > 1e-2), (bug, err)
