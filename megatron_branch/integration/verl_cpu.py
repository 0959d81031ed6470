"""Running verl's MegatronEngine on a CPU (gloo): the harness the verl parity tests use.

verl 0.9.1 assumes an accelerator in three places this module replaces, each scoped to the process that asks:

1. the platform: `verl.utils.device` resolves CUDA even on a CPU-only machine and `get_device_id()` then raises.
   `use_cpu_platform()` registers `CpuPlatform` through verl's own hook, `verl.plugin.platform.set_platform`
   (device "cpu", backend gloo, no memory statistics), and applies megatron-branch's megatron-core CPU shims
   (compat/cpu.py, compat/optimizer.py);
2. the attention kernel: verl packs every micro-batch to THD (`preprocess_thd_engine`) and hands megatron
   `packed_seq_params`, which on a GPU TransformerEngine's attention consumes; megatron's local
   `DotProductAttention` refuses them. `CpuVarlenAttention` is the CPU stand-in: causal attention inside each
   packed sequence of `cu_seqlens_q_padded`, in the slot TE's attention occupies; under context parallelism
   (verl's zigzag THD split) it gathers every CP rank's K/V (what TE's all-gather CP does) and attends by the rows'
   global positions (it, the layer specs and the value head: integration/verl_cpu_layers.py);
3. the model build: verl builds its GPTModel through mbridge / Megatron-Bridge, which choose TransformerEngine's
   layer spec and call `.cuda()`. `CpuModelBuild` (a mixin ahead of verl's engine class) replaces only
   `_build_tf_config` and `_build_megatron_module`: a megatron-core GPTModel of the same HF config (local spec,
   torch RMSNorm, `CpuVarlenAttention`; under pipeline parallelism this rank's stage, with the pipeline fields
   verl's provider sets: `variable_seq_lengths`, the all-to-all dispatcher), the HF weights loaded by
   megatron-branch's parameter map (this stage's share), wrapped in
   megatron DDP with verl's DDP settings. Everything else in `initialize()` is verl's: megatron's optimizer,
   the LR scheduler, the training hooks, the checkpoint manager. verl's value model (`model_type ==
   "value_model"`) is that GPTModel, untied, with the bridge's one-output head in `output_layer`
   (`CpuValueHead`: the fallback `LinearForLastLayer` of verl/models/mcore/bridge.py, which needs
   Megatron-Bridge to import), drawn from a fixed seed.

Nothing here is used on a GPU; `megatron_branch.integration.verl` does not import it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

from megatron_branch.integration.verl_cpu_layers import (  # re-exported: the harness's parts
    CpuValueHead,
    CpuVarlenAttention,
    cpu_layer_spec,
    cpu_layer_specs,
)

__all__ = [
    "CpuModelBuild",
    "CpuValueHead",
    "CpuVarlenAttention",
    "build_cpu_gpt_model",
    "cpu_layer_spec",
    "cpu_layer_specs",
    "make_cpu_platform",
    "register_cpu_engine",
    "use_cpu_platform",
    "verl_moe_overrides",
]

# --- 1. the platform ------------------------------------------------------------------------------------------


def _cpu_device_module() -> SimpleNamespace:
    """What verl calls on `get_torch_device()`, on the host (memory statistics are 0: there is no device)."""
    return SimpleNamespace(
        synchronize=lambda *a, **k: None,
        empty_cache=lambda: None,
        max_memory_allocated=lambda *a, **k: 0,
        max_memory_reserved=lambda *a, **k: 0,
        memory_allocated=lambda *a, **k: 0,
        memory_reserved=lambda *a, **k: 0,
        reset_peak_memory_stats=lambda *a, **k: None,
        mem_get_info=lambda *a, **k: (0, 0),
        device_count=lambda: 1,
        get_device_name=lambda *a, **k: "CPU",
        current_device=lambda: "cpu",
        set_device=lambda *a, **k: None,
        is_available=lambda: True,
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        get_rng_state=torch.get_rng_state,
        set_rng_state=torch.set_rng_state,
    )


def make_cpu_platform() -> Any:
    """An instance of verl's PlatformBase for the host CPU (gloo)."""
    from verl.plugin.platform.platform_base import PlatformBase

    class CpuPlatform(PlatformBase):
        """verl's platform interface on a CPU-only machine: device "cpu", gloo, no memory statistics."""

        device_name = "cpu"  # type: ignore[assignment]
        vendor_name = "cpu"  # type: ignore[assignment]

        def __init__(self) -> None:
            self._module = _cpu_device_module()

        @property
        def device_module(self) -> Any:  # type: ignore[override]
            return self._module

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return True

        def current_device(self) -> Any:  # type: ignore[override]
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CPU_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str) -> Iterator[None]:
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return CpuPlatform()


