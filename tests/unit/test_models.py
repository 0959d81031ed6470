"""Architecture mapping (HF config -> ModelArch -> TransformerConfig) and its refusals; explicit-position RoPE."""

from __future__ import annotations

import pytest
import torch

from megatron_branch.errors import UserError
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.testing import tiny_hf_config


def test_llama_and_qwen2_mapping() -> None:
    a = ModelArch.from_hf_config(tiny_hf_config("llama", tie=True, rope_theta=500000.0))
    assert (a.family, a.num_query_groups, a.qkv_bias, a.tie_word_embeddings, a.rope_theta) == (
        "llama",
        2,
        False,
        True,
        500000.0,
    )
    q = ModelArch.from_hf_config(tiny_hf_config("qwen2"))
    assert q.family == "qwen2" and q.qkv_bias and q.head_dim == 8
    assert ModelArch.from_hf_config(q.to_hf_config()) == q  # the mapping round-trips
    cfg = q.to_transformer_config(tp=2)
    assert (
        cfg.num_query_groups == 2
        and cfg.add_qkv_bias
        and cfg.gated_linear_unit
        and cfg.normalization == "RMSNorm"
    )


@pytest.mark.parametrize(
    "change,word",
    [
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "rope scaling"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope scaling"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"architectures": ["MistralForCausalLM"]}, "unsupported architecture"),
    ],
)
def test_refusals_are_one_line(change: dict, word: str) -> None:
    d = tiny_hf_config("llama").to_dict()
    d.update(change)
    with pytest.raises(UserError, match=word) as e:
        ModelArch.from_hf_config(d)
    assert "\n" not in str(e.value) and "config.json" in str(e.value)


def test_tensor_parallel_checks() -> None:
    a = ModelArch.from_hf_config(tiny_hf_config("llama"))
    a.check_tensor_parallel(4)  # 4 heads, 2 kv groups (replicated), ffn 64
    for tp, word in [(3, "num_attention_heads"), (0, "positive")]:
        with pytest.raises(UserError, match=word):
            a.check_tensor_parallel(tp)
    assert a.padded_vocab_size(4) == 40 and a.padded_vocab_size(1) == 37


def test_rope_follows_explicit_position_ids() -> None:
    """A branch continues from its parent's end: the same tokens at positions p.. give the logits that the full
    sequence gives there, when the branch also sees the prefix. Without prefix, shifting positions changes them."""
    initialize_parallel(ParallelConfig())
    arch = ModelArch.from_hf_config(tiny_hf_config("llama"))
    torch.manual_seed(0)
    model = build_model(arch, dtype=torch.float64)
    ids = torch.randint(0, 37, (1, 10))
    mask = lambda s: torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]  # noqa: E731
    a = model(ids[:, 4:], torch.arange(4, 10)[None], mask(6))
    b = model(ids[:, 4:], torch.arange(0, 6)[None], mask(6))
    # RoPE is relative: a plain causal pass over the same tokens is shift-invariant ...
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # ... so check the positions actually reach the rotary table: a gap inside the sequence changes the result.
    pos_gap = torch.tensor([[4, 5, 6, 20, 21, 22]])
    c = model(ids[:, 4:], pos_gap, mask(6))
    assert (c[0, 3:] - a[0, 3:]).abs().max() > 1e-6
    torch.testing.assert_close(c[0, :3], a[0, :3], rtol=1e-10, atol=1e-10)
