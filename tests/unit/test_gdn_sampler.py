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
from sampler_helpers import VOCAB, _single_process, assert_greedy_equals_hf_generate, prompts  # noqa: F401 (the fixture)
from test_gdn_replay import hybrid
from test_hybrid_models import megatron_of

from megatron_branch.data import PrefixTree
from megatron_branch.generation import BranchSampler, SamplingParams
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.schedule import ScheduleOptions, run_schedule


@pytest.fixture(scope="module")
def models():  # noqa: ANN201
    hf = hybrid(torch.float32, seed=7)
    _, model = megatron_of(hf, torch.float32)
    return hf.eval(), model.eval()


def test_greedy_equals_hf_generate_and_each_prompt_is_prefilled_once(models) -> None:  # noqa: ANN001
    hf, model = models
    assert_greedy_equals_hf_generate(hf, model)


def _training_logprobs(model, samples, schedule: str) -> list[torch.Tensor]:  # noqa: ANN001
    rollouts = [s.to_rollout(advantage=1.0) for s in samples]
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    obj = PolicyGradientObjective.grpo([1.0] * len(rollouts), tree.num_response_tokens_logical())
    res = run_schedule(schedule, model, tree, obj, ScheduleOptions(vocab_size=VOCAB, keep_logprobs=True))
    model.zero_grad(set_to_none=True)
    return [res.rollout_logprobs(tree, i) for i in range(len(rollouts))]


@pytest.mark.slow
@pytest.mark.parametrize("bug", [None, "zero_parent_state"])
def test_tree_sampled_logprobs_equal_the_training_forward(models, bug, monkeypatch) -> None:  # noqa: ANN001
    """Forks after 2 and 4 tokens: children continue from their parent's state row. Planted: a decode step from a
    zero state (the logprobs then differ from the training forward)."""
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
    for group in out.samples:  # tree sampling: pairs share their first 4 tokens
        assert all(a.response[:4] == b.response[:4] for a, b in zip(group[0::2], group[1::2]))
    errs = []
    for schedule in ("replay", "naive"):
        for s, want in zip(samples, _training_logprobs(model, samples, schedule)):
            errs.append((torch.tensor(s.logprobs, dtype=torch.float64) - want).abs().max().item())
    if bug is None:
        assert max(errs) <= 1e-5
    else:
        assert max(errs) > 1e-2
