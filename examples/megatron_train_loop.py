"""A multi-step megatron-core GRPO training loop, in the style of megatron-core's own simple training loop.

Model from a layer spec, megatron DDP, an optimizer with megatron's learning-rate scheduler, megatron's
`get_forward_backward_func()` over micro-batches of one rollout each, run under torchrun:

    torchrun --nproc_per_node 2 examples/megatron_train_loop.py --config CONFIG.json --rollouts R.jsonl \
        --tp 2 --steps 3 --out OUT_DIR

Every rank writes its parameter shards to OUT_DIR/rank{R}.safetensors after the last step. `main(argv)` is the
whole run; inside an already-initialised process group (a test) it uses that group instead of starting one.
patches/megatron_train_loop.patch turns this into branch replay; tests/unit/test_train_loop_patch.py (TP1) and
tests/distributed/test_train_loop_patch_tp.py (TP2) run both and compare the parameters after three optimizer
steps.

The optimizer: on a GPU megatron's own (`get_megatron_optimizer`). On CPU megatron-core 0.16.1's optimizer
hard-codes CUDA, so there the loop uses torch's Adam over the same parameters (reading DDP's main_grad) with
megatron's OptimizerParamScheduler; the gradients, the schedule and the update rule are the same.

The loss is GRPO's -(1/T) sum_i A_i sum_{t in response_i} logp(i, t) over the whole step (T its response
tokens); megatron divides a loss_func's 2-tuple loss by num_microbatches, so loss_func returns it times that.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from functools import partial
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection
from safetensors.torch import save_file

from megatron_branch.data import Rollout, read_rollouts_jsonl
from megatron_branch.models import ModelArch
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel

warnings.filterwarnings("ignore")


def model_provider(arch: ModelArch, tp: int) -> GPTModel:
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(
        config=arch.to_transformer_config(dtype=torch.float32, tp=tp),
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
    )


def forward_step_func(data_iterator: Any, model: GPTModel, *, T: int, n: int) -> tuple[torch.Tensor, Any]:
    (r,) = next(data_iterator)  # one rollout per micro-batch
    seq = torch.tensor(r.prompt + r.response, device=_device())
    L = seq.numel()
    mask = torch.triu(torch.ones(L, L, dtype=torch.bool, device=seq.device), diagonal=1)[None, None]
    logits = model(seq[None], torch.arange(L, device=seq.device)[None], mask)  # [1, L, v/tp]

    def loss_func(out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        nll = tensor_parallel.vocab_parallel_cross_entropy(out[0, : L - 1].float(), seq[1:])  # [L-1] = -logp
        w = torch.zeros(L - 1, device=seq.device)
        w[max(len(r.prompt) - 1, 0) :] = (
            r.advantage / T
        )  # response tokens (an empty prompt: the first has none)
        loss = (nll * w).sum()
        return loss * n, {"lm loss": torch.stack([loss.detach(), torch.ones((), device=seq.device)])}

    return logits, loss_func


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def build_optimizer(model: DistributedDataParallel, lr: float) -> Any:
    if torch.cuda.is_available():
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        return get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0), [model])
    return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=0.0)


def optimizer_step(optimizer: Any, model: DistributedDataParallel) -> None:
    if isinstance(optimizer, torch.optim.Optimizer):  # CPU: torch's Adam reads .grad; DDP keeps main_grad
        for p in model.parameters():
            p.grad = p.main_grad
        optimizer.step()
    else:
        optimizer.step()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--config", required=True, help="an HF config.json (the architecture; weights are random)"
    )
    ap.add_argument("--rollouts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)

    # torch.distributed (unless already initialised: then that process group is used) + parallel_state
    initialize_parallel(ParallelConfig(tp=args.tp), seed=args.seed)
    with open(args.config) as f:
        arch = ModelArch.from_hf_config(json.load(f), where=args.config)
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    model = model_provider(arch, args.tp).to(_device())
    config = model.config
    model = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True),
        model,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = build_optimizer(model, args.lr)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.lr / 10,
        lr_warmup_steps=1,
        lr_decay_steps=args.steps,
        lr_decay_style="cosine",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=args.steps,
        wd_incr_style="constant",
    )

    rollouts: list[Rollout] = read_rollouts_jsonl(args.rollouts, vocab_size=arch.vocab_size)
    T = sum(len(r.response) for r in rollouts)
    forward_backward_func = get_forward_backward_func()
    for step in range(args.steps):
        optimizer.zero_grad()
        model.zero_grad_buffer()
        losses = forward_backward_func(
            forward_step_func=partial(forward_step_func, T=T, n=len(rollouts)),
            data_iterator=iter([[r] for r in rollouts]),
            model=[model],
            num_microbatches=len(rollouts),
            seq_length=max(len(r.prompt) + len(r.response) for r in rollouts),
            micro_batch_size=1,
            forward_only=False,
        )
        optimizer_step(optimizer, model)
        scheduler.step(increment=1)
        val = torch.vstack([d["lm loss"].view(-1).double() for d in losses]).sum(dim=0)
        if parallel_state.get_tensor_model_parallel_rank() == 0:
            print(f"step {step} loss {float(val[0]):.10f}", flush=True)

    os.makedirs(args.out, exist_ok=True)
    rank = torch.distributed.get_rank()
    shards = {n: p.detach().cpu().contiguous() for n, p in model.module.named_parameters()}
    save_file(shards, os.path.join(args.out, f"rank{rank}.safetensors"))


if __name__ == "__main__":
    main()
