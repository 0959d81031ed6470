"""Multi-turn rollouts in the sampler (generation/multi_turn.py): the turn loop against Hugging Face `generate` run
turn by turn with the observation appended, the observation's loss_mask 0, each token (earlier turns, tool output)
fed once, branching at turns giving the update a tree that shares the earlier turns, and the settings' refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_branch.checkpoint.param_map import hf_to_mcore_state
from megatron_branch.checkpoint.tp import load_full_state
from megatron_branch.data import PrefixTree
from megatron_branch.errors import SettingError
from megatron_branch.generation import BranchSampler, EnvStep, MultiTurnParams, SamplingParams
from megatron_branch.generation import multi_turn as mt_module
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule
from megatron_branch.testing import tiny_hf_config, tiny_hf_model

VOCAB = 41
ENDS = tuple(
    t for t in range(VOCAB) if t % 4 == 1
)  # a quarter of the vocabulary ends a turn: turns are short
STOP = (VOCAB - 1,)


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


@pytest.fixture(scope="module")
def models():  # noqa: ANN201
    cfg = tiny_hf_config("llama", vocab_size=VOCAB)
    hf = tiny_hf_model(cfg, seed=3, dtype=torch.float32).eval()
    arch = ModelArch.from_hf_config(cfg)
    model = build_model(arch, dtype=torch.float32)
    load_full_state(
        model, hf_to_mcore_state(hf.state_dict(), arch, padded_vocab=arch.padded_vocab_size(1)), None
    )
    return hf, model.eval()


class EchoEnv:
    """A deterministic toy tool: the observation depends on the prompt and the turn (3 to 5 tokens); the reward
    counts turns; done after `episode` turns."""

    def __init__(self, episode: int = 4) -> None:
        self.episode = episode
        self.seen = 0
        self.prompt: tuple[int, ...] = ()

    def reset(self, prompt: tuple[int, ...]) -> None:
        self.prompt, self.seen = prompt, 0

    def step(self, turn: tuple[int, ...]) -> EnvStep:
        self.seen += 1
        k = 3 + (sum(turn) + len(self.prompt)) % 3
        obs = tuple((7 * self.seen + 3 * t + len(turn)) % (VOCAB - 1) for t in range(k))
        return EnvStep(observation=obs, reward=1.0, done=self.seen >= self.episode)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (9, 5)]


def turn_params(**kw) -> MultiTurnParams:  # noqa: ANN003
    return MultiTurnParams(turn_end_token_ids=ENDS, **kw)


def expected_turns(prompt, response, mt: MultiTurnParams, budget: int):  # noqa: ANN001, ANN201
    """Walk a response as the turn loop must have built it: the policy's tokens up to a turn end, then the
    environment's observation (cut as the settings say). -> (mask, turns, observations)."""
    env = EchoEnv()
    env.reset(tuple(prompt))
    mask, turns, obs_count, i, start = [], 0, 0, 0, 0
    while i < len(response):
        t = response[i]
        mask.append(True)
        i += 1
        if t in ENDS or t in STOP or i == budget:
            turns += 1
            answer = env.step(tuple(response[start:i]))
            if t in STOP or i == budget or answer.done or turns >= (mt.max_assistant_turns or 10**9):
                break
            if mt.max_user_turns is not None and obs_count >= mt.max_user_turns:
                break
            obs = list(answer.observation)[: mt.max_tool_response_length][: budget - i]
            assert tuple(response[i : i + len(obs)]) == tuple(obs), "the observation was appended as given"
            mask += [False] * len(obs)
            i += len(obs)
            obs_count += 1
            start = i
    assert i == len(response), "the rollout ends where the loop says it ends"
    return mask, turns, obs_count


