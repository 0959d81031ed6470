"""Compare a converted megatron checkpoint with its Hugging Face source by logits (transformers as reference).

The HF side is read with the project's safetensors reader (never transformers' loader, which may unpickle
`.bin` files) and checked as `convert` checks it; the checkpoint side is checked as every load checks it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from megatron_branch.checkpoint.hf_io import HFTensorReader, hf_experts_kwargs, load_hf_config
from megatron_branch.errors import UserError
from megatron_branch.models.arch import ModelArch
from megatron_branch.models.families import get_family
from megatron_branch.models.families.param_rules import IGNORED_HF_SUFFIXES

DEFAULT_TOL = 1e-4


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


def check_same_model(hf_arch: ModelArch, ck_arch: ModelArch, *, hf_dir: str, mcore_dir: str) -> None:
    """Refuse an HF folder and a megatron checkpoint that describe different models, naming what differs."""
    if hf_arch.family != ck_arch.family:
        raise UserError(
            f"architecture mismatch: the HF folder {hf_dir!r} is {hf_arch.family} "
            f"({get_family(hf_arch.family).export_class}), the megatron checkpoint {mcore_dir!r} is "
            f"{ck_arch.family} ({get_family(ck_arch.family).export_class})"
        )
    a, b = hf_arch.to_dict(), ck_arch.to_dict()
    diff = [k for k in a if a[k] != b.get(k)]
    if diff:
        more = f" (and {len(diff) - 1} more field(s))" if len(diff) > 1 else ""
        raise UserError(
            f"the HF folder and the megatron checkpoint describe different models: {diff[0]} is {a[diff[0]]!r} "
            f"in {hf_dir!r} but {b[diff[0]]!r} in {mcore_dir!r}{more}"
        )


def _hf_reference(cfg: Any, weights: dict[str, torch.Tensor], *, where: str) -> torch.nn.Module:
    """transformers' model (fp32, eager attention) built from the config, weights from OUR safetensors reader:
    transformers' own loader is not used on the user's folder, so no pickled `.bin` is ever opened and the checks
    are ours. A MoE model's experts are fused into 3-D tensors in memory (checkpoint names: one per expert): its
    weights go through transformers' own loading conversion, from a safetensors file written here."""
    from transformers import AutoModelForCausalLM

    kw = dict(dtype=torch.float32, attn_implementation="eager", **hf_experts_kwargs(cfg))
    if hf_experts_kwargs(cfg):
        import tempfile

        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(prefix="verify-hf-") as tmp:
            cfg.save_pretrained(tmp)
            save_file({n: t.contiguous() for n, t in weights.items()}, f"{tmp}/model.safetensors")
            return AutoModelForCausalLM.from_pretrained(tmp, use_safetensors=True, **kw).eval()
    torch.manual_seed(
        0
    )  # every weight is overwritten below; the seed only makes the (unused) init repeatable
    model = AutoModelForCausalLM.from_config(cfg, **kw)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if getattr(cfg, "tie_word_embeddings", False) else set()
    missing = [n for n in missing if n not in tied and not n.endswith(IGNORED_HF_SUFFIXES)]
    assert not missing and not unexpected, (where, missing[:3], unexpected[:3])  # names were checked before
    return model.eval()


