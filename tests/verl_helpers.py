"""verl's TrainingWorker on CPU, with and without the branch-replay switch, on GRPO-shaped batches.

Used by tests/unit/test_verl_engine.py (one process) and tests/distributed/test_verl_engine_parallel.py (DP2, TP2).
The entry is the one verl's trainer calls through Ray: `TrainingWorker.infer_batch` (compute_log_prob) and
`TrainingWorker.train_mini_batch` (update_actor), on the no-padding TensorDict `left_right_2_no_padding` makes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

VOCAB = 64


def write_tiny_policy(out: Path, *, family: str = "qwen2", **shape: Any) -> str:
    """A tiny random HF policy and a word-level tokenizer (verl's model config loads both); returns the path.
    `shape`: tiny_hf_config's size overrides (hidden_size, num_layers, ...; the bench's larger model)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from megatron_branch.testing import tiny_hf_config, tiny_hf_model

    if not (out / "config.json").exists():
        tiny_hf_model(tiny_hf_config(family, vocab_size=VOCAB, **shape), seed=0).save_pretrained(out)
        tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
        PreTrainedTokenizerFast(
            tokenizer_object=tok, pad_token="t0", eos_token="t1", bos_token="t2"
        ).save_pretrained(out)
    return str(out)


def shared_policy_dir(**shape: Any) -> str:
    """Under torchrun: rank 0 writes the tiny policy (transformers' save_pretrained writes on the main process
    only) into a fresh folder, every rank gets its path. `shape`: write_tiny_policy's (family, num_layers, tie, ...)."""
    import tempfile

    import torch.distributed as dist

    box = [tempfile.mkdtemp(prefix="verl-policy-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if dist.get_rank() == 0:
        write_tiny_policy(Path(box[0]) / "hf", **shape)
    dist.barrier()
    return str(Path(box[0]) / "hf")


def grpo_batch(
    *,
    seed: int = 0,
    groups: int = 2,
    n: int = 4,
    prompt_len: int = 12,
    response_len: int = 8,
    shared: int = 3,
    temperature: float = 1.0,
    multi_turn: bool = False,
    critic: bool = False,
    routes: tuple[int, int, int] | None = None,
) -> Any:
    """`groups` prompts x `n` rollouts (consecutive, as verl's `repeat(interleave=True)`), prompts of different
    lengths left-padded, responses of different lengths right-padded; the first half of each group shares its
    first `shared` response tokens. Advantages per token, old logprobs near the policy's. verl's no-padding form.

    `critic`: with PPO's critic fields (`values`, `returns`).
    `multi_turn`: verl's multi-turn shape, a tool's output inside each response (response_mask 0 on a span that
    starts at a different token per rollout, so rollouts sharing a token disagree on whether it is trained; the
    last rollout is all tool output, response_mask 0 throughout).

    `routes` (MoE layers, k, experts): verl's `routed_experts` for router replay R3, as a rollout engine records
    them: one record per token, equal within a group where the rollouts share the tokens, except that rollout 1 of
    each group disagrees with the others at prompt position 2 (a shared prompt token routed differently: the tree
    must split there)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    P, R = prompt_len, response_len
    prompts, responses, pmask, rmask, tmask = [], [], [], [], []
    for gi in range(groups):
        plen = P - (gi % 3) * 2
        prompt = torch.randint(3, VOCAB, (plen,), generator=g)
        start = torch.randint(3, VOCAB, (shared,), generator=g)
        for j in range(n):
            rlen = R - (j % 3)
            resp = torch.randint(3, VOCAB, (rlen,), generator=g)
            if j < n // 2:
                resp[:shared] = start
            prompts.append(torch.cat([torch.zeros(P - plen, dtype=torch.long), prompt]))
            pmask.append(torch.cat([torch.zeros(P - plen), torch.ones(plen)]))
            responses.append(torch.cat([resp, torch.zeros(R - rlen, dtype=torch.long)]))
            rmask.append(torch.cat([torch.ones(rlen), torch.zeros(R - rlen)]))
            tmask.append(rmask[-1].clone())  # response_mask: the attention mask's response part, less tools
            if multi_turn:
                start = 1 + (j + gi) % 3
                tmask[-1][start : start + 3] = 0  # the tool's tokens: context, not trained
                if gi == groups - 1 and j == n - 1:
                    tmask[-1][:] = 0
    prompts_t, responses_t = torch.stack(prompts), torch.stack(responses)
    extra = {}
    if routes is not None:
        extra["routed_experts"] = _r3_records(g, groups, n, P, R, shared, routes)
    mask = torch.cat([torch.stack(pmask), torch.stack(rmask)], 1).long()
    B = prompts_t.shape[0]
    td = TensorDict(
        {
            "prompts": prompts_t,
            "responses": responses_t,
            "input_ids": torch.cat([prompts_t, responses_t], 1),
            "attention_mask": mask,
            "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
            "response_mask": torch.stack(tmask).long(),
            "advantages": torch.randn(B, R, generator=g),
            "old_log_probs": -4.0 + 0.2 * torch.randn(B, R, generator=g),
            "ref_log_prob": -4.0 + 0.2 * torch.randn(B, R, generator=g),
            **extra,
        },
        batch_size=[B],
    )
    if critic:  # PPO's critic: the values at sampling time and the returns (verl's value_loss reads both)
        td["values"] = 0.05 * torch.randn(B, R, generator=g)
        td["returns"] = 0.3 * torch.randn(B, R, generator=g)
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=temperature)  # the rollout's sampling temperature (verl's meta_info)
    return td


def _r3_records(
    g: torch.Generator, groups: int, n: int, P: int, R: int, shared: int, routes: tuple[int, int, int]
) -> torch.Tensor:
    """[B, P + R, layers, k] distinct experts per row (grpo_batch's layout: prompts left-padded to P)."""
    layers, k, experts = routes

    def rows(count: int) -> torch.Tensor:
        return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(count * layers)]).view(
            count, layers, k
        )

    out = []
    for _ in range(groups):
        prompt, start = rows(P), rows(shared)
        for j in range(n):
            rec = torch.cat([prompt.clone(), rows(R)])
            if j < n // 2:
                rec[P : P + shared] = start
            if j == 1:
                rec[P - 3] = (
                    rec[P - 3] + 1
                ) % experts  # differs from the group's record at this prompt token
            out.append(rec)
    return torch.stack(out)


def dp_share(td: Any, dp_rank: int, dp_size: int) -> Any:
    """What verl's dispatch hands DP rank `dp_rank`: the `dp_rank`-th contiguous chunk of the batch."""
    from verl.utils import tensordict_utils as tu

    return tu.chunk_tensordict(td, dp_size)[dp_rank]


@dataclass
class StepOut:
    engine: str
    log_probs: (
        torch.Tensor | None
    )  # [B, R] compute_log_prob's, verl's padded response layout (None: not collected)
    entropy: torch.Tensor | None  # [B, R]
    metrics: dict[str, Any]  # train_mini_batch's metrics
    # this rank's main_grad per parameter before the LAST optimizer step: under DP > 1 verl divides as_update's
    # mini_batch_size (this rank's share) by DP, so each rank takes DP steps and the last gradient follows updates
    grads: dict[str, torch.Tensor]
    routes: Any = None  # router replay R2: compute_log_prob's routed_experts (jagged [B, j, MoE layers, k])
    steps: int = 0  # the optimizer steps the update took on this rank (DP of them under DP > 1)
    # main_grad before the FIRST optimizer step (no update before it: the same under any optimizer)
    first_grads: dict[str, torch.Tensor] = field(default_factory=dict)


def make_worker(
    hf_dir: str,
    *,
    tp: int = 1,
    cp: int = 1,
    ep: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    dynamic_bsz: bool = False,
    forward_only: bool = False,
    override_transformer_config: dict[str, Any] | None = None,
    router_replay: str = "disabled",
    value: bool = False,
    optimizer: str = "adam",
) -> Any:
    """verl's TrainingWorker for a Megatron language model (float32 on CPU), built through verl's EngineRegistry.
    `cp`: verl's context_parallel_size; `ep`: verl's expert_model_parallel_size; `pp` / `vpp`: verl's
    pipeline_model_parallel_size / virtual_pipeline_model_parallel_size; `override_transformer_config`:
    verl's (e.g. the MoE load balancing, calculate_per_token_loss); `router_replay`: verl's router_replay.mode
    (disabled, R2, R3); `value`: verl's value model (PPO's critic); `optimizer`: megatron's, as verl's
    `actor.optim.optimizer` names it (adam, sgd)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import (
        HFModelConfig,
        McoreEngineConfig,
        McoreOptimizerConfig,
        TrainingWorkerConfig,
    )
    from verl.workers.config.engine import EngineRouterReplayConfig
    from verl.workers.engine_workers import TrainingWorker

    from megatron_branch.integration.verl_cpu import register_cpu_engine, use_cpu_platform

    use_cpu_platform()
    register_cpu_engine()
    model_type = "value_model" if value else "language_model"
    engine = McoreEngineConfig(
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        override_transformer_config=dict(override_transformer_config or {}),
        router_replay=EngineRouterReplayConfig(mode=router_replay),
        use_distributed_optimizer=False,  # megatron's distributed optimizer needs CUDA
        use_dynamic_bsz=dynamic_bsz,
        micro_batch_size_per_gpu=4,
        infer_micro_batch_size_per_gpu=4,
        max_token_len_per_gpu=96,
        infer_max_token_len_per_gpu=96,
        use_dist_checkpointing=True,  # the checkpoint manager needs a bridge otherwise (none on CPU)
        dist_checkpointing_path=os.devnull,
        seed=7,
        forward_only=forward_only,  # the reference policy's engine
    )
    object.__setattr__(engine, "dtype", "fp32")  # verl's config allows bf16/fp16 only; the CPU test runs fp32
    config = TrainingWorkerConfig(
        model_type=model_type,
        model_config=HFModelConfig(
            path=hf_dir, override_config={"attn_implementation": "sdpa"}, model_type=model_type
        ),
        engine_config=engine,
        optimizer_config=McoreOptimizerConfig(lr=1e-3, total_training_steps=10, optimizer=optimizer),
        checkpoint_config=CheckpointConfig(),
    )
    worker = TrainingWorker(config)
    worker.reset()
    return worker


def critic_config(**overrides: Any) -> Any:
    from verl.workers.config import CriticConfig

    kw = dict(
        strategy="megatron",
        ppo_mini_batch_size=8,
        ppo_micro_batch_size_per_gpu=4,
        rollout_n=4,
        cliprange_value=0.05,
    )
    kw.update(overrides)
    return CriticConfig(**kw)


def actor_config(**overrides: Any) -> Any:
    from verl.workers.config import ActorConfig

    kw = dict(
        strategy="megatron",
        ppo_mini_batch_size=8,
        ppo_micro_batch_size_per_gpu=4,
        use_dynamic_bsz=False,
        rollout_n=4,
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.05,
        kl_loss_type="low_var_kl",
        clip_ratio_c=3.0,
    )
    kw.update(overrides)
    return ActorConfig(**kw)


def infer(worker: Any, td: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """compute_log_prob / compute_ref_log_prob through the worker: (log_probs, entropy) [B, R]."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False)
    out = worker.infer_batch(td)
    return no_padding_2_padding(tu.get(out, "log_probs"), td), no_padding_2_padding(
        tu.get(out, "entropy"), td
    )


def run_step(
    worker: Any,
    td_fn: Any,
    *,
    actor: Any = None,
    r2: bool = False,
    critic: Any = None,
    adam_later_step: bool = False,
) -> StepOut:
    """compute_log_prob then one update_actor mini-batch through the worker, as verl's trainer calls them. `r2`:
    router replay R2, compute_log_prob's routed_experts carried into the update's batch (ray_trainer.py). With
    `critic` (a CriticConfig, a value-model worker): compute_values then update_critic (StepOut.log_probs holds the
    values, entropy None).

    An update of several optimizer steps (DP > 1) under Adam fails unless `adam_later_step`: its later steps'
    gradients follow Adam's first step, which divides each gradient element by |g| + 1e-8 and so turns fp32 noise on
    an element near 1e-8 into parameter differences of ~1e-5 (docs/verl.md "Multi-latent attention"): a comparison
    of them at fp32 1e-5 passes or fails by luck. Such tests step with make_worker(optimizer="sgd")."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss, value_loss
    from verl.workers.utils.padding import no_padding_2_padding

    value = critic is not None
    if value:
        worker.set_loss_fn(partial(value_loss, config=critic))
    else:
        worker.set_loss_fn(partial(ppo_loss, config=actor or actor_config()))
    engine = worker.engine
    grads: dict[str, torch.Tensor] = {}
    step = engine.optimizer_step

    first: dict[str, torch.Tensor] = {}
    steps = 0

    def snapshot_then_step() -> Any:  # the gradient megatron's optimizer is about to apply
        nonlocal steps
        steps += 1
        grads.update(
            {
                n: p.main_grad.detach().clone()
                for n, p in engine.module[0].named_parameters()
                if p.requires_grad
            }
        )
        if steps == 1:
            first.update(grads)
        return step()

    engine.optimizer_step = snapshot_then_step
    td = td_fn()
    tu.assign_non_tensor(td, calculate_entropy=not value, compute_loss=False)
    inferred = worker.infer_batch(td)  # None on ranks that do not collect outputs (tp rank > 0)
    lp = ent = None
    if inferred is not None:
        lp = no_padding_2_padding(tu.get(inferred, "values" if value else "log_probs"), td)
        ent = None if value else no_padding_2_padding(tu.get(inferred, "entropy"), td)
    routes = tu.get(inferred, "routed_experts") if r2 and inferred is not None else None
    if r2:
        routes = _to_model_parallel_group(routes)
    td = td_fn()
    if routes is not None:
        td["routed_experts"] = routes
    out = worker.train_mini_batch(as_update(td))
    metrics = tu.get(out, "metrics") if out is not None else {}
    optimizer = engine.optimizer_config.optimizer
    assert steps <= 1 or optimizer == "sgd" or adam_later_step, (
        f"{steps} optimizer steps under {optimizer}: the last step's gradient follows Adam's first step (its "
        "eps turns fp32 noise into parameter differences); step with make_worker(optimizer='sgd')"
    )
    return StepOut(type(engine).__name__, lp, ent, metrics, grads, routes, steps=steps, first_grads=first)


def _to_model_parallel_group(routes: Any) -> Any:
    """The collecting rank's (the last stage's tp rank 0) jagged routes, on every rank of its model-parallel group
    (TP x PP): verl's trainer dispatches the batch, routes included, to every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_model_parallel_group()
    if group.size() == 1:
        return routes
    every: list[Any] = [None] * group.size()
    dist.all_gather_object(
        every, None if routes is None else [t.clone() for t in routes.unbind()], group=group
    )
    (rows,) = [r for r in every if r is not None]  # one collecting rank per model-parallel group
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def as_update(td: Any) -> Any:
    """`td` marked as verl's trainer marks update_actor's batch: one mini-batch of the whole batch."""
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(
        td,
        calculate_entropy=True,
        global_batch_size=len(td),
        mini_batch_size=len(td),
        epochs=1,
        seed=1,
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
    )
    return td


