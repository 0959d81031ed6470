"""GLM-4.5 MoE (`glm4_moe`) in use: the sampler (greedy == HF `generate`), routing replay (R3: the sampler's records,
every schedule's gradient with replay == HF forced to them), `train` (a config-defined tiny GLM policy with R3 and
router losses resumes exactly, the correction biases held fixed), make_tiny_assets' records (the router's own
choice), and the planner (the glm-4.5-air preset against transformers' defaults, a tiny GLM's parameters, FLOPs
and saved bytes against the built model and the meter, the plan at the 2.1M-position target). The family itself,
its gradient and its bounds: tests/unit/test_glm4_moe.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_glm4_moe import FP64_SIGMOID_BOUND, _schedule_grads, _worst, glm_hf, megatron_of

from megatron_branch.generation import BranchSampler, SamplingParams
from megatron_branch.losses.router import MoEOptions
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.plan import MODEL_PRESETS, Layout
from megatron_branch.plan.flops import step_flops
from megatron_branch.plan.measure import measure_step
from megatron_branch.plan.memory import step_peak
from megatron_branch.plan.model import parameter_count
from megatron_branch.testing import hf_checkpoint_names, tiny_hf_config


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


# --- the sampler and routing replay (R3) ----------------------------------------------------------------------------
def _prompts() -> list[list[int]]:
    return [
        [int(x) for x in torch.randint(0, 37, (n,), generator=torch.Generator().manual_seed(n))]
        for n in (9, 4)
    ]


def test_sampler_greedy_equals_hf_generate() -> None:
    hf = glm_hf(seed=3, dtype=torch.float32, exact=False)  # HF's own router, as generate runs it
    _, model = megatron_of(hf, torch.float32)
    check_greedy_equals_generate(hf, model)


def check_greedy_equals_generate(hf, model) -> None:  # noqa: ANN001
    """The sampler's greedy tokens (n=2 per prompt, 6 new) equal HF `generate`'s for both of `_prompts()`."""
    out = BranchSampler(model.eval(), vocab_size=37).generate(
        _prompts(), SamplingParams(n=2, max_new_tokens=6, temperature=0)
    )
    for p, prompt in enumerate(_prompts()):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6)
        for s in out.samples[p]:
            assert list(s.response) == want[0, len(prompt) :].tolist()


def hf_forced_gradient(hf, rollouts) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """The oracle of routing replay: HF rollout by rollout, each router forced to the rollout's records (the
    sigmoid scores at the recorded experts, renormalised, scaled: HF's weights for that choice)."""
    routers = [m for m in hf.modules() if hasattr(m, "e_score_correction_bias")]
    hf.zero_grad(set_to_none=True)
    T = sum(len(r.response) for r in rollouts)
    for r in rollouts:
        for li, m in enumerate(routers):

            def route(self, hidden, rec=r.routed_experts[:, li].long()):  # noqa: ANN001, ANN202, B008
                logits = torch.nn.functional.linear(hidden.reshape(-1, self.hidden_dim), self.weight)
                scores = logits.sigmoid()
                assert (rec >= 0).all(-1)[:-1].all()  # every fed token has a record
                idx = rec.clamp(min=0)  # the last token's (-1) output is not part of the loss
                top = scores.gather(1, idx)
                top = top / (top.sum(-1, keepdim=True) + 1e-20)
                return logits, top * self.routed_scaling_factor, idx

            m.forward = route.__get__(m)
        seq = torch.tensor([list(r.sequence)])
        logp = torch.log_softmax(hf(input_ids=seq).logits[0, :-1], -1).gather(1, seq[0, 1:, None])[:, 0]
        (-(r.advantage / T) * logp[len(r.prompt) - 1 :].sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in hf.named_parameters() if p.grad is not None}
    return hf_checkpoint_names(hf, grads)


def test_routing_replay_uses_the_records_and_equals_hf_forced_routing() -> None:
    """Sample with records (forks after 2 and 4 tokens), move the router (its own choice now differs), then every
    schedule with routing replay equals HF forced to the records; without replay it does not."""
    hf = glm_hf(seed=4)
    arch, model = megatron_of(hf, torch.float64)
    sp = SamplingParams(n=4, max_new_tokens=6, temperature=1.0, branch_at=(2, 4), branch_factor=2)
    gen = torch.Generator().manual_seed(0)
    out = BranchSampler(model, vocab_size=37, record_routing=True).generate(_prompts(), sp, generator=gen)
    rollouts = [s.to_rollout(advantage=float(torch.randn((), generator=gen))) for g in out.samples for s in g]
    assert all(tuple(r.routed_experts.shape[1:]) == (1, 4) for r in rollouts)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(hf.named_parameters()):
            if name.endswith(("router.weight", "mlp.gate.weight")):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(9), dtype=p.dtype))
    want = hf_forced_gradient(hf, rollouts)
    for schedule in ("naive", "packed", "replay"):
        got = _schedule_grads(model, arch, rollouts, schedule, moe=MoEOptions(routing_replay=True))
        assert _worst(got, want)[0] <= FP64_SIGMOID_BOUND, schedule
    assert _worst(_schedule_grads(model, arch, rollouts, "packed"), want)[0] > 1e-4  # without: other experts