def use_cpu_platform() -> None:
    """Register the CPU platform with verl (before verl resolves one) and apply the megatron-core CPU shims."""
    from verl.plugin.platform import platform_manager

    from megatron_branch.compat.cpu import apply_cpu_shims
    from megatron_branch.compat.optimizer import apply_optimizer_shims

    current = platform_manager._current_platform  # verl's singleton: set it once, keep it afterwards
    if current is None or current.device_name != "cpu":
        platform_manager.set_platform(make_cpu_platform())
    import verl.utils.megatron.router_replay_utils as router_replay_utils

    # verl read the device once, at its import (CUDA then): where router replay moves routes
    router_replay_utils.device_name = "cpu"
    apply_cpu_shims()
    apply_optimizer_shims()


# --- 3. the model build (2., the attention kernel: verl_cpu_layers.py) ----------------------------------------


def verl_moe_overrides(engine_config: Any) -> dict[str, Any]:
    """The MoE fields verl's `_build_tf_config` sets on the bridge's provider (transformer_impl.py: EP / ETP from
    the engine config, the all-to-all dispatcher, no load balancing), then the user's
    `override_transformer_config`, which wins there too; under router replay, megatron's routing-replay flag."""
    out: dict[str, Any] = {
        "expert_model_parallel_size": engine_config.expert_model_parallel_size,
        "expert_tensor_parallel_size": engine_config.expert_tensor_parallel_size,
        "moe_token_dispatcher_type": "alltoall",
        "moe_router_load_balancing_type": "none",
    }
    if engine_config.router_replay.mode != "disabled":  # verl sets it on the config it built
        out["moe_enable_routing_replay"] = True
    out.update(dict(engine_config.override_transformer_config or {}))
    return out


