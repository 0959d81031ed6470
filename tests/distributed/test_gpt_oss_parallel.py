"""gpt-oss (gpt_oss: a sliding-window layer and a full one, learned sinks, biases, the router's bias, the clamped GLU)
under tensor, context and expert parallelism (the grad and convert commands, in-process on every rank).

    python tests/distributed/launch.py 2 -k gpt_oss     # CP2 (the ring cuts each step's plan by the window,
                                                         # the sink merged once after the last step), EP2, CP2xEP2,
                                                         # TP2+SP with expert TP 1 (--etp 1)

The gradient against Hugging Face's eager gpt_oss per rollout, per parameter: float64 at 1e-9 (replay), float32 at
1e-5 (packed). TP2 runs with every expert whole on each TP rank (megatron-core allows MoE biases only at expert
tensor parallel size 1): each rank routes its sequence shard, the expert gradients summed over megatron's
expert-data-parallel group (both TP ranks) exactly once (models/expert_tp.py); planted bugs: that sum left out, or
the expert bias summed again over TP. Conversion: HF -> dist checkpoint at EP2 and at TP2/ETP1 -> HF, bit-exact
(fused interleaved experts, sinks); TP2 with experts split over TP is refused in one line. The sampler at TP2+SP/ETP1
gives one rank's tokens and logprobs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_helpers import shared_tmp
from test_glm4_moe_parallel import _grad

from megatron_branch.cli import main
from megatron_branch.data import write_rollouts_jsonl

TOL = {"float64": 1e-9, "float32": 1e-5}
LAYOUTS = {
    "cp2": ["--cp", "2"],
    "ep2": ["--ep", "2"],  # EP across the two DP replicas: lockstep
    "cp2ep2": ["--cp", "2", "--ep", "2"],  # EP over the CP ranks
    "tp2etp1": ["--tp", "2", "--sequence-parallel", "--etp", "1"],  # whole experts on each TP rank
}


@pytest.fixture(scope="module")
def oss_setup() -> tuple[Path, dict[str, torch.Tensor]]:
    """(folder with hf/ and r.jsonl, the float64 HF oracle's gradient) on every rank."""
    from transformers import AutoModelForCausalLM

    from megatron_branch.testing import (
        exact_hf_norms,
        hf_experts_kwargs,
        hf_policy_gradient,
        random_tree_rollouts,
        tiny_hf_config,
        tiny_hf_model,
    )

    d = shared_tmp("gpt_oss_parallel_")
    # windows of 4 that cross into some branches' ancestors and stop short of others (tests/unit/test_gpt_oss.py)
    rollouts = random_tree_rollouts(groups=2, prompt_len=6, branches=3, levels=3, seg_len=(1, 6), seed=1)
    cfg = tiny_hf_config("gpt_oss")
    if dist.get_rank() == 0:
        tiny_hf_model(cfg, seed=4).save_pretrained(d / "hf")
        write_rollouts_jsonl(d / "r.jsonl", rollouts)
    dist.barrier()
    hf = AutoModelForCausalLM.from_pretrained(d / "hf", attn_implementation="eager", **hf_experts_kwargs(cfg))
    _, grads = hf_policy_gradient(exact_hf_norms(hf.to(torch.float64)), rollouts)
    return d, grads


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert set(got) == set(want), set(got) ^ set(want)
    return max(
        (((got[n].double() - w.double()).norm() / w.double().norm().clamp(min=1e-30)).item(), n)
        for n, w in want.items()
    )


@pytest.mark.world(2)
def test_gpt_oss_grad_matches_hf_under_every_layout(oss_setup) -> None:
    d, ref = oss_setup
    for name, layout in LAYOUTS.items():
        for schedule, dtype in (("replay", "float64"), ("packed", "float32")):
            grads = _grad(d, f"oss_{name}_{schedule}_{dtype}", schedule, "--dtype", dtype, *layout)
            err = _worst(grads, ref)
            assert err[0] <= TOL[dtype], (name, schedule, dtype, err)


def _whole_experts_bug(kind: str):  # noqa: ANN202
    """models/expert_tp.mark_whole_experts with one of its marks undone (a planted bug)."""
    from megatron_branch.models import expert_tp

    right = expert_tp.mark_whole_experts

    def planted(model: torch.nn.Module) -> None:
        right(model)
        for n, p in model.named_parameters():
            if "local_experts" not in n:
                continue
            if kind == "not summed over expert DP":
                p.allreduce = True  # megatron's EP1 default: DDP sums it over dp x cp only, not over TP
            elif n.endswith("linear_fc2.bias"):
                p.sequence_parallel = True  # megatron's RowParallelLinear default: summed over TP once more

    return planted


@pytest.mark.world(2)
@pytest.mark.parametrize("kind", ["not summed over expert DP", "summed again over TP"])
def test_gpt_oss_tp2_expert_grad_planted_bugs_fail(oss_setup, monkeypatch, kind: str) -> None:
    from megatron_branch.models import expert_tp

    d, ref = oss_setup
    monkeypatch.setattr(expert_tp, "mark_whole_experts", _whole_experts_bug(kind))
    grads = _grad(d, "oss_tp2_bug", "packed", "--dtype", "float32", *LAYOUTS["tp2etp1"])
    err, name = _worst(grads, ref)
    assert err > 1e-2 and "experts" in name, (kind, err, name)


@pytest.mark.world(2)
@pytest.mark.parametrize("layout", [["--ep", "2"], ["--tp", "2", "--etp", "1"]], ids=["ep2", "tp2etp1"])
def test_gpt_oss_conversion_round_trips_bit_exact(oss_setup, layout: list[str]) -> None:
    from megatron_branch.checkpoint.hf_io import HFTensorReader

    d, _ = oss_setup
    src = HFTensorReader(d / "hf")
    tag = "_".join(layout).replace("-", "")
    mc, back = d / f"oss_mc{tag}", d / f"oss_hf{tag}"
    assert main(["convert", "hf-to-mcore", "--hf", str(d / "hf"), "--out", str(mc), *layout]) == 0
    assert main(["convert", "mcore-to-hf", "--mcore", str(mc), "--out", str(back)]) == 0  # loads at TP2, ETP1
    dist.barrier()
    dst = HFTensorReader(back)
    assert sorted(src.keys()) == sorted(dst.keys())
    assert all(torch.equal(src.get(k), dst.get(k)) for k in src.keys())


@pytest.mark.world(2)
def test_gpt_oss_experts_split_over_tp_are_refused(oss_setup, capsys) -> None:
    d, _ = oss_setup
    capsys.readouterr()
    assert (
        main(["convert", "hf-to-mcore", "--hf", str(d / "hf"), "--out", str(d / "oss_tp2"), "--tp", "2"]) == 2
    )
    err = capsys.readouterr().err  # printed once, by rank 0
    assert ("expert tensor parallel size 1" in err) == (dist.get_rank() == 0) and not (d / "oss_tp2").exists()
    assert "\n" not in err.strip()


@pytest.mark.world(2)
def test_gpt_oss_sampler_at_tp2_etp1_equals_one_rank(oss_setup) -> None:
    """Greedy and tree sampling (window and sinks in every decode row) at TP2+SP with whole experts on each TP rank:
    the same tokens as one rank, logprobs at 1e-10 (float64; one rank == HF generate: tests/unit/test_gpt_oss.py)."""
    from transformers import AutoModelForCausalLM

    from megatron_branch.checkpoint.param_map import hf_to_mcore_state
    from megatron_branch.checkpoint.tp import load_full_state
    from megatron_branch.generation import BranchSampler, SamplingParams
    from megatron_branch.models import ModelArch, build_model
    from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
    from megatron_branch.testing import hf_experts_kwargs, tiny_hf_config

    d, _ = oss_setup
    hf = AutoModelForCausalLM.from_pretrained(
        d / "hf", dtype=torch.float64, **hf_experts_kwargs(tiny_hf_config("gpt_oss"))
    )
    arch = ModelArch.from_hf_config(hf.config)
    params = [
        SamplingParams(n=2, max_new_tokens=6, temperature=0),
        SamplingParams(n=4, max_new_tokens=6, temperature=1.0, branch_at=(2,)),
    ]
    prompts = [[5, 9, 2, 7, 1, 3, 8, 4, 6], [11, 2, 5, 9]]  # 13 tokens: SP pads
    outs = []
    for pcfg in (ParallelConfig(), ParallelConfig(tp=2, etp=1, sequence_parallel=True)):
        groups = initialize_parallel(pcfg)
        model = build_model(
            arch, dtype=torch.float64, tp=groups.tp_size, sequence_parallel=groups.sequence_parallel,
            etp=groups.etp_size,
        )  # fmt: skip
        load_full_state(
            model,
            hf_to_mcore_state(hf.state_dict(), arch, padded_vocab=arch.padded_vocab_size(pcfg.tp)),
            groups.tp,
        )
        sampler = BranchSampler(model.eval(), vocab_size=arch.vocab_size, groups=groups)
        outs.append(
            [sampler.generate(prompts, p, generator=torch.Generator().manual_seed(5)).flat() for p in params]
        )
    for got, want in zip(*outs):
        assert [s.response for s in got] == [s.response for s in want]
        for a, b in zip(got, want):
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-10, atol=1e-10
            )