# --- train ----------------------------------------------------------------------------------------------------------
GLM_ARCH = (  # a config-defined tiny GLM MoE: the family's router (sigmoid, correction bias) by default
    "model.arch={family: glm4_moe, hidden_size: 16, num_layers: 2, num_attention_heads: 2, num_query_groups: 1, "
    "head_dim: 8, ffn_hidden_size: 32, num_experts: 8, moe_top_k: 4, moe_ffn_hidden_size: 8, "
    "shared_expert_ffn_hidden_size: 8, moe_layer_pattern: [0, 1], moe_num_groups: 2, moe_group_topk: 2, "
    "moe_routed_scaling_factor: 2.0, rotary_percent: 0.5, max_position_embeddings: 64}"
)


def test_train_runs_a_glm_policy_and_resumes_exactly(tmp_path: Path) -> None:
    """Routing replay and router losses on (float64): a resumed run equals the uninterrupted one; replay computes
    fewer positions than naive would."""
    _, _, mfull = train_and_resume(tmp_path, GLM_ARCH)
    assert all(r is not None for m in mfull for r in m["_records"])


def train_and_resume(tmp_path: Path, model_arch: str, *, expert_bias: bool = True) -> tuple[dict, dict, list]:
    """Train the config-defined MoE `model_arch` 2 steps (routing replay R3, router losses) and 1 + 1 resumed: the
    same tokens, losses and parameters (1e-9), fewer positions computed than logical, the correction biases held
    fixed (`expert_bias`: the DeepSeek-style router has them). Returns (the 2-step run's parameters, the 1-step
    run's, the 2-step metrics)."""
    from test_train_moe import LOSSES, _cfg, _max_rel, _run

    from megatron_branch.train.models import unwrap

    def _params(tr) -> dict:  # noqa: ANN001
        return {
            k: v.detach().clone()
            for k, v in unwrap(tr.policy).state_dict().items()
            if isinstance(v, torch.Tensor)
        }

    extra = ("moe.router_replay=R3", *LOSSES)
    full, mfull = _run(_cfg(tmp_path / "full", "trainer.total_training_steps=2", *extra, model=model_arch))
    assert mfull[-1]["positions_computed"] < mfull[-1]["positions_logical"]
    first, m1 = _run(_cfg(tmp_path / "part", "trainer.total_training_steps=1", *extra, model=model_arch))
    first.save()
    again, m2 = _run(
        _cfg(
            tmp_path / "part",
            "trainer.total_training_steps=2",
            "trainer.resume_mode=auto",
            *extra,
            model=model_arch,
        )
    )
    assert again.step == 2 and len(m2) == 1
    for x, y in zip(mfull, m1 + m2, strict=True):
        assert x["_tokens"] == y["_tokens"] and abs(x["loss"] - y["loss"]) <= 1e-9
    assert _max_rel(_params(full), _params(again)) < 1e-9
    p_full, p_first = _params(full), _params(first)
    biases = [k for k in p_full if k.endswith("router.expert_bias")]
    assert bool(biases) == expert_bias and all(
        torch.equal(p_full[k], p_first[k]) for k in biases
    )  # held fixed
    return p_full, p_first, mfull


def test_config_defined_arch_gets_the_familys_router(tmp_path: Path) -> None:
    from test_train_moe import _cfg

    arch = _cfg(tmp_path, model=GLM_ARCH).model.arch.resolve(37)
    assert (arch.moe_score_function, arch.moe_expert_bias, arch.qkv_bias, arch.qk_norm) == (
        "sigmoid",
        True,
        True,
        True,
    )


