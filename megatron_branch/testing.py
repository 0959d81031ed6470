"""Helpers for tests, examples and the demo: tiny random models, rollout sets with sharing, and the HF oracle.

Nothing here downloads anything: models are built from configs with random weights, data is generated. No module
of the package imports this one (test-only code stays out of what a run loads; tests/unit/test_families.py checks
it): what production code needs too lives there and is re-exported here: the tiny HF configs (the family specs',
models/families/), the tiny megatron models (models/tiny.py), `random_tree_rollouts` (data/random_trees.py) and
`hf_experts_kwargs` (checkpoint/hf_io.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_branch.checkpoint.hf_io import hf_experts_kwargs
from megatron_branch.data import Rollout
from megatron_branch.data.random_trees import random_tree_rollouts
from megatron_branch.models.families import tiny_hf_config
from megatron_branch.models.tiny import tiny_arch, tiny_branch_model

__all__ = [
    "exact_hf_norms",
    "hf_experts_kwargs",
    "hf_policy_gradient",
    "random_tree_rollouts",
    "rollout_set_strategy",
    "tiny_arch",
    "tiny_branch_model",
    "tiny_hf_config",
    "tiny_hf_model",
    "tiny_qwen2",
]


def hf_checkpoint_names(model: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` by the model's in-memory names (a state dict, or its gradients) under the names its checkpoint
    files use: transformers fuses a MoE layer's experts into 3-D tensors in memory (`experts.gate_up_proj`) and
    writes one tensor per expert; its own reverse conversion (what save_pretrained runs) maps between the two."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, dict(tensors)))


def hf_state(model: Any) -> dict[str, torch.Tensor]:
    """The model's weights under its checkpoint names (what save_pretrained writes)."""
    return hf_checkpoint_names(model, model.state_dict())


def exact_hf_routers(model: Any) -> Any:
    """transformers' MoE routers compute their softmax in float32 whatever the model's dtype; make them compute in
    the logits' dtype so that the float64 oracle is float64 throughout (the routing math is otherwise HF's:
    softmax over all experts, top-k, renormalised where the router does)."""

    def route(self: Any, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = hidden.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden, self.weight)
        top, idx = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        if getattr(self, "norm_topk_prob", True):  # Mixtral's router has no flag: it always renormalises
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top, idx

    for m in model.modules():
        if type(m).__name__.endswith("TopKRouter"):
            m.forward = route.__get__(m)
        elif type(m).__name__.endswith("TopkRouter") and hasattr(m, "e_score_correction_bias"):
            m.forward = _sigmoid_route.__get__(m)
    return model


def _sigmoid_route(self: Any, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' DeepSeek-style router (Glm4MoeTopkRouter, DeepseekV3TopkRouter: sigmoid scores, the
    correction bias in the choice only, group-limited top-k by each group's top-2, renormalised, scaled), line
    for line, in the hidden states' dtype instead of float32."""
    hidden = hidden.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(hidden, self.weight.to(hidden.dtype))
    scores = logits.sigmoid()
    choice = scores + self.e_score_correction_bias.to(scores.dtype)
    per_group = self.num_experts // self.num_group
    group_scores = choice.view(-1, self.num_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, self.num_group, per_group).reshape(-1, self.num_experts)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, idx)
    if self.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * self.routed_scaling_factor, idx


def tiny_hf_model(config: Any, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """Random-weight HF causal LM (weights scaled up a little so that attention is far from uniform). A gated
    delta net's decay rates A = exp(A_log) are drawn in [0.05, 1] (HF's init draws up to 16, which forgets the
    state within a token or two): the recurrent state then carries over many tokens."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    # gpt_oss has no sdpa path in transformers (its sinks): its eager attention, the reference anyway
    attn = "eager" if getattr(config, "model_type", None) == "gpt_oss" else "sdpa"
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=attn, dtype=torch.float32, **hf_experts_kwargs(config)
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.05, 1.0).log())
            elif "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif "bias" in name:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.mul_(4.0)  # init std 0.02 -> 0.08: non-trivial attention patterns on a tiny model
    return model.to(dtype)


ZERO_CENTERED_HF_NORMS = ("Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm", "Qwen3NextRMSNorm")
"""transformers' RMSNorms whose weight is an offset from one: x / rms(x) * (1 + w)."""


def exact_hf_norms(model: Any) -> Any:
    """HF's RMSNorms compute in float32 even for float64 inputs; make them compute in the input dtype so that the
    float64 oracle is float64 throughout (the only change to HF's math): the plain ones (w * x / rms(x)), the
    zero-centred ones (Qwen3.5: (1 + w) * x / rms(x)) and Qwen3.5's gated output norm (w * x / rms(x) * silu(z))."""

    def plain(self: Any, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))

    def zero_centered(self: Any, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return (1.0 + self.weight) * (x * torch.rsqrt(var + self.eps))

    def gated(self: Any, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.variance_epsilon)) * torch.nn.functional.silu(gate)

    for m in model.modules():
        name = type(m).__name__
        if name in ZERO_CENTERED_HF_NORMS:
            m.forward = zero_centered.__get__(m)
        elif name.endswith("RMSNormGated") and name != "NemotronHRMSNormGated":  # its gate is before the norm
            m.forward = gated.__get__(m)
        elif name.endswith("RMSNorm"):
            m.forward = plain.__get__(m)
    return model


