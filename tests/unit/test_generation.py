"""Rollout generation through the shared-prefix cache: parity with cache-free decoding, logprobs equal to the
training forward's, the prompt prefilled once per group, tree sampling, and the sampling filters."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_branch.checkpoint.param_map import hf_to_mcore_state
from megatron_branch.checkpoint.tp import load_full_state
from megatron_branch.data import PrefixTree
from megatron_branch.errors import UserError
from megatron_branch.generation import (
    BranchSampler,
    Generator,
    SamplingParams,
    choose_tokens,
    sampling_logits,
)
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule, score_rollouts
from megatron_branch.testing import tiny_hf_config, tiny_hf_model

VOCAB = 41


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def make_model(dtype: torch.dtype, family: str = "llama", tie: bool = False):  # noqa: ANN201
    cfg = tiny_hf_config(family, vocab_size=VOCAB, tie=tie)
    hf = tiny_hf_model(cfg, seed=3, dtype=dtype)
    arch = ModelArch.from_hf_config(cfg)
    model = build_model(arch, dtype=dtype)
    load_full_state(
        model, hf_to_mcore_state(hf.state_dict(), arch, padded_vocab=arch.padded_vocab_size(1)), None
    )
    return model.eval(), arch


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def cache_free_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:  # noqa: ANN001
    """Greedy decoding by a FULL forward of prompt + generated so far at every step, through megatron's own
    attention (no BranchContext, no cache), causal mask given explicitly."""
    seq, lps = list(prompt), []
    for _ in range(steps):
        s = len(seq)
        ids = torch.tensor(seq)[None]
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
        logits = model(ids, torch.arange(s)[None], mask)[0, -1, :VOCAB].double()  # [v]
        t = int(torch.argmax(logits))
        lps.append(float(torch.log_softmax(logits, -1)[t]))
        seq.append(t)
    return seq[len(prompt) :], lps


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype,tie", [(torch.float64, False), (torch.float32, True)], ids=["fp64", "fp32_tied"]
)
def test_greedy_equals_cache_free_full_forward(dtype: torch.dtype, tie: bool) -> None:
    model, _ = make_model(dtype, tie=tie)
    prompts = prompts_of([9, 4, 13], seed=1)
    out = BranchSampler(model, vocab_size=VOCAB).generate(
        prompts, SamplingParams(n=3, max_new_tokens=7, temperature=0)
    )
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for p, prompt in enumerate(prompts):
        want, want_lp = cache_free_greedy(model, prompt, 7)
        assert len(out.samples[p]) == 3
        for s in out.samples[p]:
            assert list(s.response) == want
            assert s.finish_reason == "length"
            torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(want_lp), rtol=tol, atol=tol)


def training_logprobs(model, samples, schedule: str) -> list[torch.Tensor]:  # noqa: ANN001
    """Each sample's response logprobs as the training forward computes them (keep_logprobs), or as the
    forward-only scoring path does ("score")."""
    rollouts = [s.to_rollout(advantage=1.0) for s in samples]
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    if schedule == "score":
        return score_rollouts(
            "replay", model, tree, ScheduleOptions(vocab_size=VOCAB, chunk_tokens=None)
        ).logprobs
    obj = PolicyGradientObjective.grpo([1.0] * len(rollouts), tree.num_response_tokens_logical())
    res = run_schedule(
        schedule, model, tree, obj, ScheduleOptions(vocab_size=VOCAB, keep_logprobs=True, chunk_tokens=None)
    )
    model.zero_grad(set_to_none=True)
    return [res.rollout_logprobs(tree, i) for i in range(len(rollouts))]


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=9, top_p=0.9),
        dict(temperature=1.3, branch_at=(2, 4), branch_factor=2),
    ],
    ids=["t1", "t0.7_topk_topp", "tree"],
)
def test_recorded_logprobs_equal_training_forward_float32(params: dict) -> None:
    model, _ = make_model(torch.float32, family="qwen2")
    prompts = prompts_of([11, 6], seed=2)
    sp = SamplingParams(n=4, max_new_tokens=6, stop_token_ids=(5,), **params)
    out = BranchSampler(model, vocab_size=VOCAB).generate(
        prompts, sp, generator=torch.Generator().manual_seed(0)
    )
    samples = out.flat()
    assert len(samples) == 8
    for schedule in ("replay", "naive", "score"):
        for s, want in zip(samples, training_logprobs(model, samples, schedule)):
            torch.testing.assert_close(
                torch.tensor(s.logprobs, dtype=torch.float64), want, rtol=1e-5, atol=1e-5
            )
    plain = sp.temperature == 1.0 and sp.top_k == 0 and sp.top_p == 1.0
    diffs = [abs(a - b) for s in samples for a, b in zip(s.logprobs, s.sampling_logprobs)]
    if plain:  # the sampling distribution IS the policy: both records agree
        assert max(diffs) < 1e-6
    else:  # temperature/filters change q, not the recorded policy logprob
        assert max(diffs) > 1e-3


def test_prompt_prefilled_once_per_group_and_counts() -> None:
    model, _ = make_model(torch.float32)
    lengths = [10, 3, 7, 5]
    prompts = prompts_of(lengths, seed=4)
    sp = SamplingParams(n=8, max_new_tokens=5, temperature=1.0, branch_at=(2,), branch_factor=2)
    out = BranchSampler(model, vocab_size=VOCAB).generate(
        prompts, sp, generator=torch.Generator().manual_seed(1)
    )
    st = out.stats
    assert st.prompt_prefills == [1, 1, 1, 1]
    assert st.prefill_forwards == 1 and st.prefill_positions == sum(lengths)
    assert st.prefill_positions_unshared == 8 * sum(lengths)
    # no stop tokens: 4 roots x 2 tokens, then 8 leaves x 3 tokens per prompt are sampled; the last never fed
    assert st.tokens_sampled == 4 * (4 * 2 + 8 * 3)
    assert st.decode_positions == 4 * (4 * 2 + 8 * 2) and st.decode_steps == 4
    assert st.response_tokens == 4 * 8 * 5 and st.num_samples == 32
    assert st.tokens_per_s > 0
    # tree sampling: the 2 leaves under a root share its first 2 tokens, so the tree schedules see the sharing
    for group in out.samples:
        for a, b in zip(group[0::2], group[1::2]):
            assert a.response[:2] == b.response[:2]
    # prefill in groups of at most 12 tokens: still once per prompt, more forwards
    out2 = BranchSampler(model, vocab_size=VOCAB, max_prefill_tokens=12).generate(
        prompts, sp, generator=torch.Generator().manual_seed(1)
    )
    assert out2.stats.prompt_prefills == [1, 1, 1, 1] and out2.stats.prefill_forwards == 3
    assert [s.response for s in out2.flat()] == [s.response for s in out.flat()]


def test_seeded_reproducible_and_stop_tokens() -> None:
    model, _ = make_model(torch.float32)
    prompts = prompts_of([8, 8], seed=5)
    sampler = BranchSampler(model, vocab_size=VOCAB)
    assert isinstance(sampler, Generator)
    stops = tuple(range(0, VOCAB, 3))  # a third of the vocabulary stops: most rollouts end early
    sp = SamplingParams(
        n=6, max_new_tokens=8, temperature=1.0, stop_token_ids=stops, branch_at=(3,), branch_factor=3
    )
    a = sampler.generate(prompts, sp, generator=torch.Generator().manual_seed(7))
    b = sampler.generate(prompts, sp, generator=torch.Generator().manual_seed(7))
    c = sampler.generate(prompts, sp, generator=torch.Generator().manual_seed(8))
    assert [s.response for s in a.flat()] == [s.response for s in b.flat()]
    assert [s.response for s in a.flat()] != [s.response for s in c.flat()]
    reasons = set()
    for s in a.flat():
        assert len(s.response) == len(s.logprobs) == len(s.sampling_logprobs) <= 8
        if s.finish_reason == "stop":
            assert s.response[-1] in stops and not set(s.response[:-1]) & set(stops)
        else:
            assert len(s.response) == 8 and not set(s.response) & set(stops)
        reasons.add(s.finish_reason)
    assert reasons == {"stop", "length"} or reasons == {"stop"}
    assert all(len(g) == 6 for g in a.samples)


def test_sampling_filters_and_logprob_semantics() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 10, generator=g, dtype=torch.float64)
    x = sampling_logits(logits, SamplingParams(max_new_tokens=1, temperature=0.5, top_k=4))
    assert ((x > float("-inf")).sum(-1) == 4).all()
    torch.testing.assert_close(x.max(-1).values, logits.max(-1).values / 0.5)
    p = torch.softmax(logits, -1)
    x = sampling_logits(logits, SamplingParams(max_new_tokens=1, top_p=0.6))
    for row in range(3):  # the kept set is the smallest top set reaching 0.6
        kept = (x[row] > float("-inf")).sum()
        top = torch.sort(p[row], descending=True).values
        assert top[: kept - 1].sum() < 0.6 <= top[:kept].sum() + 1e-12
    sp = SamplingParams(max_new_tokens=1, temperature=0.5, top_k=4)
    tokens, logp, logq = choose_tokens(logits, sp, torch.Generator().manual_seed(1))
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0])
    torch.testing.assert_close(
        logq, torch.log_softmax(sampling_logits(logits, sp), -1).gather(1, tokens[:, None])[:, 0]
    )
    # empirical frequencies follow q (chi-square-free check: 20k draws, 3 sigma)
    many = torch.multinomial(
        torch.softmax(sampling_logits(logits[:1], sp), -1), 20000, replacement=True, generator=g
    )
    freq = torch.bincount(many[0], minlength=10).double() / 20000
    q = torch.softmax(sampling_logits(logits[:1], sp), -1)[0]
    assert ((freq - q).abs() <= 3 * (q * (1 - q) / 20000).sqrt() + 1e-9).all()
    greedy_tokens, _, greedy_q = choose_tokens(logits, SamplingParams(max_new_tokens=1, temperature=0), None)
    assert greedy_tokens.tolist() == logits.argmax(-1).tolist() and (greedy_q == 0).all()


def test_bad_input() -> None:
    model, arch = make_model(torch.float32)
    sampler = BranchSampler(model, vocab_size=VOCAB)
    sp = SamplingParams(n=2, max_new_tokens=4)
    with pytest.raises(UserError, match="prompt 1: prompt is empty"):
        sampler.generate([[1, 2], []], sp, generator=torch.Generator())
    with pytest.raises(UserError, match="prompt 0"):
        sampler.generate([[VOCAB]], sp, generator=torch.Generator())
    with pytest.raises(UserError, match="exceeds"):
        sampler.generate([[1] * arch.max_position_embeddings], sp, generator=torch.Generator())
    with pytest.raises(ValueError, match="generator"):
        sampler.generate([[1, 2]], sp)
    for bad in (dict(n=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-1), dict(branch_at=(4,)),
                dict(n=3, branch_at=(1,)), dict(branch_at=(2, 1), n=4)):  # fmt: skip
        with pytest.raises(ValueError):
            SamplingParams(**{"max_new_tokens": 4, **bad})
    assert math.isclose(SamplingParams(n=8, max_new_tokens=4, branch_at=(1, 2)).root_fanout, 2)


def test_planted_bug_ignoring_the_prompt_cache_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """If decode attention dropped the prompt's K/V (part A), greedy tokens would no longer match."""
    from megatron_branch.generation import kv_cache

    model, _ = make_model(torch.float64)
    prompts = prompts_of([9, 12], seed=1)
    monkeypatch.setattr(kv_cache, "lse_merge", lambda out_a, lse_a, out_b, lse_b: (out_b, lse_b))
    out = BranchSampler(model, vocab_size=VOCAB).generate(
        prompts, SamplingParams(max_new_tokens=6, temperature=0)
    )
    got = [list(s.response) for s in out.flat()]
    assert got != [cache_free_greedy(model, p, 6)[0] for p in prompts]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_a_registered_executor_runs_decode_and_greedy_equals_hf_generate(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """The executor seam: a backend added to the registry (a wrapper that counts its forwards and delegates to
    `packed`) runs decode with no edit of generation/kv_cache.py, and greedy tokens still equal HF generate."""
    from dataclasses import replace

    from megatron_branch.attention.dispatch import EXECUTORS

    calls: list[int] = []

    def counting_forward(q, ks, vs, plan, scale):  # noqa: ANN001, ANN202
        calls.append(q.shape[0])
        return EXECUTORS["packed"].forward(q, ks, vs, plan, scale)

    monkeypatch.setitem(
        EXECUTORS, "counting", replace(EXECUTORS["packed"], name="counting", forward=counting_forward)
    )
    cfg = tiny_hf_config("llama", vocab_size=VOCAB)
    hf = tiny_hf_model(cfg, seed=3, dtype=dtype).eval()
    model, _ = make_model(dtype)
    prompts = prompts_of([9, 5], seed=2)
    out = BranchSampler(model, vocab_size=VOCAB, backend="counting").generate(
        prompts, SamplingParams(n=2, max_new_tokens=5, temperature=0)
    )
    layers = cfg.num_hidden_layers
    decode_rows = [c for c in calls if c == 4]  # a decode step's rows: 2 prompts x 2 branches
    assert len(decode_rows) == 4 * layers  # every decode step (the 1st token comes from prefill), every layer
    for p, prompt in enumerate(prompts):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, min_new_tokens=5)
        for s in out.samples[p]:
            assert list(s.response) == want[0, len(prompt) :].tolist()


