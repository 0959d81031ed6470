"""Compare a converted megatron checkpoint with its Hugging Face source by logits (transformers as reference)."""

from __future__ import annotations

import os
from typing import Any

import torch

from megatron_branch.checkpoint.hf_io import load_hf_config
from megatron_branch.errors import UserError


def megatron_logits(
    model: torch.nn.Module, ids: torch.Tensor, vocab_size: int, tp_group: Any = None
) -> torch.Tensor:
    """Full-vocabulary logits [s, vocab] of a single sequence (vocab-parallel shards gathered, padding cut)."""
    import torch.distributed as dist

    n = ids.shape[0]
    tp = dist.get_world_size(group=tp_group) if tp_group is not None and dist.is_initialized() else 1
    if getattr(getattr(model, "config", None), "sequence_parallel", False) and n % tp:
        # Sequence parallel splits tokens over TP: pad on the right (causal: earlier logits are unaffected).
        ids = torch.cat([ids, ids.new_zeros(tp - n % tp)])
    s = ids.shape[0]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        out = model(ids[None], torch.arange(s)[None], mask)[0]
    if tp_group is not None and dist.is_initialized() and dist.get_world_size(group=tp_group) > 1:
        parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group=tp_group))]
        dist.all_gather(parts, out.contiguous(), group=tp_group)
        out = torch.cat(parts, dim=-1)
    return out[:n, :vocab_size].float()


def verify_conversion(
    hf_dir: str | os.PathLike,
    mcore_dir: str | os.PathLike,
    *,
    tol: float = 1e-4,
    num_sequences: int = 3,
    seq_len: int = 16,
    seed: int = 0,
) -> dict[str, Any]:
    """Logits of transformers (fp32, eager attention) vs the megatron model loaded from `mcore_dir` (fp32).

    Returns {"max_abs_diff", "max_kl", "argmax_agreement", "tol", "ok", "sequences"}.
    """
    from transformers import AutoModelForCausalLM

    from megatron_branch.checkpoint.mcore_to_hf import load_mcore_checkpoint
    from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel

    cfg = load_hf_config(hf_dir)
    try:
        hf = AutoModelForCausalLM.from_pretrained(
            str(hf_dir), local_files_only=True, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    except OSError as e:
        raise UserError(
            f"transformers cannot load the model ({str(e).splitlines()[0]})", where=str(hf_dir)
        ) from None
    groups = initialize_parallel(ParallelConfig(tp=1))
    model, arch, _ = load_mcore_checkpoint(mcore_dir, tp_group=groups.tp, tp=1, dtype=torch.float32)
    model.eval()
    if arch.vocab_size != cfg.vocab_size:
        raise UserError(f"vocab_size differs: HF {cfg.vocab_size}, megatron checkpoint {arch.vocab_size}")
    gen = torch.Generator().manual_seed(seed)
    max_abs, max_kl, agree, total = 0.0, 0.0, 0, 0
    for _ in range(num_sequences):
        ids = torch.randint(0, arch.vocab_size, (seq_len,), generator=gen)
        with torch.no_grad():
            ref = hf(ids[None]).logits[0].float()
        got = megatron_logits(model, ids, arch.vocab_size, groups.tp)
        max_abs = max(max_abs, (ref - got).abs().max().item())
        lp, lq = ref.double().log_softmax(-1), got.double().log_softmax(-1)
        max_kl = max(max_kl, (lp.exp() * (lp - lq)).sum(-1).max().item())
        agree += (ref.argmax(-1) == got.argmax(-1)).sum().item()
        total += seq_len
    return {
        "max_abs_diff": max_abs,
        "max_kl": max_kl,
        "argmax_agreement": agree / total,
        "tol": tol,
        "ok": max_abs <= tol,
        "sequences": num_sequences,
    }
