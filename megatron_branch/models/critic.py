"""PPO's critic: the policy's megatron-core GPT with a scalar value head instead of the vocabulary projection.

    values(hidden [m, h]) -> [m]        one value per row (the row that predicts a token, verl's alignment)

The critic is built from the same `ModelArch` and loads the policy's HF checkpoint like the policy (the unused
vocabulary projection is loaded and frozen); the head is a plain `Linear(h, 1)` replicated over tensor parallel:
its input is the final hidden state gathered whole on every TP rank (schedule/common.py `_to_replicated_region`),
so every TP rank computes the same head gradient and the same input gradient, and nothing is summed over TP.
Under pipeline parallelism the head lives on the last stage only, where megatron puts the output layer
(`post_process`); the value loss runs there and its gradient reaches the earlier stages through the pipeline's
messages (schedule/pipeline.py).
The schedules see `is_critic` and read values where the policy reads logprobs, so the value loss
(losses/value.py) runs through naive, packed and replay alike, exact under sharing.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_branch.models.arch import ModelArch
from megatron_branch.models.gpt import BranchGPTModel, build_model
from megatron_branch.precision import accumulation_dtype


class BranchCriticModel(BranchGPTModel):
    """A BranchGPTModel whose output is `values(hidden)`; forward returns hidden states inside
    `hidden_states_only()` like the policy."""

    is_critic = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.post_process:  # the last pipeline stage (every rank without PP), as megatron's output layer
            self.value_head = torch.nn.Linear(
                self.config.hidden_size, 1, bias=True, dtype=self.config.params_dtype
            )

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """[m, h] final hidden states -> [m] values (the head in the model dtype, the values in fp32 or wider: the
        value loss is computed like the logprobs, precision.py)."""
        v = self.value_head(hidden).squeeze(-1)
        return v.to(accumulation_dtype(v.dtype))


def build_critic(
    arch: ModelArch,
    *,
    dtype: torch.dtype = torch.float32,
    tp: int = 1,
    sequence_parallel: bool = False,
    head_seed: int = 0,
    head_std: float = 0.02,
    **kwargs: Any,
) -> BranchCriticModel:
    """A critic for `arch` on this rank (its pipeline stage with `pp` / `pp_rank` in kwargs); the value head (last
    stage) is drawn from its own generator (`head_seed`), so it is the same on every rank whatever its RNG state."""
    model = build_model(
        arch, dtype=dtype, tp=tp, sequence_parallel=sequence_parallel, model_cls=BranchCriticModel, **kwargs
    )
    assert isinstance(model, BranchCriticModel)
    if not model.post_process:
        return model
    if not model.share_embeddings_and_output_weights:
        model.output_layer.weight.requires_grad_(False)  # the vocabulary projection: loaded, never used
    g = torch.Generator().manual_seed(head_seed)
    with torch.no_grad():
        w = torch.randn(model.value_head.weight.shape, generator=g, dtype=torch.float64) * head_std
        model.value_head.weight.copy_(w.to(dtype))
        model.value_head.bias.zero_()
    return model