def hf_turn_by_turn(hf, prompt, mt: MultiTurnParams, budget: int) -> list[int]:  # noqa: ANN001
    """Hugging Face `generate` (greedy) for each policy turn, stopping at a turn end or stop token; the
    environment's observation appended; again."""
    env = EchoEnv()
    env.reset(tuple(prompt))
    seq, turns, obs_count = list(prompt), 0, 0
    while len(seq) - len(prompt) < budget:
        left = budget - (len(seq) - len(prompt))
        out = hf.generate(
            torch.tensor([seq]), max_new_tokens=left, do_sample=False, eos_token_id=list(ENDS + STOP),
            pad_token_id=0,
        )[0].tolist()  # fmt: skip
        turn = out[len(seq) :]
        seq = out
        turns += 1
        answer = env.step(tuple(turn))
        if turn[-1] in STOP or len(seq) - len(prompt) == budget or answer.done:
            break
        if (mt.max_assistant_turns and turns >= mt.max_assistant_turns) or (
            mt.max_user_turns is not None and obs_count >= mt.max_user_turns
        ):
            break
        obs = list(answer.observation)[: mt.max_tool_response_length]
        seq += obs[: budget - (len(seq) - len(prompt))]
        obs_count += 1
    return seq[len(prompt) :]


def fed_positions(samples) -> int:  # noqa: ANN001
    """Distinct fed response tokens of a generate call: every (prompt, response prefix) node once, the last token
    of each rollout never fed."""
    fed = set()
    for s in samples:
        for j in range(1, len(s.response)):
            fed.add((s.prompt_index, tuple(s.response[:j])))
    return len(fed)


@pytest.mark.parametrize(
    "mt",
    [
        turn_params(),
        turn_params(max_assistant_turns=3, max_tool_response_length=2),
        turn_params(max_user_turns=1),
    ],
    ids=["free", "bounded", "one_observation"],
)
def test_greedy_multi_turn_equals_hf_generate_turn_by_turn(models, mt: MultiTurnParams) -> None:
    """Greedy fp32 turn loop == HF generate per turn with the observation appended; loss_mask 0 exactly on the
    observation tokens; each prompt prefilled once and every response token fed once (no turn run again)."""
    hf, model = models
    budget = 24
    ps = prompts()
    params = SamplingParams(n=2, max_new_tokens=budget, temperature=0, stop_token_ids=STOP, multi_turn=mt)
    out = BranchSampler(model, vocab_size=VOCAB).generate(ps, params, environments=lambda p: EchoEnv())
    assert out.stats.prompt_prefills == [1, 1] and out.stats.prefill_positions == sum(map(len, ps))
    assert out.stats.decode_positions == 2 * fed_positions(out.flat())  # n = 2 identical greedy branches
    total_obs = 0
    for p, prompt in enumerate(ps):
        want = hf_turn_by_turn(hf, prompt, mt, budget)
        for s in out.samples[p]:
            assert list(s.response) == want
            mask, turns, n_obs = expected_turns(prompt, s.response, mt, budget)
            assert list(s.loss_mask) == mask and s.turns == turns and s.tool_calls == n_obs
            assert s.env_reward == float(turns)
            rollout = s.to_rollout()
            assert rollout.num_trained == sum(mask)
            total_obs += len(mask) - sum(mask)
    assert total_obs > 0, "the test must see observations"
    if mt.max_user_turns == 1:
        assert all(s.tool_calls <= 1 for s in out.flat())


def test_unshared_multi_turn_samples_the_same_rollouts(models) -> None:
    """share_prefix=False (every rollout its own prefill and environment): the same sampled episodes, n prefills."""
    _, model = models
    outs = {}
    for share in (True, False):
        params = SamplingParams(
            n=3,
            max_new_tokens=16,
            temperature=1.0,
            stop_token_ids=STOP,
            multi_turn=turn_params(),
            share_prefix=share,
        )
        outs[share] = BranchSampler(model, vocab_size=VOCAB).generate(
            prompts(), params, generator=torch.Generator().manual_seed(2), environments=lambda p: EchoEnv()
        )
    key = lambda o: [(s.response, s.loss_mask, s.turns, s.env_reward) for s in o.flat()]  # noqa: E731
    assert key(outs[True]) == key(outs[False]) and any(s.tool_calls for s in outs[True].flat())
    assert outs[False].stats.prompt_prefills == [3, 3]


