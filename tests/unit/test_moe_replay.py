"""Routing replay (verl's router_replay, slime's --use-routing-replay, R3): the sampler records every fed token's
experts, the training forward routes recorded tokens to them (probabilities from the current router, gradients
through them as megatron's RouterReplay), exactly under sharing.

Shown here: the sampler's records are the experts megatron routes each token to; after the router moves, the
training forward of every schedule uses the records (not its own top-k); its gradient equals Hugging Face's with
the same forced routing (fp64 1e-9) and naive == packed == replay; records are part of a token's identity in the
prefix tree; the JSONL field round-trips and is validated.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_branch.checkpoint import hf_to_mcore_state, load_full_state, mcore_to_hf_state
from megatron_branch.checkpoint.tp import gather_full_grads
from megatron_branch.data import PrefixTree, Rollout, read_rollouts_jsonl, write_rollouts_jsonl
from megatron_branch.errors import UserError
from megatron_branch.generation import BranchSampler, SamplingParams
from megatron_branch.losses import PolicyGradientObjective, router_plan, routing
from megatron_branch.losses.router import MoEOptions, RouterLossConfig
from megatron_branch.losses.routing import RoutingRecorder
from megatron_branch.models import ModelArch, build_model
from megatron_branch.models.moe import attach_router_context
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule
from megatron_branch.testing import (
    exact_hf_norms,
    hf_checkpoint_names,
    hf_state,
    tiny_hf_config,
    tiny_hf_model,
)


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


@pytest.fixture(scope="module")
def sampled() -> tuple:
    """(hf, arch, model, rollouts): a tiny Qwen3-MoE (norm_topk_prob off: megatron's pre-softmax path), rollouts
    sampled with records (2 prompts x 4, a fork after 2 tokens: shared response beginnings), then the router
    weights moved so that its own top-k now differs from the records."""
    hf = exact_hf_norms(tiny_hf_model(tiny_hf_config("qwen3_moe", ffn=48, moe={"norm_topk_prob": False}), seed=4,
                                      dtype=torch.float64))  # fmt: skip
    arch = ModelArch.from_hf_config(hf.config)
    model = build_model(arch, dtype=torch.float64)
    load_full_state(model, hf_to_mcore_state(hf_state(hf), arch, padded_vocab=37), None)
    sampler = BranchSampler(model, vocab_size=37, record_routing=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [[int(x) for x in torch.randint(0, 37, (7,), generator=gen)] for _ in range(2)]
    params = SamplingParams(n=4, max_new_tokens=6, branch_at=(2,), branch_factor=2)
    out = sampler.generate(prompts, params, generator=gen)
    rollouts = [s.to_rollout(advantage=float(torch.randn((), generator=gen))) for g in out.samples for s in g]
    with torch.no_grad():  # the policy moves on after sampling: its own routing is no longer the record's
        for name, p in list(model.named_parameters()) + list(hf.named_parameters()):
            if name.endswith(("router.weight", "mlp.gate.weight")):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(9), dtype=p.dtype))
    return hf, arch, model, rollouts


def test_sampler_records_megatrons_routing(sampled) -> None:
    """Every fed token's record is the top-k megatron routes it to in a plain forward of the sequence (before the
    router moved); the last sampled token, never fed, is -1."""
    hf, arch, _, rollouts = sampled
    model = build_model(arch, dtype=torch.float64)  # the sampling-time weights
    fresh = tiny_hf_model(tiny_hf_config("qwen3_moe", ffn=48, moe={"norm_topk_prob": False}), seed=4,
                          dtype=torch.float64)  # fmt: skip
    load_full_state(model, hf_to_mcore_state(hf_state(fresh), arch, padded_vocab=37), None)
    for r in rollouts:
        rec = r.routed_experts
        assert tuple(rec.shape) == (len(r.sequence), len(arch.moe_layers), arch.moe_top_k)
        assert (rec[-1] == -1).all() and (rec[:-1] >= 0).all()
        seq = torch.tensor(r.sequence)
        mask = torch.triu(torch.ones(len(seq), len(seq), dtype=torch.bool), 1)[None, None]
        recorder = RoutingRecorder()
        with torch.no_grad(), attach_router_context(model, recorder):
            model(seq[None], torch.arange(len(seq))[None], mask)
        got = recorder.experts(arch.moe_layers, arch.moe_top_k)
        assert torch.equal(got[:-1], rec[:-1])


def used_routing(monkeypatch: pytest.MonkeyPatch) -> list:
    """A spy on RowContext.route: (packed row indices, routing_map) of every training-forward router call."""
    calls: list = []
    real = routing.RowContext.route

    def spy(self, router, logits):  # noqa: ANN001, ANN202
        probs, routing_map = real(self, router, logits)
        if torch.is_grad_enabled():
            calls.append((router.layer_number - 1, self.packed.clone(), routing_map.detach().clone()))
        return probs, routing_map

    monkeypatch.setattr(routing.RowContext, "route", spy)
    return calls


@pytest.mark.parametrize("schedule", ["naive", "packed", "replay"])
def test_training_forward_routes_recorded_tokens_to_their_records(sampled, schedule, monkeypatch) -> None:
    _, arch, model, rollouts = sampled
    tree = PrefixTree.build(rollouts, vocab_size=37)
    routes = router_plan._tree_routes(tree, len(arch.moe_layers), arch.moe_top_k)  # [N, Lm, k]
    calls = used_routing(monkeypatch)
    opts = ScheduleOptions(
        vocab_size=37, branch_micro_batch=2, moe=MoEOptions(routing_replay=True), chunk_tokens=None
    )
    obj = PolicyGradientObjective.grpo([r.advantage for r in rollouts], tree.num_response_tokens_logical())
    run_schedule(schedule, model, tree, obj, opts)
    checked = differs = 0
    for layer, packed, routing_map in calls:
        li = arch.moe_layers.index(layer)
        for row, x in enumerate(packed.tolist()):
            if x < 0 or (routes[x, li] < 0).any():
                continue
            want = torch.zeros(arch.num_experts, dtype=torch.bool)
            want[routes[x, li]] = True
            assert torch.equal(routing_map[row], want), (layer, x)
            checked += 1
    assert checked > 0
    # the moved router would have chosen otherwise for some of them (the replay is not a no-op)
    on_calls = list(calls)
    calls.clear()
    run_schedule(
        schedule, model, tree, obj, ScheduleOptions(vocab_size=37, branch_micro_batch=2, chunk_tokens=None)
    )
    for (_, _, on), (_, _, off) in zip(on_calls, calls, strict=True):
        differs += int((on != off).any(dim=-1).sum())
    assert differs > 0


def hf_forced_gradient(hf, rollouts: list[Rollout], arch: ModelArch) -> dict[str, torch.Tensor]:
    """The oracle: HF rollout by rollout, each MoE router forced to the rollout's records (HF's probabilities: the
    softmax over all experts at the recorded ones, renormalised where norm_topk_prob), fresh top-k where none."""
    routers = [m for m in hf.modules() if type(m).__name__.endswith("TopKRouter")]
    hf.zero_grad(set_to_none=True)
    T = sum(len(r.response) for r in rollouts)
    for r in rollouts:
        for li, m in enumerate(routers):

            def route(self, hidden, rec=r.routed_experts[:, li].long()):  # noqa: ANN001, ANN202, B008
                logits = torch.nn.functional.linear(hidden.reshape(-1, self.hidden_dim), self.weight)
                probs = torch.softmax(logits, dim=-1)
                idx = torch.where((rec >= 0).all(-1, keepdim=True), rec, probs.topk(self.top_k).indices)
                top = probs.gather(1, idx)
                if self.norm_topk_prob:
                    top = top / top.sum(-1, keepdim=True)
                return logits, top, idx

            m.forward = route.__get__(m)
        seq = torch.tensor([list(r.sequence)])
        logp = torch.log_softmax(hf(input_ids=seq).logits[0, :-1], -1).gather(1, seq[0, 1:, None])[:, 0]
        (-(r.advantage / T) * logp[len(r.prompt) - 1 :].sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in hf.named_parameters() if p.grad is not None}
    return hf_checkpoint_names(hf, grads)


def test_gradient_with_forced_routing_equals_hf_and_naive(sampled) -> None:
    hf, arch, model, rollouts = sampled
    want = hf_forced_gradient(hf, rollouts, arch)
    tree = PrefixTree.build(rollouts, vocab_size=37)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rollouts], tree.num_response_tokens_logical())
    got = {}
    for schedule in ("naive", "packed", "replay"):
        for replay in (True, False):
            model.zero_grad(set_to_none=True)
            opts = ScheduleOptions(
                vocab_size=37, branch_micro_batch=2, moe=MoEOptions(routing_replay=replay), chunk_tokens=None
            )
            run_schedule(schedule, model, tree, obj, opts)
            got[schedule, replay] = mcore_to_hf_state(gather_full_grads(model, None), arch)
    rel = lambda a, b: ((a - b).norm() / b.norm().clamp_min(1e-30)).item()  # noqa: E731
    for schedule in ("naive", "packed", "replay"):
        assert max(rel(got[schedule, True][n], want[n]) for n in want) <= 1e-9, schedule
    assert max(rel(got["packed", False][n], want[n]) for n in want) > 1e-4  # without replay: other experts


def test_replay_with_router_losses_is_exact_under_sharing(sampled) -> None:
    """Records and multiplicity-weighted losses together (the aux maps stay megatron's fresh top-k)."""
    _, arch, model, rollouts = sampled
    tree = PrefixTree.build(rollouts, vocab_size=37)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rollouts], tree.num_response_tokens_logical())
    losses = RouterLossConfig(aux_loss_coeff=0.2, seq_aux_loss_coeff=0.3, z_loss_coeff=0.05)
    grads = {}
    for schedule in ("naive", "packed", "replay"):
        model.zero_grad(set_to_none=True)
        opts = ScheduleOptions(
            vocab_size=37,
            branch_micro_batch=2,
            moe=MoEOptions(routing_replay=True, losses=losses),
            chunk_tokens=None,
        )
        run_schedule(schedule, model, tree, obj, opts)
        grads[schedule] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for schedule in ("packed", "replay"):
        for n, g in grads["naive"].items():
            assert ((grads[schedule][n] - g).norm() / g.norm().clamp_min(1e-30)) <= 1e-9, (schedule, n)


