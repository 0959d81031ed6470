"""`megatron-branch train` on a tiny config-defined hybrid (model.arch with layer_types): the sampler decodes
through the GDN state, replay trains through it, and a resumed run equals the uninterrupted one exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_train_loop import _cfg, task  # noqa: F401  (task: the fixture)
from train_helpers import assert_resumes_exactly, max_rel, params

from megatron_branch.errors import UserError

HYBRID = (
    "model.arch={family: qwen3_5, hidden_size: 16, num_layers: 2, num_attention_heads: 2, num_query_groups: 1, "
    "head_dim: 8, ffn_hidden_size: 32, max_position_embeddings: 64, rotary_percent: 0.5, "
    "layer_types: [linear_attention, full_attention], linear_key_head_dim: 4, linear_value_head_dim: 4, "
    "linear_num_key_heads: 1, linear_num_value_heads: 2}"
)


def hybrid_cfg(task: Path, out: Path, *overrides: str):  # noqa: ANN201, F811
    return _cfg(task, out, HYBRID, "model.dtype=float64", *overrides)


def test_config_defined_hybrid_defaults_to_its_family(task: Path, tmp_path: Path) -> None:  # noqa: F811
    from megatron_branch.train.validate import model_arch

    arch = model_arch(hybrid_cfg(task, tmp_path / "r"), vocab_size=50)
    assert arch.is_hybrid and arch.num_linear_layers == 1
    assert arch.qk_norm and arch.zero_centered_norm and arch.attention_output_gate
    hybrid_cfg(task, tmp_path / "r", "parallel.cp=2")  # 1 key / 2 value GDN heads: CP2 runs (head exchange)
    with pytest.raises(UserError, match=r"parallel.cp=4 cannot split the hybrid's gated delta net heads"):
        hybrid_cfg(task, tmp_path / "r", "parallel.cp=4")


@pytest.mark.slow
def test_hybrid_trains_and_resumes_exactly(task: Path, tmp_path: Path) -> None:  # noqa: F811
    full, _ = assert_resumes_exactly(lambda out, *o: hybrid_cfg(task, out, *o), tmp_path)
    from megatron_branch.train.loop import Trainer

    init = params(Trainer(hybrid_cfg(task, tmp_path / "init", "trainer.total_training_steps=1")))
    assert max_rel(init, params(full)) > 1e-6  # the policy moved: not a trivially equal pair of runs