def test_branching_at_turns_shares_earlier_turns_and_the_update_sees_the_tree(models) -> None:
    """Sampled (temperature 1) with forks after turns 1 and 2: siblings share every earlier turn, tool output
    included; the update's tree computes each shared position once (computed < logical, both counted), and the
    sampler's logprobs of the policy's tokens equal the training forward's through that tree (fp32 1e-5)."""
    _, model = models
    mt = turn_params(branch_at_turns=(1, 2), max_assistant_turns=4)
    params = SamplingParams(n=4, max_new_tokens=20, temperature=1.0, stop_token_ids=STOP, multi_turn=mt)
    ps = prompts()
    out = BranchSampler(model, vocab_size=VOCAB).generate(
        ps, params, generator=torch.Generator().manual_seed(11), environments=lambda p: EchoEnv()
    )
    samples = out.flat()
    assert len(samples) == 8
    # each branch feeds its own tokens once; a shared turn (tool output included) is fed once by the parent
    assert out.stats.decode_positions == sum(branch_fed(group, p) for p, group in enumerate(out.samples))
    forked = 0
    for p, group in enumerate(out.samples):
        for s in group:
            mask, turns, n_obs = expected_turns(ps[p], s.response, mt, 20)
            assert list(s.loss_mask) == mask and s.turns == turns
        # siblings after turn 1: leaves (0, 1) and (2, 3) share turn 1 + its observation + turn 2 + its observation
        first = [shared_through_turn(s, 1) for s in group]
        assert len(set(first)) == 1
        forked += sum(s.tool_calls > 0 for s in group)
    assert forked > 0 and len({s.response for s in samples}) > 2, "the test must see forks"
    rollouts = [s.to_rollout(advantage=1.0) for s in samples]
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    distinct = {
        (s.prompt_index, tuple(s.response[:j])) for s in samples for j in range(1, len(s.response) + 1)
    }
    assert tree.positions_computed == sum(map(len, ps)) + len(distinct) < tree.positions_logical
    assert tree.positions_logical == sum(len(s.prompt) + len(s.response) for s in samples)
    obj = PolicyGradientObjective.grpo([1.0] * len(rollouts), tree.num_trained_tokens_logical())
    res = run_schedule(
        "replay", model, tree, obj, ScheduleOptions(vocab_size=VOCAB, keep_logprobs=True, chunk_tokens=None)
    )
    model.zero_grad(set_to_none=True)
    for i, s in enumerate(samples):
        got = res.rollout_logprobs(tree, i)
        torch.testing.assert_close(got.float(), torch.tensor(s.logprobs), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_hybrid_multi_turn_continues_each_branch_state() -> None:
    """A gated delta net hybrid (Qwen3.5-style, fp32): greedy multi-turn == HF generate turn by turn, so every
    observation was fed onto the branch's state row; with forks after turn 1 the sampled logprobs equal replay's
    training forward through the tree (each child continued its parent's state)."""
    from test_gdn_replay import LAYERS, exact_hf_norms
    from test_hybrid_models import megatron_of

    cfg = tiny_hf_config("qwen3_5", num_layers=3, ffn=48, layer_types=LAYERS, vocab_size=VOCAB)
    hf = exact_hf_norms(tiny_hf_model(cfg, seed=5, dtype=torch.float32)).eval()
    _, model = megatron_of(hf, torch.float32)
    model.eval()
    mt, ps = turn_params(), prompts()
    greedy = SamplingParams(n=1, max_new_tokens=16, temperature=0, stop_token_ids=STOP, multi_turn=mt)
    out = BranchSampler(model, vocab_size=VOCAB).generate(ps, greedy, environments=lambda p: EchoEnv())
    assert sum(s.tool_calls for s in out.flat()) > 0
    for p, prompt in enumerate(ps):
        assert list(out.samples[p][0].response) == hf_turn_by_turn(hf, prompt, mt, 16)
    forked = dataclasses.replace(greedy, n=2, temperature=1.0, multi_turn=turn_params(branch_at_turns=(1,)))
    out = BranchSampler(model, vocab_size=VOCAB).generate(
        ps, forked, generator=torch.Generator().manual_seed(4), environments=lambda p: EchoEnv()
    )
    samples = out.flat()
    assert any(s.tool_calls for s in samples) and len({s.response for s in samples}) > len(ps)
    rollouts = [s.to_rollout(advantage=1.0) for s in samples]
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    obj = PolicyGradientObjective.grpo([1.0] * len(rollouts), tree.num_trained_tokens_logical())
    res = run_schedule(
        "replay", model, tree, obj, ScheduleOptions(vocab_size=VOCAB, keep_logprobs=True, chunk_tokens=None)
    )
    model.zero_grad(set_to_none=True)
    for i, s in enumerate(samples):
        torch.testing.assert_close(
            res.rollout_logprobs(tree, i).float(), torch.tensor(s.logprobs), rtol=1e-5, atol=1e-5
        )


def branch_fed(group, p: int) -> int:  # noqa: ANN001
    """Fed tokens of one prompt's tree forked after turns 1 and 2 (4 leaves, depth first): token j of leaf l
    belongs to the root before the first fork point, to pair l // 2 before the second, else to leaf l."""
    fed = set()
    for leaf, s in enumerate(group):
        f1, f2 = len(shared_through_turn(s, 1)), len(shared_through_turn(s, 2))
        for j in range(len(s.response) - 1):  # the last token is never fed
            owner = "root" if j < f1 else (leaf // 2 if j < f2 else (leaf, "leaf"))
            fed.add((p, j, owner))
    return len(fed)


def shared_through_turn(s, t: int) -> tuple[int, ...]:  # noqa: ANN001
    """The response through the observation of turn t (the part siblings forked after turn t share)."""
    mask = s.loss_mask
    turns, i = 0, 0
    while i < len(mask) and turns < t:
        if mask[i] and s.response[i] in ENDS:
            turns += 1
        i += 1
    while i < len(mask) and not mask[i]:
        i += 1
    return tuple(s.response[:i])


def test_planted_bug_an_observation_marked_trained_is_caught(models, monkeypatch) -> None:
    """Planted: observation tokens recorded with loss_mask 1: the mask check fails."""
    _, model = models
    real = mt_module.append_forced

    def buggy(branch, logprob, max_new_tokens):  # noqa: ANN001, ANN202
        real(branch, logprob, max_new_tokens)
        branch.mask[-1] = True

    monkeypatch.setattr(mt_module, "append_forced", buggy)
    mt = turn_params()
    params = SamplingParams(n=1, max_new_tokens=24, temperature=0, stop_token_ids=STOP, multi_turn=mt)
    out = BranchSampler(model, vocab_size=VOCAB).generate(prompts(), params, environments=lambda p: EchoEnv())
    with pytest.raises(AssertionError):
        for s in out.flat():
            mask, _, _ = expected_turns(s.prompt, s.response, mt, 24)
            assert list(s.loss_mask) == mask


@pytest.mark.parametrize(
    "kw,params_kw,needle",
    [
        ({"turn_end_token_ids": ()}, {}, "turn_end_token_ids must name at least one token"),
        ({"branch_at_turns": (2, 1)}, {}, "branch_at_turns must be strictly increasing"),
        (
            {"branch_at_turns": (3,), "max_assistant_turns": 3},
            {},
            "below MultiTurnParams.max_assistant_turns=3",
        ),
        ({"max_user_turns": 0}, {}, "max_user_turns must be a positive int or null"),
        ({"max_tool_response_length": -1}, {}, "max_tool_response_length must be a positive int"),
        ({"branch_at_turns": (1,)}, {"n": 3}, "must be divisible by SamplingParams.branch_factor"),
        ({"branch_at_turns": (1,)}, {"branch_at": (2,)}, "both fork rollouts"),
        ({"branch_at_turns": (1,)}, {"share_prefix": False}, "forks rollouts that share earlier turns"),
    ],
)
def test_bad_multi_turn_settings_are_one_line(kw: dict, params_kw: dict, needle: str) -> None:
    with pytest.raises(SettingError, match=needle) as e:
        mt = MultiTurnParams(**{"turn_end_token_ids": ENDS, **kw})
        SamplingParams(**{"n": 4, "max_new_tokens": 8, "multi_turn": mt, **params_kw})
    assert "\n" not in str(e.value)


def test_environments_go_with_multi_turn_params(models) -> None:
    _, model = models
    with pytest.raises(ValueError, match="needs both"):
        BranchSampler(model, vocab_size=VOCAB).generate(
            prompts(), SamplingParams(n=1, max_new_tokens=4, temperature=0), environments=lambda p: EchoEnv()
        )