def test_records_are_part_of_a_tokens_identity_in_the_tree() -> None:
    a = torch.tensor(
        [[[0, 1]], [[2, 3]], [[1, 2]], [[-1, -1]]], dtype=torch.int32
    )  # [4 tokens, 1 layer, k=2]
    b = a.clone()
    b[2, 0] = torch.tensor([0, 3])  # the third token routed elsewhere
    same = [Rollout(prompt=[1, 2], response=[3, 4], advantage=1.0, routed_experts=a) for _ in range(2)]
    diff = [same[0], Rollout(prompt=[1, 2], response=[3, 4], advantage=1.0, routed_experts=b)]
    assert PrefixTree.build(same).positions_computed == 4
    tree = PrefixTree.build(diff)
    assert tree.positions_computed == 6  # shared up to the token whose records differ
    assert [s.tokens for s in tree.segments] == [(1, 2), (3, 4), (3, 4)]


def test_jsonl_round_trip_and_validation(tmp_path: Path) -> None:
    rec = torch.tensor([[[0, 1]], [[2, 3]], [[-1, -1]]], dtype=torch.int32)
    r = Rollout(prompt=[1], response=[3, 4], advantage=1.0, routed_experts=rec)
    write_rollouts_jsonl(tmp_path / "r.jsonl", [r])
    (back,) = read_rollouts_jsonl(tmp_path / "r.jsonl")
    assert torch.equal(back.routed_experts, rec)
    with pytest.raises(UserError, match="routed_experts has 2 entries but prompt \\+ response has 3 tokens"):
        Rollout(prompt=[1], response=[3, 4], routed_experts=rec[:2])
    with pytest.raises(UserError, match="below -1"):
        Rollout(prompt=[1], response=[3, 4], routed_experts=rec - 5)
    tree = PrefixTree.build([Rollout(prompt=[1], response=[3, 4], advantage=1.0)])
    with pytest.raises(UserError, match="routing replay is on but the rollout has no routed_experts"):
        router_plan._tree_routes(tree, 1, 2)
