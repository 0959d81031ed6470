"""Experts whole on every tensor-parallel rank (expert tensor parallel size 1 under TP > 1): the parameter attributes
megatron-core 0.16.1 leaves wrong for that layout, set right once, where the model is built (models/gpt.py), and the
TP group its optimizer filters the grad norm's replicas with (`count_whole_experts_in_grad_norm`, update/optimizer.py).

SHAPE LEGEND (ranks, TP2 + SP, ETP 1, EP 1): attention, embeddings and the output layer split over the TP group as
usual; each TP rank routes ITS sequence shard [s/tp, h] through every expert, held whole ([2e, h], [h, e]), so an
expert's gradient on one TP rank covers only that rank's tokens. The full gradient is the SUM over megatron's
expert-data-parallel group (tp / etp * cp * dp / ep ranks: here it spans the TP ranks), exactly once.

What megatron marks, and why each is wrong here (tensor_parallel/layers.py, 0.16.1):
- `allreduce = not (is_expert and expert_model_parallel_size > 1)`: at EP 1 an expert parameter counts as dense,
  so megatron's DDP would sum it over dp x cp only, never over the TP ranks that hold the other tokens.
  -> allreduce False: DDP's expert buffers, reduced over expt_dp (distributed_data_parallel.py).
- `tensor_model_parallel = True` with a partition_dim, whatever the group's size: a whole expert would be taken for
  a shard (checkpoint/tp.py would gather two copies side by side; megatron's grad norm would count it per TP rank).
  -> megatron's "not parallel" defaults (tensor_model_parallel False, partition_dim -1, stride 1).
- a RowParallelLinear bias carries `sequence_parallel = config.sequence_parallel`: finalize_model_grads would SUM
  linear_fc2's expert bias over TP AFTER DDP summed it over expt_dp, which already spans TP: counted twice.
  -> sequence_parallel False.
Shared experts are not routed experts (megatron builds them with is_expert False): they stay split over TP.
"""

from __future__ import annotations

import torch


def mark_whole_experts(model: torch.nn.Module) -> None:
    """Give every routed expert's parameters the attributes of a whole (unsplit), expert-data-parallel tensor (see
    the module doc) where the expert's linear layers have a one-rank TP group (megatron's expt_tp: expert tensor
    parallel size 1); experts split over TP are left as megatron marks them. Called at tensor parallel size > 1."""
    from megatron.core.utils import get_pg_size

    etp = model.config.expert_tensor_parallel_size
    for module in model.modules():
        if not getattr(module, "is_expert", False):  # megatron's Column/RowParallelLinear of a routed expert
            continue
        size = get_pg_size(module.tp_group)
        # a caller that built the model for another expert TP than parallel_state's would get whole experts marked
        # as shards (or the reverse): refused here, not left to give wrong gradients
        assert size == etp, f"experts' TP group has {size} ranks, the model was built for expert TP {etp}"
        if size > 1:
            continue
        for p in (module.weight, getattr(module, "bias", None)):
            if p is None:
                continue
            p.allreduce = False
            p.tensor_model_parallel = False
            p.partition_dim = -1
            p.partition_stride = 1
            p.sequence_parallel = False


def count_whole_experts_in_grad_norm(optimizer: object, model: torch.nn.Module) -> None:
    """Give the optimizer of whole experts (expert TP 1 < TP) the experts' own TP group for its grad norm.

    megatron-core 0.16.1's get_megatron_optimizer hands every optimizer of its chain the DENSE tensor-parallel group
    (`setattr(optimizer, 'tp_group', ...)`, optimizer/__init__.py, "TODO(M4): plumb tp_group"), with which
    `get_main_grads_for_grad_norm` drops a parameter not marked tensor-parallel on every TP rank but the first (a
    replica, for a dense parameter). A whole expert is no such replica: its gradient was summed over the expert
    data-parallel group, and its norm is reduced over the expert optimizer's own group (the plain optimizer: the
    experts' TP x PP ranks, one rank here; the distributed one: its shards over every rank). Left so, TP rank 1 of
    the plain optimizer counts no expert in its norm (a different clipping factor than rank 0's, the replicas
    drift) and the distributed optimizer drops every shard TP rank 1 holds (a smaller norm everywhere). Measured on
    a tiny Qwen3-MoE at TP2 + SP / ETP1: tests/distributed/test_train_expert_tp.py."""
    from megatron.core.utils import get_pg_size

    expert_tp = next((m.tp_group for m in model.modules() if getattr(m, "is_expert", False)), None)
    if expert_tp is None or get_pg_size(expert_tp) > 1:
        return  # no experts, or experts split over TP: megatron's marks and groups are right
    chain = getattr(optimizer, "chained_optimizers", [optimizer])
    experts = [o for o in chain if any(g["is_expert_parallel"] for g in o.param_groups)]
    if not experts:
        return  # TP 1 and EP 1: the experts are megatron's dense parameters, counted on the one TP rank
    assert len(experts) == 1, f"expected one optimizer of expert parameters, found {len(experts)}"
    experts[0].tp_group = expert_tp
