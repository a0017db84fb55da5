"""Expert parallelism: each rank of an ``ep`` group holds ``n_experts / ep`` experts and tokens
travel to them by all-to-all; expert weights are then FSDP-sharded over ``edp x efsdp``.

The expert mesh ``(edp, efsdp, ep)`` (see `ParallelDims`) lays its ``ep`` ranks inside one FSDP
group. Ranks with the same ``ep`` coordinate hold the same experts: their gradients are summed
by the expert FSDP unit (reduce-scatter over ``efsdp``, all-reduce over ``edp``), while the
all-to-all's backward already brings every token's gradient to the rank owning its expert.
Together that sums each expert's gradient over every data rank, as one process would.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from temper.models.layers.experts import Experts
from temper.models.layers.moe import MoE, moe_layers
from temper.utils.compat import all_to_all_single_autograd, functional_all_to_all


class AllToAllDispatcher:
    """Sends each expert's rows to the rank holding it and brings the outputs back.

    Split sizes travel first (an all-to-all of the per-expert counts), then the rows by an
    uneven all-to-all with autograd, so the backward returns row gradients the same way.
    Both are functional collectives, whose outputs selective activation checkpointing keeps:
    a recomputed forward sends nothing. It always runs eagerly, as its split sizes are read
    on the host: a compiled decoding step breaks its graph around it, and training compiles
    each block's parts around it (`apply_compile`).
    """

    def __init__(self, group: dist.ProcessGroup, n_experts: int) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.n_local = n_experts // self.ep

    @torch.compiler.disable
    def __call__(self, experts: Experts, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [T, dim] sorted by global expert, counts [E] -> expert outputs in rows' order."""
        received = functional_all_to_all(counts, None, None, self.group)
        # received[s * n_local + j]: rows that rank s sends to this rank's expert j.
        per_source = received.view(self.ep, self.n_local)
        send = counts.view(self.ep, self.n_local).sum(dim=1).tolist()
        recv = per_source.sum(dim=1).tolist()
        x = all_to_all_single_autograd(rows, recv, send, self.group)
        # Rows arrive grouped by source, then expert; the grouped GEMM wants them by expert.
        local_expert = torch.arange(self.n_local, device=rows.device).repeat(self.ep)
        order = local_expert.repeat_interleave(received).argsort(stable=True)
        offsets = per_source.sum(dim=0).cumsum(0, dtype=torch.int32)
        y = experts(x[order], offsets)
        y = y.new_empty(y.shape).index_copy(0, order, y)
        return all_to_all_single_autograd(y, send, recv, self.group)


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard every MoE layer's stacked expert weights by expert over ``mesh["ep"]`` (on meta:
    no data moves) and route its tokens through an `AllToAllDispatcher`."""
    ep_mesh = mesh["ep"]
    for moe in _moe_layers(model):
        for name, param in list(moe.experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, ep_mesh, [Shard(0)], src_data_rank=None)
            moe.experts.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
        moe.use_dispatcher(AllToAllDispatcher(ep_mesh.get_group(), moe.n_experts))


def apply_expert_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    reshard: bool,
    offload: OffloadPolicy | None = None,
) -> None:
    """One FSDP unit per experts module over ``edp x efsdp`` (HSDP when ``edp > 1``).

    Must run before the outer FSDP2: a nested ``fully_shard`` owns its parameters, so the
    block units around it leave them alone and no parameter is managed twice.
    """
    dp_mesh = mesh["edp", "efsdp"] if mesh["edp"].size() > 1 else mesh["efsdp"]
    for moe in _moe_layers(model):
        fully_shard(
            moe.experts,
            mesh=dp_mesh,
            mp_policy=mp_policy,
            offload_policy=offload or OffloadPolicy(),
            reshard_after_forward=reshard,
        )


def _moe_layers(model: nn.Module) -> list[MoE]:
    layers = list(moe_layers(model).values())
    if not layers:
        raise ValueError("parallelism.ep > 1 needs a mixture-of-experts model; this has no MoE")
    return layers