def set_switch(on: bool, options: Any = None) -> None:
    """The user's switch (importing megatron_branch.integration.verl_enable registers the engine), or off;
    `options` (BranchOptions): registered as a module named by `external_lib` would (docs/verl.md). Without
    `options` the tests pin `replay` (the switch's default, auto, picks packed for these tiny models on a CPU;
    test_verl_auto.py tests auto, and a test that wants packed names it)."""
    from megatron_branch.integration import verl as integration
    from megatron_branch.integration.verl_cpu import register_cpu_engine, use_cpu_platform

    if on:
        # the switch subclasses the engine registered for this platform: the CPU one first (make_worker's first
        # call would register it over the switch, and a process's first switched run would be verl's own path)
        use_cpu_platform()
        register_cpu_engine()
        import megatron_branch.integration.verl_enable  # noqa: F401  (the switch itself)

        integration.unregister()
        # a second test in this process: the import above ran only once
        integration.register(options or integration.BranchOptions(schedule="replay"))
    else:
        integration.unregister()


def max_rel_grad_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert a.keys() == b.keys() and a
    worst = max(((b[k] - a[k]).norm() / a[k].norm().clamp_min(1e-30)).item() for k in a)
    name = max(a, key=lambda k: ((b[k] - a[k]).norm() / a[k].norm().clamp_min(1e-30)).item())
    return worst, name