def hf_policy_gradient(model: Any, rollouts: Sequence[Rollout]) -> tuple[float, dict[str, torch.Tensor]]:
    """The oracle: L = -(1/T) sum_i sum_{t in response_i} m_{i,t} A_i logp(i,t) computed rollout by rollout in HF
    (m the rollout's loss_mask, all ones when absent; T the trained tokens).

    Returns (loss, grads by HF parameter name). Gradients accumulate from zero.
    """
    model.zero_grad(set_to_none=True)
    T = sum(r.num_trained for r in rollouts)
    total = 0.0
    for r in rollouts:
        seq = torch.tensor([list(r.prompt) + list(r.response)])
        logits = model(input_ids=seq).logits[0]  # [L, V]
        logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, seq[0, 1:, None]).squeeze(1)  # [L-1]
        mask = torch.tensor(r.loss_mask or [1] * len(r.response), dtype=logp.dtype)
        # empty prompt: the first response token has no predictor
        resp = logp[len(r.prompt) - 1 :] if r.prompt else logp
        loss = -(r.advantage / T) * (resp * (mask if r.prompt else mask[1:])).sum()
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if getattr(model.config, "num_experts", None) or getattr(model.config, "num_local_experts", None):
        grads = hf_checkpoint_names(model, grads)  # one gradient per expert, as the checkpoint names them
    return total, grads


def tiny_qwen2(
    hidden: int, layers: int, dtype: torch.dtype = torch.float32, *, vocab_size: int = 37, seed: int = 0
) -> tuple[Any, Any]:
    """(arch, model): a tiny megatron-core Qwen2 (4 heads / 2 kv, QKV bias, ffn 2 x hidden) with seeded random
    weights, built on the current parallel state; the planner's and the layer-checkpointing tests' model."""
    from megatron_branch.models import build_model

    torch.manual_seed(seed)
    arch = tiny_arch("qwen2", hidden=hidden, layers=layers, vocab_size=vocab_size)
    return arch, build_model(arch, dtype=dtype)


def rollout_set_strategy(vocab: int = 6) -> Any:
    """A hypothesis strategy for rollout sets that share on purpose (needs hypothesis, a test dependency)."""
    from hypothesis import strategies as st

    @st.composite
    def strategy(draw: Any) -> list[Rollout]:
        return _rollout_sets(draw, vocab)

    return strategy()


def _rollout_sets(draw: Any, vocab: int = 6) -> list[Rollout]:
    """Rollouts that share on purpose: root-to-node paths of a random forest of token chunks.

    Picking an inner node gives a strict prefix of another rollout, picking a node twice gives duplicates,
    a parent of -1 starts another root, and the small vocabulary adds accidental sharing between siblings.
    """
    from hypothesis import strategies as st

    num_nodes = draw(st.integers(1, 12))
    paths: list[tuple[int, ...]] = []
    for k in range(num_nodes):
        parent = draw(st.integers(-1, k - 1))
        chunk = tuple(draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=4)))
        paths.append((paths[parent] if parent >= 0 else ()) + chunk)
    picks = draw(st.lists(st.integers(0, num_nodes - 1), min_size=1, max_size=10))
    rollouts = []
    for k in picks:
        seq = paths[k]
        cut = draw(st.integers(0, len(seq) - 1))  # the response is never empty
        advantage = draw(st.floats(-2.0, 2.0, allow_nan=False))
        fields = (
            {"old_logprobs": tuple(float(-j) for j in range(len(seq) - cut))} if draw(st.booleans()) else {}
        )
        rollouts.append(
            Rollout(prompt=seq[:cut], response=seq[cut:], advantage=advantage, token_fields=fields)
        )
    return rollouts
