"""The sampler on a mixture-of-experts hybrid (a tiny Qwen3-Next: GDN -> gated attention -> GDN, MoE blocks with a
gated shared expert, the last layer dense): each prompt's gated delta net state is computed once by prefill and
forked at every branch point, decoding steps it per branch (generation/kv_cache.py), and with record_routing the
sampler records the experts megatron routed every fed token to (routing replay, R3).

Shown: greedy == Hugging Face `generate`; tree-sampled logprobs == the replay and naive training forwards; each
prompt prefilled once; every record is the top-k megatron routes the token to in a plain forward of its sequence,
and the training forward with routing replay on gives the same logprobs; a planted decode from a zero state fails.

Bounds: the delta rule is float32 inside and decode runs one token per rule call where training chunks the whole
segment, so logprobs agree to float32 rounding, tested at 1e-5 (as tests/unit/test_gdn_sampler.py).
"""

from __future__ import annotations

import pytest
import torch
from gdn_helpers import plant_start_bug
from sampler_helpers import (  # noqa: F401 (_single_process: the fixture)
    _single_process,
    assert_greedy_equals_hf_generate,
    max_logprob_error,
    training_logprobs,
    tree_sample,
)
from test_moe_hybrid import hf_of, megatron_of

from megatron_branch.losses.router import MoEOptions
from megatron_branch.losses.routing import RoutingRecorder
from megatron_branch.models.moe import attach_router_context

BOUND = 1e-5


@pytest.fixture(scope="module")
def models():  # noqa: ANN201
    hf = hf_of("qwen3_next", torch.float32, seed=7)
    arch, model = megatron_of(hf, torch.float32)
    return hf.eval(), arch, model.eval()


def test_greedy_equals_hf_generate_and_each_prompt_is_prefilled_once(models) -> None:  # noqa: ANN001
    hf, _, model = models
    assert_greedy_equals_hf_generate(hf, model)


@pytest.mark.slow
def test_tree_sampled_logprobs_and_routing_records_equal_the_training_forward(models) -> None:  # noqa: ANN001
    _, arch, model = models
    out = tree_sample(model, record=True)
    samples = out.flat()
    assert len(samples) == 8 and out.stats.prompt_prefills == [1, 1] and out.stats.prefill_forwards == 1
    for group in out.samples:  # tree sampling: pairs share their first 4 tokens
        assert all(a.response[:4] == b.response[:4] for a, b in zip(group[0::2], group[1::2]))
    for schedule in ("replay", "naive"):
        assert max_logprob_error(samples, training_logprobs(model, samples, schedule)) <= BOUND, schedule
    # the records: every fed token's experts in a plain forward of its sequence; the last token, never fed, is -1
    for s in samples:
        rec, seq = s.routed_experts, torch.tensor(list(s.prompt) + list(s.response))
        assert tuple(rec.shape) == (len(seq), len(arch.moe_layers), arch.moe_top_k)
        assert (rec[-1] == -1).all() and (rec[:-1] >= 0).all()
        mask = torch.triu(torch.ones(len(seq), len(seq), dtype=torch.bool), 1)[None, None]
        recorder = RoutingRecorder()
        with torch.no_grad(), attach_router_context(model, recorder):
            model(seq[None], torch.arange(len(seq))[None], mask)
        got = recorder.experts(arch.moe_layers, arch.moe_top_k)
        assert torch.equal(got[:-1], rec[:-1])
    # the training forward routed to the records (the router unchanged: the same experts, the same logprobs)
    for schedule in ("replay", "packed"):
        wants = training_logprobs(model, samples, schedule, MoEOptions(routing_replay=True))
        assert max_logprob_error(samples, wants) <= BOUND, schedule
    # the router moved after sampling: with replay every schedule routes to the records (one answer), without it
    # to its own new top-k (another answer)
    moved = megatron_of(hf_of("qwen3_next", torch.float32, seed=7), torch.float32)[1]
    with torch.no_grad():
        for name, p in moved.named_parameters():
            if name.endswith("router.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(9)))
    replayed = {
        schedule: training_logprobs(moved, samples, schedule, MoEOptions(routing_replay=True))
        for schedule in ("naive", "packed", "replay")
    }
    for schedule in ("packed", "replay"):
        assert max((a - b).abs().max().item() for a, b in zip(replayed[schedule], replayed["naive"])) <= BOUND
    fresh = training_logprobs(moved, samples, "replay")
    assert max((a - b).abs().max().item() for a, b in zip(fresh, replayed["replay"])) > 1e-3


@pytest.mark.slow
def test_planted_zero_state_decode_fails(models, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A decode step from a zero GDN state (a planted bug in models/gdn.py's _start, tests/gdn_helpers.py): the
    logprobs leave the training forward's."""
    _, _, model = models
    plant_start_bug(monkeypatch, "zero_parent_state")
    out = tree_sample(model, record=False)
    monkeypatch.undo()
    samples = out.flat()
    assert max_logprob_error(samples, training_logprobs(model, samples, "naive")) > 1e-2