def test_a_baseline_backend_without_an_executor_decodes_with_the_default() -> None:
    """`repeat` (a one-rank baseline, no executor) prefills with its own method and decodes with the default
    executor (dispatch.plan_executor): the same greedy tokens and logprobs as the default backend."""
    model, _ = make_model(torch.float64)
    prompts = prompts_of([7, 4], seed=5)
    sp = SamplingParams(n=2, max_new_tokens=4, temperature=0)
    want = BranchSampler(model, vocab_size=VOCAB).generate(prompts, sp).flat()
    got = BranchSampler(model, vocab_size=VOCAB, backend="repeat").generate(prompts, sp).flat()
    assert [list(s.response) for s in got] == [list(s.response) for s in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-10, atol=1e-10)


def test_task_tokenizer_sampler_reward_pipeline(tmp_path) -> None:  # noqa: ANN001
    """The pieces the training loop chains: task prompts -> tokenizer -> sampler -> decoded text -> reward."""
    from megatron_branch.tasks import get_task, load_reward, score_responses
    from megatron_branch.tokenizer import SentencePieceTokenizer

    task = get_task("needles", length=20, num_needles=2)
    tok = SentencePieceTokenizer.train_or_load(tmp_path, task.corpus(50, seed=0))
    arch = ModelArch(family="llama", vocab_size=tok.vocab_size, hidden_size=32, num_layers=2,
                     num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64, max_position_embeddings=128)  # fmt: skip
    model = build_model(arch, dtype=torch.float32)
    rows = task.rows(3, seed=1)
    sp = SamplingParams(n=4, max_new_tokens=5, temperature=1.0, stop_token_ids=(tok.eos_id,))
    out = BranchSampler(model, vocab_size=tok.vocab_size).generate(
        [tok.encode(r.prompt) for r in rows], sp, generator=torch.Generator().manual_seed(0)
    )
    texts = [tok.decode(s.response) for s in out.flat()]
    rewards = score_responses(load_reward(task.reward_spec), [r for r in rows for _ in range(4)], texts)
    assert len(rewards) == 12 and all(0.0 <= x <= 1.0 for x in rewards)
    for s, text in zip(out.flat(), texts):
        assert tok.eos_id not in s.response[:-1] and len(s.response) <= 5 and "\n" not in text
    assert out.stats.prefill_positions == sum(len(tok.encode(r.prompt)) for r in rows)
    # held-out evaluation: greedy responses scored by the reward; exact match against the answer
    from megatron_branch.tasks import evaluate

    sampler = BranchSampler(model, vocab_size=tok.vocab_size)
    ev = evaluate(sampler, tok, rows, task.reward, max_new_tokens=5)
    greedy = sampler.generate([tok.encode(r.prompt) for r in rows], SamplingParams(max_new_tokens=5, temperature=0,
                              stop_token_ids=(tok.eos_id,)))  # fmt: skip
    assert ev.responses == tuple(tok.decode(s.response) for s in greedy.flat())
    assert ev.reward_mean == pytest.approx(
        sum(task.reward(r.prompt, t, r.row) for r, t in zip(rows, ev.responses)) / 3
    )
    perfect = evaluate(_Oracle(tok, rows), tok, rows, task.reward, max_new_tokens=5)
    assert perfect.reward_mean == 1.0 and perfect.exact == 1.0