def build_cpu_gpt_model(
    hf_dir: str, hf_config: Any, *, dtype: torch.dtype, engine_config: Any = None
) -> torch.nn.Module:
    """The megatron-core GPTModel verl's bridge would build for `hf_config`, on the host, with the weights of
    `hf_dir` (this rank's tensor-parallel shards and expert-parallel experts); a MoE's fields from
    `engine_config` as verl sets them (verl_moe_overrides)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_branch.assembly import load_hf_weights
    from megatron_branch.compat.norm import TorchNorm
    from megatron_branch.models import ModelArch
    from megatron_branch.parallel.groups import ParallelGroups

    arch = ModelArch.from_hf_config(hf_config, where=f"{hf_dir}/config.json")
    tp = ps.get_tensor_model_parallel_world_size()
    overrides: dict[str, Any] = {}
    if arch.multi_latent:
        from megatron_branch.compat.mla import apply_mla_shims

        apply_mla_shims()
    if arch.is_moe:
        from megatron_branch.compat.moe import apply_moe_shims

        apply_moe_shims()
        overrides = verl_moe_overrides(engine_config)
    if arch.is_hybrid:  # megatron's GatedDeltaNet on its torch path (compat/gdn.py)
        from megatron_branch.compat.gdn import apply_gdn_shims

        apply_gdn_shims()
    # context_parallel_size as verl's bridge provider sets it (so the tree path meets the config a GPU run has)
    overrides.setdefault("context_parallel_size", ps.get_context_parallel_world_size())
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    if pp > 1:  # this stage's GPTModel, with the pipeline fields of verl's bridge provider
        from megatron_branch.compat.pipeline import apply_pipeline_shims

        apply_pipeline_shims()
        overrides.update(pipeline_model_parallel_size=pp, pipeline_dtype=dtype, variable_seq_lengths=True)
        # verl's dispatcher on every model: megatron refuses variable_seq_lengths with its allgather default
        overrides.setdefault("moe_token_dispatcher_type", "alltoall")
    config = arch.to_transformer_config(dtype=dtype, tp=tp, sequence_parallel=tp > 1, **overrides)
    per_stage = arch.num_layers // pp  # megatron's even split (the switch refuses an uneven one: verl_pp.py)
    model = GPTModel(
        config=config,
        transformer_layer_spec=TransformerBlockSubmodules(
            layer_specs=cpu_layer_specs(arch)[pp_rank * per_stage : (pp_rank + 1) * per_stage],
            layer_norm=TorchNorm,
        ),
        vocab_size=arch.padded_vocab_size(tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=arch.rotary_percent,  # Qwen3.5's partial RoPE (the bridge's rotary_percent)
        rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
    )
    # the sigmoid router's correction bias (DeepSeek-V3, GLM-4.5): a frozen parameter, as models/moe.py keeps it, so
    # that the loader (which walks parameters) fills it from the checkpoint
    for m in model.modules():
        if isinstance(getattr(m, "expert_bias", None), torch.Tensor) and "expert_bias" in m._buffers:
            m.expert_bias = torch.nn.Parameter(m._buffers.pop("expert_bias"), requires_grad=False)
    groups = ParallelGroups.from_parallel_state(sequence_parallel=tp > 1)
    if arch.is_hybrid:
        from megatron_branch.models.gdn import mark_gdn_partition_dims

        mark_gdn_partition_dims(model)  # the loader shards conv1d / dt_bias / A_log by it
    load_hf_weights(model, hf_dir, arch, groups, dtype)  # the run assembly's one loader
    return model


class CpuModelBuild:
    """Mixin placed before a verl MegatronEngine class: the model is built on the host (see the module doc)."""

    def _build_tf_config(self) -> None:
        from verl.utils.torch_dtypes import PrecisionType

        self.is_value_model = self.model_config.model_type == "value_model"
        self.share_embeddings_and_output_weights = self.model_config.share_embeddings_and_output_weights
        self.param_dtype = PrecisionType.to_dtype(self.engine_config.dtype)
        self.dtype = self.param_dtype
        self.provider = None
        self.vanilla_bridge = True
        self.bridge = None
        self.weight_converter = None
        self.peft_cls = None
        self.tf_config = None  # set from the built model

    def _build_megatron_module(self) -> list[torch.nn.Module]:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.process_groups_config import ProcessGroupCollection

        if self.is_value_model:  # verl: a value head cannot share the vocabulary embedding
            self.model_config.hf_config.tie_word_embeddings = False
        model = build_cpu_gpt_model(
            self.model_config.local_path,
            self.model_config.hf_config,
            dtype=self.param_dtype,
            engine_config=self.engine_config,
        )
        if self.is_value_model:
            model.output_layer = CpuValueHead(
                model.config.hidden_size, sequence_parallel=model.config.sequence_parallel
            )
        # the one transformer override the CPU tests exercise (Megatron-Bridge sets it at CP > 1 on a GPU); it
        # must be set before DDP is built (DDP averages over dp x cp only without it)
        per_token = self.engine_config.override_transformer_config.get("calculate_per_token_loss", False)
        model.config.calculate_per_token_loss = bool(per_token)
        self.tf_config = model.config
        if self.engine_config.forward_only:
            return [model]
        ddp_overrides = self._resolve_override_ddp_config()
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=self.engine_config.use_distributed_optimizer, **ddp_overrides
        )
        ddp = DistributedDataParallel(
            model.config, ddp_config, model, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
        )
        return [ddp]


def register_cpu_engine() -> type:
    """verl's MegatronEngineWithLMHead (and MegatronEngineWithValueHead) with the host model build, registered as
    verl's Megatron language-model (value-model) engine for device "cpu" (what verl itself registers for "cuda");
    idempotent. Returns the language-model class."""
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.megatron import MegatronEngineWithLMHead, MegatronEngineWithValueHead

    for model_type, base in (
        ("value_model", MegatronEngineWithValueHead),
        ("language_model", MegatronEngineWithLMHead),
    ):
        registry = EngineRegistry._engines.setdefault(model_type, {}).setdefault("megatron", {})
        if "cpu" not in registry:
            registry["cpu"] = type(f"Cpu{base.__name__}", (CpuModelBuild, base), {})
    return registry["cpu"]