def verify_conversion(
    hf_dir: str | os.PathLike,
    mcore_dir: str | os.PathLike,
    *,
    tol: float | None = None,
    num_sequences: int = 3,
    seq_len: int = 16,
    seed: int = 0,
) -> dict[str, Any]:
    """Logits of transformers (fp32, eager attention) vs the megatron model loaded from `mcore_dir` (fp32).

    First the same checks as `convert` and `grad`: the HF config is a supported architecture, its safetensors
    hold every tensor with the shape the config implies, the checkpoint's files are complete and safe, and both
    describe the same model (a family or size mismatch is named). The reference uses the HF weights ROUNDED to
    the checkpoint's dtype (a bf16 checkpoint is compared with the bf16-rounded HF model), so the comparison
    tests the conversion, not the rounding, and the default `tol` (1e-4) holds for every dtype; the rounding's
    own effect is reported as `rounding_max_abs_diff`.
    Returns {"max_abs_diff", "max_kl", "argmax_agreement", "tol", "ok", "sequences", "checkpoint_dtype", ...}.
    """
    from megatron_branch.checkpoint.fused_experts import fuse_stream, split_views
    from megatron_branch.checkpoint.hf_to_mcore import parse_dtype
    from megatron_branch.checkpoint.mcore_to_hf import load_mcore_checkpoint, read_meta
    from megatron_branch.checkpoint.param_map import check_hf_names, hf_shapes, iter_hf_to_mcore
    from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel

    tol = DEFAULT_TOL if tol is None else tol
    if not tol > 0:
        raise UserError(f"--tol must be a positive number, got {tol}")
    cfg = load_hf_config(hf_dir)
    hf_arch = ModelArch.from_hf_config(cfg, where=os.path.join(hf_dir, "config.json"))
    reader = HFTensorReader(hf_dir)
    meta = read_meta(mcore_dir)
    check_same_model(hf_arch, meta["arch_obj"], hf_dir=str(hf_dir), mcore_dir=str(mcore_dir))
    # the converter's own checks: every tensor present, none unexpected, each of the shape the config implies
    for _ in iter_hf_to_mcore(
        reader.keys(), reader.get, hf_arch, padded_vocab=hf_arch.vocab_size, where=str(hf_dir)
    ):
        pass
    ck_dtype = parse_dtype(meta.get("dtype", "float32"))
    groups = initialize_parallel(ParallelConfig(tp=1))
    model, arch, _ = load_mcore_checkpoint(mcore_dir, tp_group=groups.tp, tp=1, dtype=torch.float32)
    model.eval()

    # gpt-oss's fused experts: per expert for the map, fused again for HF's model (checkpoint/fused_experts.py)
    names, get = split_views(reader.keys(), reader.get, hf_arch.num_experts, where=str(hf_dir))
    stored = check_hf_names(names, hf_arch, where=str(hf_dir))  # canonical -> stored (HF containers)
    original = dict(fuse_stream((n, get(stored[n]).float()) for n in hf_shapes(hf_arch)))
    rounded = {n: t.to(ck_dtype).float() for n, t in original.items()}
    changed = any(not torch.equal(original[n], rounded[n]) for n in original)
    hf = _hf_reference(cfg, rounded, where=str(hf_dir))
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, arch.vocab_size, (seq_len,), generator=gen) for _ in range(num_sequences)]
    max_abs, max_kl, agree, total = 0.0, 0.0, 0, 0
    got_all = []
    for ids in seqs:
        with torch.no_grad():
            ref = hf(ids[None]).logits[0].float()
        got = megatron_logits(model, ids, arch.vocab_size, groups.tp)
        got_all.append(got)
        max_abs = max(max_abs, (ref - got).abs().max().item())
        lp, lq = ref.double().log_softmax(-1), got.double().log_softmax(-1)
        max_kl = max(max_kl, (lp.exp() * (lp - lq)).sum(-1).max().item())
        agree += (ref.argmax(-1) == got.argmax(-1)).sum().item()
        total += seq_len
    report = {
        "max_abs_diff": max_abs,
        "max_kl": max_kl,
        "argmax_agreement": agree / total,
        "tol": tol,
        "ok": max_abs <= tol,
        "sequences": num_sequences,
        "checkpoint_dtype": meta.get("dtype", "float32"),
    }
    if changed:  # what the rounding to the checkpoint's dtype itself changes (information, not a failure)
        hf = _hf_reference(cfg, original, where=str(hf_dir))
        with torch.no_grad():
            report["rounding_max_abs_diff"] = max(
                (hf(ids[None]).logits[0].float() - got).abs().max().item()
                for ids, got in zip(seqs, got_all, strict=True)
            )
    return report
