"""Shared by the drop-in tests (unit TP1, distributed TP2): a model from a patched megatron spec, megatron's own
forward_backward schedule with a per-rollout (naive) forward_step_func as the reference, and the drop-in."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from megatron_branch import testing
from megatron_branch.compat.cpu import apply_cpu_shims
from megatron_branch.compat.norm import TorchNorm
from megatron_branch.data import Rollout
from megatron_branch.integration import enable_position_rope, get_forward_backward_func, patch_layer_spec
from megatron_branch.losses.logprobs import vocab_parallel_logprobs
from megatron_branch.models import ModelArch

VOCAB = 37


def tiny_arch() -> ModelArch:
    return testing.tiny_arch("qwen2", vocab_size=VOCAB)


def build_patched_gpt(
    arch: ModelArch, *, tp: int = 1, sp: bool = False, seed: int = 0, pp: int = 1, pp_rank: int = 0
) -> GPTModel:
    """What a user's run builds, after the model-side patch: megatron's local spec, our attention slot, RoPE
    following position ids (norms: the torch norm that supports SP on CPU); under PP the stage's GPTModel
    (pre_process / post_process, its layers' specs, megatron's pipeline config)."""
    apply_cpu_shims()
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    spec = patch_layer_spec(get_gpt_layer_local_spec(normalization="RMSNorm"))
    spec.submodules.input_layernorm = TorchNorm
    spec.submodules.pre_mlp_layernorm = TorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    piped = {"pipeline_model_parallel_size": pp, "pipeline_dtype": torch.float32} if pp > 1 else {}
    if pp > 1:
        from megatron_branch.compat.pipeline import apply_pipeline_shims

        apply_pipeline_shims()
    model = GPTModel(
        config=arch.to_transformer_config(dtype=torch.float32, tp=tp, sequence_parallel=sp, **piped),
        transformer_layer_spec=TransformerBlockSubmodules(
            layer_specs=[spec] * (arch.num_layers // pp), layer_norm=TorchNorm
        ),
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
        vocab_size=arch.padded_vocab_size(tp),
        max_sequence_length=256,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
    )
    return enable_position_rope(model)


def megatron_naive_step(
    model: GPTModel, rollouts: list[Rollout], tp_group: Any = None, seq_length: int = 0
) -> list[dict]:
    """megatron's own schedule, one rollout per micro-batch, the GRPO loss in loss_func: forward_backward_no_
    pipelining, or under PP its 1F1B pipeline (messages of `seq_length` rows, or of each rollout's length with
    `config.variable_seq_lengths`; the loss dicts on the last stage only)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_fb

    T = sum(r.num_trained for r in rollouts)  # a loss_mask's context tokens count nowhere
    n = len(rollouts)

    def forward_step(data_iterator: Any, model: GPTModel) -> tuple[torch.Tensor, Any]:
        (r,) = next(data_iterator)
        seq = torch.tensor(r.prompt + r.response)
        L = seq.numel()
        mask = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)[None, None]
        logits = model(seq[None], torch.arange(L)[None], mask)  # [1, L, v/tp]

        def loss_func(out: torch.Tensor) -> tuple[torch.Tensor, dict]:
            logp = vocab_parallel_logprobs(out[0, : L - 1], seq[1:], vocab_size=VOCAB, tp_group=tp_group)
            w = torch.zeros(L - 1)
            w[max(len(r.prompt) - 1, 0) :] = r.advantage / T
            if r.loss_mask is not None:  # megatron's loss_mask: the context tokens' terms are zeroed
                m = torch.tensor(r.loss_mask, dtype=w.dtype)
                w[max(len(r.prompt) - 1, 0) :] *= m if r.prompt else m[1:]
            loss = -(logp * w).sum()
            # megatron divides a 2-tuple loss by num_microbatches; the GRPO sum over rollouts wants none
            return loss * n, {"lm loss": torch.stack([loss.detach(), torch.ones(())])}

        return logits, loss_func

    return megatron_fb()(
        forward_step_func=forward_step,
        data_iterator=iter([[r] for r in rollouts]),
        model=[model],
        num_microbatches=n,
        seq_length=seq_length,
        micro_batch_size=1,
    )


def dropin_step(
    model: GPTModel, rollouts: list[Rollout], schedule: str = "replay", per_mb: int = 2
) -> list[dict]:
    batches = [rollouts[i : i + per_mb] for i in range(0, len(rollouts), per_mb)]
    fb = get_forward_backward_func(schedule=schedule, vocab_size=VOCAB, branch_micro_batch=2)
    return fb(
        forward_step_func=None,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=0,
        micro_batch_size=per_mb,
    )


def reduce_like_megatron(losses: list[dict]) -> float:
    val = torch.vstack([d["lm loss"].view(-1).double() for d in losses]).sum(dim=0)
    return float(val[0] / val[1])