def test_tiny_assets_record_the_routers_own_choice() -> None:
    """examples/make_tiny_assets.py records what GLM's router picks (bias and group limit), which is what
    megatron's router picks for the same weights (not the top-k of the logits)."""
    import importlib.util

    from megatron_branch.losses.routing import RoutingRecorder
    from megatron_branch.models.moe import attach_router_context

    path = Path(__file__).resolve().parents[2] / "examples" / "make_tiny_assets.py"
    spec = importlib.util.spec_from_file_location("make_tiny_assets", path)
    assert spec and spec.loader
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    hf = glm_hf(seed=5, dtype=torch.float64, exact=False)
    arch, model = megatron_of(hf, torch.float64)
    seq = [int(x) for x in torch.randint(0, 37, (20,), generator=torch.Generator().manual_seed(2))]
    got = torch.tensor(script.routed_experts(hf, seq))  # [tokens, layers, k]
    rec = RoutingRecorder()
    mask = torch.triu(torch.ones(20, 20, dtype=torch.bool), 1)[None, None]
    with torch.no_grad(), attach_router_context(model, rec):
        model(torch.tensor([seq]), torch.arange(20)[None], mask)
    assert torch.equal(got, rec.experts(arch.moe_layers, arch.moe_top_k).long())
    with torch.no_grad():  # the top-k of the logits would have been another choice
        out = hf(input_ids=torch.tensor([seq]), output_router_logits=True)
    naive = out.router_logits[0].topk(4, dim=-1).indices.sort(dim=-1).values
    assert not torch.equal(naive, got[:, 0])


# --- the planner ----------------------------------------------------------------------------------------------------
def test_preset_is_transformers_glm_4_5_air_configuration() -> None:
    """plan's glm-4.5-air preset: transformers' Glm4MoeConfig defaults (its "GLM-4-MOE-100B-A10B style" config)
    with the published head_dim 128 and q/k/v bias; 106.9B parameters, 13.4B passed per token."""
    import transformers

    from megatron_branch.plan.presets import GLM4_5_AIR_CONFIG

    defaults = transformers.Glm4MoeConfig().to_dict()
    ours = {
        k: v for k, v in GLM4_5_AIR_CONFIG.items() if k not in ("architectures", "head_dim", "attention_bias")
    }
    assert {k: defaults[k] for k in ours} == ours
    arch = MODEL_PRESETS["glm-4.5-air"]
    assert (arch.head_dim, arch.qkv_bias, arch.qk_norm, len(arch.moe_layers)) == (128, True, False, 45)
    pc = parameter_count(arch)
    active = pc["total"] - pc["experts"] + pc["active_experts"]
    assert round(pc["total"] / 1e9, 1) == 106.9 and round(active / 1e9, 1) == 13.4


def test_planner_counts_flops_and_bytes_of_a_tiny_glm() -> None:
    """Parameters (the frozen correction biases included) equal the built model's; FLOPs of a replay step exactly
    FlopCounterMode's; saved bytes within test_plan_moe.py's tolerance of the activation meter."""
    from test_plan_moe import SHAPE
    from test_plan_moe import TOL as PLAN_TOL

    arch = ModelArch.from_hf_config(tiny_hf_config("glm4_moe", hidden_size=32, num_layers=3))
    torch.manual_seed(0)
    model = build_model(arch, dtype=torch.float32)
    assert parameter_count(arch)["total"] == sum(p.numel() for p in model.parameters())
    got = measure_step(model, SHAPE, vocab=37, branch_micro_batch=4, count_flops=True)
    fl = step_flops(arch, SHAPE, "replay", Layout(recompute="none"))
    assert fl.dense + fl.logits == pytest.approx(got.matmul_flops, rel=1e-9)
    pk = step_peak(arch, SHAPE, Layout(), act_bytes=4, branch_micro_batch=4, segment_recompute=False,
                   layer_recompute=False)  # fmt: skip
    assert pk.saved == pytest.approx(got.saved_peak, rel=PLAN_TOL), (pk, got)


def test_plan_glm_4_5_air_at_the_target(capsys: pytest.CaptureFixture[str]) -> None:
    """2,097,152 positions (130048 prompt + 16 x 1024: the model's 131072 context) fit 16 x H20."""
    from megatron_branch.cli import main

    argv = ["plan", "--model", "glm-4.5-air", "--prompt-length", "130048", "--responses", "16",
            "--response-length", "1024", "--gpus", "16", "--gpu", "h20", "--json"]  # fmt: skip
    assert main(argv) == 0
    p = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert p["shape"]["positions_logical"] == 2_097_152
    assert (
        p["memory_bytes_per_rank"]["expert_parameters"] > 0 and p["flops"]["naive"] > 3 * p["flops"]["replay"]
    )
