"""`megatron-branch train` on a tiny config-defined Nemotron-H (model.arch with hybrid_override_pattern): the
sampler decodes through the Mamba state, replay trains through it, and a resumed run equals the uninterrupted one
exactly; also with a MoE ("E") layer (Nemotron 3: the sigmoid router with its correction bias, a shared expert)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_train_loop import _cfg, task  # noqa: F401  (task: the fixture)
from train_helpers import assert_resumes_exactly, params

from megatron_branch.errors import UserError

NEMOTRON_H = (
    "model.arch={family: nemotron_h, hidden_size: 16, num_layers: 3, num_attention_heads: 2, num_query_groups: 1, "
    "head_dim: 8, ffn_hidden_size: 32, max_position_embeddings: 64, hybrid_override_pattern: 'M*-', "
    "mlp_activation: relu2, position_embedding: none, mamba_num_heads: 2, mamba_head_dim: 8, mamba_state_dim: 4, "
    "mamba_num_groups: 1, mamba_chunk_size: 8, mamba_dt_min: 0.001, rms_norm_eps: 1.0e-5}"
)


NEMOTRON_3 = NEMOTRON_H.replace("'M*-'", "'M*E'").replace(
    "rms_norm_eps: 1.0e-5}",
    "rms_norm_eps: 1.0e-5, num_experts: 4, moe_top_k: 2, moe_ffn_hidden_size: 8, "
    "shared_expert_ffn_hidden_size: 8, moe_score_function: sigmoid, moe_expert_bias: true}",
)
"""The same with its MLP layer a MoE layer: 4 experts, top-2, a shared expert (moe_layer_pattern: the "E")."""


def nemotron_cfg(task: Path, out: Path, *overrides: str, model: str = NEMOTRON_H):  # noqa: ANN201, F811
    return _cfg(task, out, model, "model.dtype=float64", *overrides)


def test_config_defined_nemotron_h_is_checked(task: Path, tmp_path: Path) -> None:  # noqa: F811
    from megatron_branch.train.validate import model_arch

    arch = model_arch(nemotron_cfg(task, tmp_path / "r"), vocab_size=50)
    assert arch.hybrid_override_pattern == "M*-" and arch.position_embedding == "none"
    nemotron_cfg(task, tmp_path / "r", "parallel.cp=2")  # 2 heads, 1 group: one head per CP rank
    with pytest.raises(
        UserError, match=r"parallel.cp=4 cannot split the Mamba-2 heads: .* use parallel.cp in 1, 2$"
    ):
        nemotron_cfg(task, tmp_path / "r", "parallel.cp=4")


def test_nemotron_h_trains_and_resumes_exactly(task: Path, tmp_path: Path) -> None:  # noqa: F811
    assert_resumes_exactly(lambda out, *o: nemotron_cfg(task, out, *o), tmp_path)


def test_nemotron_3_with_moe_layers_trains_and_resumes_exactly(task: Path, tmp_path: Path) -> None:  # noqa: F811
    from megatron_branch.train.validate import model_arch

    arch = model_arch(nemotron_cfg(task, tmp_path / "r", model=NEMOTRON_3), vocab_size=50)
    assert arch.moe_layer_pattern == (0, 0, 1) and arch.moe_score_function == "sigmoid"
    full, _ = assert_resumes_exactly(lambda out, *o: nemotron_cfg(task, out, *o, model=NEMOTRON_3), tmp_path)
    assert any(".mlp.router." in n for n in params(full))