class _Oracle:
    """A Generator that answers every row correctly (checks evaluate's bookkeeping)."""

    def __init__(self, tok, rows) -> None:  # noqa: ANN001
        self.tok, self.answers = tok, {tuple(tok.encode(r.prompt)): r.fields["answer"] for r in rows}

    def generate(self, prompts, params, *, generator):  # noqa: ANN001, ANN201
        from megatron_branch.generation import GenerationOutput, GenerationStats, Sample

        samples = []
        for i, p in enumerate(prompts):
            ids = (*self.tok.encode(self.answers[tuple(p)]), self.tok.eos_id)
            s = Sample(prompt_index=i, prompt=tuple(p), response=ids, logprobs=(0.0,) * len(ids),
                       sampling_logprobs=(0.0,) * len(ids), finish_reason="stop")  # fmt: skip
            samples.append([s] * params.n)
        return GenerationOutput(samples=samples, stats=GenerationStats())


@pytest.mark.slow
def test_on_policy_grpo_through_the_sampler_raises_a_simple_reward() -> None:
    """Samples (tree-sampled) -> rollouts with their old_logprobs -> replay update: a reward for emitting token 5
    rises quickly, and the batch's shared positions grow as the responses converge. Guards the sample order and
    `to_rollout` contract the training loop relies on."""
    v = 12
    arch = ModelArch(family="llama", vocab_size=v, hidden_size=32, num_layers=2, num_attention_heads=4,
                     num_query_groups=2, ffn_hidden_size=64, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    model = build_model(arch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = BranchSampler(model, vocab_size=v)
    gen = torch.Generator().manual_seed(0)
    prompts = [[1, 2, 3, 4], [4, 3, 2, 1, 0], [7, 7, 7]]
    sp = SamplingParams(n=8, max_new_tokens=3, temperature=1.0, branch_at=(1,), branch_factor=2)
    means, computed = [], []
    for _ in range(12):
        out = sampler.generate(prompts, sp, generator=gen)
        rewards = torch.tensor([sum(t == 5 for t in s.response) / 3 for s in out.flat()]).view(3, 8)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
        rollouts = [s.to_rollout(advantage=float(a)) for s, a in zip(out.flat(), adv)]
        assert all(r.token_fields["old_logprobs"] == s.logprobs for r, s in zip(rollouts, out.flat()))
        tree = PrefixTree.build(rollouts, vocab_size=v)
        opt.zero_grad(set_to_none=True)
        obj = PolicyGradientObjective.grpo(adv.tolist(), tree.num_response_tokens_logical())
        run_schedule("replay", model, tree, obj, ScheduleOptions(vocab_size=v, chunk_tokens=None))
        opt.step()
        means.append(float(rewards.mean()))
        computed.append(tree.positions_computed)
    assert sum(means[-3:]) / 3 > sum(means[:3]) / 3 + 0.3, means
    assert computed[-1] < computed[0], computed
