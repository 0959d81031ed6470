"""The compact prefix cache (issue 19, item 1): a cached prefix row costs exactly 2 g d e bytes per layer (its K and
V, in storages of their own), its dK/dV accumulators too, and nothing else is kept alive by them; the activation
meter and the planner's `cached_kv` term agree. A planted view into the fused QKV buffer is caught."""

from __future__ import annotations

import pytest
import torch

from megatron_branch.attention import context as context_mod
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.plan import Layout, RolloutShape
from megatron_branch.plan.activations import Dims, layer_kv_bytes
from megatron_branch.plan.measure import measure_step
from megatron_branch.schedule import prefix_cache
from megatron_branch.testing import tiny_qwen2

VOCAB = 53
SHAPE = RolloutShape(prompt_length=64, responses=8, response_length=8)


@pytest.fixture(scope="module")
def model() -> tuple:
    initialize_parallel(ParallelConfig())
    return tiny_qwen2(32, 2, torch.float32, vocab_size=VOCAB)


def _per_row_layer(arch, got) -> float:  # noqa: ANN001
    return got.cached_kv / (arch.num_layers * SHAPE.root_length)


@pytest.mark.parametrize("recompute", [False, True], ids=["keep-graph", "recompute"])
def test_cached_row_costs_exactly_2gde(model: tuple, recompute: bool) -> None:
    arch, m = model
    got = measure_step(m, SHAPE, vocab=VOCAB, branch_micro_batch=4, recompute=recompute)
    g, d = arch.num_query_groups, arch.head_dim
    assert _per_row_layer(arch, got) == 2 * g * d * 4  # K and V, fp32, nothing else
    assert got.cached_kv == arch.num_layers * layer_kv_bytes(Dims.of(arch, Layout(), 4), SHAPE.root_length)


def test_planted_view_into_the_qkv_buffer_is_caught(model: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the copy V views the fused QKV output: every cached row keeps its queries and keys alive."""
    arch, m = model
    monkeypatch.setattr(context_mod, "compact", lambda t: t)
    got = measure_step(m, SHAPE, vocab=VOCAB, branch_micro_batch=4, recompute=True)
    n, g, d = arch.num_attention_heads, arch.num_query_groups, arch.head_dim
    assert _per_row_layer(arch, got) == (g + n + 2 * g) * d * 4  # K + the whole QKV buffer
    assert _per_row_layer(arch, got) != 2 * g * d * 4


def test_dkdv_accumulators_have_storages_of_their_own(model: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cached leaves' .grad (what the children accumulate) hold exactly their rows: no larger buffer."""
    arch, m = model
    seen: list[torch.Tensor] = []
    real = prefix_cache.PrefixCache.injection

    def spy(self, seg_id, captured):  # noqa: ANN001, ANN202
        outputs, grads = real(self, seg_id, captured)
        seen.extend(grads)
        return outputs, grads

    monkeypatch.setattr(prefix_cache.PrefixCache, "injection", spy)
    measure_step(m, SHAPE, vocab=VOCAB, branch_micro_batch=4)
    assert len(seen) == 2 * arch.num_layers  # dK and dV of the root, per layer
    for grad in seen:
        assert grad.shape[0] == SHAPE.root_length
        assert grad.untyped_storage().nbytes() == grad.numel() * grad.element_size()