def max_rel_step_error(a: StepOut, b: StepOut) -> tuple[float, str]:
    """max_rel_grad_error over the first AND the last optimizer step's gradients (one step: the same gradients);
    both runs took the same number of steps."""
    assert a.steps == b.steps >= 1, (a.steps, b.steps)
    return max(max_rel_grad_error(a.first_grads, b.first_grads), max_rel_grad_error(a.grads, b.grads))


def one_rank_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A one-rank gloo group (verl's engine needs torch.distributed) and the tiny policy: each one-process test
    module makes it its module fixture, `single_process = pytest.fixture(scope="module")(one_rank_world)`."""
    with one_rank(tmp_path_factory.mktemp("verl") / "hf") as hf:
        yield hf


@contextlib.contextmanager
def one_rank(out: Path, **shape: Any) -> Iterator[str]:
    """A one-rank gloo group and the tiny policy written to `out` (`shape`: write_tiny_policy's); yields its path."""
    import torch.distributed as dist

    from megatron_branch.parallel.groups import destroy_parallel, init_distributed

    _reset_megatron_aux_scale()
    init_distributed()  # a world of one
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # verl's Worker reads them (the group above already exists)
    try:
        yield write_tiny_policy(out, **shape)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        set_switch(False)
        _reset_megatron_aux_scale()
        destroy_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _reset_megatron_aux_scale() -> None:
    """megatron's MoEAuxLossAutoScaler keeps its scale class-wide and copies every later scale into the first
    tensor's shape (a 0-d one from megatron's own schedule, [1] from verl's loss scale): one engine per process in a
    real run, many in this test process, so each one-rank world starts from megatron's initial None."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
