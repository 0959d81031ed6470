"""GPU parity of the schedules (skipped without CUDA): replay and packed vs naive on the accelerator.

Prepared for device checks: `python -m pytest tests/gpu -q` on a CUDA machine.
"""

from __future__ import annotations

import pytest
import torch

from megatron_branch.checkpoint.param_map import hf_to_mcore_state, mcore_to_hf_state
from megatron_branch.checkpoint.tp import gather_full_grads, load_full_state
from megatron_branch.data import PrefixTree
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule
from megatron_branch.testing import random_tree_rollouts, tiny_hf_config, tiny_hf_model


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
def test_replay_and_packed_match_naive_on_cuda(dtype: torch.dtype, tol: float) -> None:
    initialize_parallel(ParallelConfig())
    cfg = tiny_hf_config("qwen2")
    hf = tiny_hf_model(cfg, seed=0, dtype=dtype)
    arch = ModelArch.from_hf_config(cfg)
    model = build_model(arch, dtype=dtype)
    load_full_state(
        model, hf_to_mcore_state(hf.state_dict(), arch, padded_vocab=arch.padded_vocab_size(1)), None
    )
    model.cuda()
    rollouts = random_tree_rollouts(prompt_len=33, branches=3, levels=2, seed=2)
    tree = PrefixTree.build(rollouts, vocab_size=arch.vocab_size)
    objective = PolicyGradientObjective.grpo(
        [r.advantage for r in rollouts], tree.num_response_tokens_logical()
    )
    grads = {}
    for schedule in ("naive", "packed", "replay"):
        model.zero_grad(set_to_none=True)
        run_schedule(
            schedule, model, tree, objective, ScheduleOptions(vocab_size=arch.vocab_size, chunk_tokens=None)
        )
        grads[schedule] = mcore_to_hf_state(gather_full_grads(model, None), arch)
    for schedule in ("packed", "replay"):
        for name, g in grads["naive"].items():
            err = ((grads[schedule][name] - g).norm() / g.norm()).item()
            assert err <= tol, f"{schedule} {name}: {err:.2e}"
