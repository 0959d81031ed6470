"""DeepSeek-V3 (`deepseek_v3`) in use: the sampler (greedy == HF `generate`, decoding through MLA's per-head K/V
cache), `train` (a config-defined tiny DeepSeek-V3 policy with routing replay and router losses resumes exactly,
the correction biases held fixed) and `plan`'s one-line refusal (MLA is not priced yet). make_tiny_assets
--family deepseek_v3 then grad: test_families.py (every family). The family itself, its gradient and its bounds:
tests/unit/test_deepseek_v3.py; glm4_moe's use tests (test_glm4_moe_use.py) are the pattern, their helpers shared.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_deepseek_v3 import ds_hf, megatron_of
from test_glm4_moe_use import check_greedy_equals_generate, train_and_resume

from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "q_proj"])
def test_sampler_greedy_equals_hf_generate(q_lora: bool) -> None:
    # HF's own router and norms, as generate runs them
    hf = ds_hf(seed=3, dtype=torch.float32, q_lora=q_lora, exact=False)
    _, model = megatron_of(hf, torch.float32)
    check_greedy_equals_generate(hf, model)


DS_ARCH = (  # a config-defined tiny DeepSeek-V3: MLA widths all distinct, the family's router by default
    "model.arch={family: deepseek_v3, hidden_size: 16, num_layers: 2, num_attention_heads: 2, "
    "num_query_groups: 2, head_dim: 8, kv_lora_rank: 12, q_lora_rank: 10, qk_rope_head_dim: 4, v_head_dim: 6, "
    "ffn_hidden_size: 32, num_experts: 8, moe_top_k: 4, moe_ffn_hidden_size: 8, shared_expert_ffn_hidden_size: 8, "
    "moe_layer_pattern: [0, 1], moe_num_groups: 2, moe_group_topk: 2, moe_routed_scaling_factor: 2.0, "
    "max_position_embeddings: 64}"
)


def test_train_runs_a_deepseek_policy_and_resumes_exactly(tmp_path: Path) -> None:
    """Routing replay and router losses on (float64): a resumed run equals the uninterrupted one, the correction
    biases held fixed (glm4_moe's check, shared); MLA's latent up-projection trains."""
    full, first, _ = train_and_resume(tmp_path, DS_ARCH)
    kv_up = "decoder.layers.0.self_attention.linear_kv_up_proj.weight"
    assert not torch.equal(full[kv_up], first[kv_up])


def test_plan_prices_deepseek_v3s_own_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """DeepSeek-V3's own config (transformers' DeepseekV3Config defaults, its published shape; rope scaling and the
    MTP layer not priced) is planned (plan/mla.py), its prefix cache the compressed latent, a term of its own."""
    import json

    import transformers

    from megatron_branch.cli import main

    cfg = transformers.DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"]).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    argv = ["plan", "--model", str(tmp_path / "config.json"), "--prompt-length", "1024", "--responses", "4",
            "--response-length", "256", "--prompts", "8", "--gpus", "8", "--gpu", "h100", "--tp", "1", "--cp", "1", "--dp", "8",
            "--ep", "8", "--recompute", "full", "--chunk-tokens", "0", "--json"]  # fmt: skip
    # --chunk-tokens 0: the walk, the root cached (with replay's default chunks this 2,048-token group would run as
    # one packed chunk, nothing cached)
    assert main(argv) in (0, 1)  # 1: 671B parameters do not fit on one node
    mem = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["memory_bytes_per_rank"]
    assert mem["cached_latent"] == 61 * 1024 * (512 + 64) * 2 and mem["cached_kv"] == 0
