"""`convert hf-to-mcore`, `convert mcore-to-hf` and `verify-conversion` subcommands of `megatron-branch`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from megatron_branch.models.families import supported_architectures
from megatron_branch.outputs import add_overwrite_argument

SUPPORTED = (
    f"Supported: {', '.join(supported_architectures())} (the registered families: RMSNorm, SwiGLU, RoPE without "
    "scaling), GQA/MQA, tied or untied embeddings, any vocabulary size (padded to a multiple of TP). Refused: "
    "other architectures, rope scaling (llama3, yarn, ...), sliding window, MLP or o_proj bias, a TP that does "
    "not divide the heads, and pipeline parallel conversion."
)


def add_convert_commands(subparsers: Any) -> None:
    conv = subparsers.add_parser("convert", help="convert checkpoints between Hugging Face and megatron-core")
    csub = conv.add_subparsers(dest="convert_direction", required=True)

    h2m = csub.add_parser(
        "hf-to-mcore",
        help="Hugging Face folder -> megatron-core distributed checkpoint",
        description="Write a megatron-core dist checkpoint (loads under any TP) from a local HF folder. "
        "Run under torchrun with N processes for --tp N. " + SUPPORTED,
    )
    h2m.add_argument("--hf", required=True, help="local HF model folder (config.json + safetensors)")
    h2m.add_argument(
        "--out", required=True, help="output folder (absent or empty; its parent must exist; see --overwrite)"
    )
    h2m.add_argument("--tp", type=int, default=1, help="tensor-parallel size to build with (default 1)")
    h2m.add_argument("--pp", type=int, default=1, help="pipeline-parallel size; only 1 is supported")
    h2m.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size to build a MoE model with (default 1)"
    )
    h2m.add_argument(
        "--etp",
        type=int,
        default=None,
        help="expert tensor-parallel size: 1 (every expert whole on each TP rank; gpt-oss at --tp > 1) or the TP "
        "size (default)",
    )
    h2m.add_argument(
        "--dtype", default=None, help="float32, bfloat16 or float16 (default: the HF storage dtype)"
    )
    add_overwrite_argument(h2m)
    h2m.set_defaults(func=run)

    m2h = csub.add_parser(
        "mcore-to-hf",
        help="megatron-core distributed checkpoint -> Hugging Face folder",
        description="Write config.json + sharded safetensors (+ index) from a checkpoint made by hf-to-mcore or "
        "by training, saved at any TP. " + SUPPORTED,
    )
    m2h.add_argument("--mcore", required=True, help="megatron checkpoint folder (with megatron_branch.json)")
    m2h.add_argument(
        "--out", required=True, help="output folder (absent or empty; its parent must exist; see --overwrite)"
    )
    m2h.add_argument("--tokenizer", default=None, help="folder whose tokenizer files are copied")
    m2h.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB)")
    add_overwrite_argument(m2h)
    m2h.set_defaults(func=run)

    ver = subparsers.add_parser(
        "verify-conversion",
        help="compare logits of a HF model and its megatron conversion",
        description="Runs transformers (fp32, eager) and the megatron model on a few deterministic random "
        "sequences; prints max |logit diff|, KL and argmax agreement as JSON; exits 1 past --tol. The HF "
        "weights are rounded to the checkpoint's dtype for the reference, so the default --tol holds for "
        "bf16/fp16 checkpoints too (the rounding's own effect is reported as rounding_max_abs_diff). "
        + SUPPORTED,
    )
    ver.add_argument("--hf", required=True, help="local HF model folder")
    ver.add_argument("--mcore", required=True, help="megatron checkpoint folder")
    ver.add_argument(
        "--tol", type=float, default=None, help="max allowed |logit difference| (default 1e-4, any dtype)"
    )
    ver.set_defaults(func=run)


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"  # torchrun's; a single process is rank 0


def _say(text: str) -> None:
    """Under torchrun (convert --tp 2) every rank converts its part; the result is said once, by rank 0."""
    if _is_rank0():
        print(text, flush=True)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "convert_direction", None) == "hf-to-mcore":
        from megatron_branch.checkpoint.hf_to_mcore import convert_hf_to_mcore

        out = convert_hf_to_mcore(
            args.hf,
            args.out,
            tp=args.tp,
            pp=args.pp,
            ep=args.ep,
            etp=args.etp,
            dtype=args.dtype,
            overwrite=args.overwrite,
        )
        _say(f"wrote {out}")
        return 0
    if getattr(args, "convert_direction", None) == "mcore-to-hf":
        from megatron_branch.checkpoint.mcore_to_hf import convert_mcore_to_hf

        out = convert_mcore_to_hf(
            args.mcore,
            args.out,
            tokenizer_dir=args.tokenizer,
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
        )
        _say(f"wrote {out}")
        return 0
    from megatron_branch.checkpoint.verify import verify_conversion

    report = verify_conversion(args.hf, args.mcore, tol=args.tol)
    _say(json.dumps(report, indent=2))
    if not report["ok"] and _is_rank0():
        print(
            f"megatron-branch: verify-conversion: max |logit diff| {report['max_abs_diff']:.3g} exceeds "
            f"--tol {report['tol']:.3g}",
            file=sys.stderr,
        )
    return 0 if report["ok"] else 1
